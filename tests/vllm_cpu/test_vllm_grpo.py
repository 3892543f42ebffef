"""GRPO rollouts on vLLM (esbatch/backends/vllm_policy.py) against HF rollouts, on the tiny model in fp32.

(a) In process: after each of several optimizer steps, the engine loaded through the RPC (no file) decodes greedily
exactly as HF does from the trained module, with prefix caching on (reset after each load).

(b) Two 2-rank `esbatch train` GRPO runs, vLLM and HF rollouts, end at the same center, bit for bit. Decoding must
be deterministic for the two backends to draw the same tokens (they sample with different generators), so the
runs decode with top_p = 1e-6 (argmax; greedy itself allows one response per prompt). Then the G responses of a
group are identical and their group-relative advantages sum to zero: the policy-gradient term is exactly 0. What
moves the policy is the KL term (beta > 0), evaluated on the rollout tokens, set going by weight decay (policy =
reference at step 0), so the center depends on the rollouts: with the engine's loads left out (a worker whose
es_set_weights does nothing; measured once on one rank) the last step's rollouts differ and the center ends 0.074
away (max abs) from the HF run's. With sampling (top_p 1, G=4, lr 1e-3, 4 steps, one rank) the two backends draw
different tokens and the centers differ by 0.008 (max abs): measured once, not tested.

(c) A pipeline ES -> GRPO on vllm: the GRPO stage's engine starts on the ES stage's center.

(d) An engine that ignores a weight load (answers as if it had copied the tensors): the check after the sync
(sampled coordinates, engine against trainer) stops the run before it trains on stale rollouts. With the engine in
its own process (backend.policy_engine: separate); (a) and (b) run it in the trainer's process (the default).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from toy import run_esbatch
from toy_vllm import train

from esbatch.backends import mempolicy
from esbatch.backends.base import SamplingParams
from esbatch.backends.config import BackendConfig, ESSetup
from esbatch.models import ModelConfig, checksum, load_model_and_tokenizer, load_weights

pytestmark = pytest.mark.xdist_group("vllm-grpo")  # one worker starts the module's engine

GREEDY = SamplingParams(0.0, 1.0, 12)
START: dict = {}  # the trainer thread's NUMA memory policy around the engine's start (the policy fixture)
ARGMAX = {"temperature": 1.0, "top_p": 1e-6, "max_new_tokens": 8, "batch_size": 16}  # what (b) and (c) decode with


@pytest.fixture(scope="module")
def policy(vllm_tiny):
    """The tiny model (trained in the tests) and the vLLM policy generator built from it through the registry."""
    from esbatch.backends import BACKENDS

    model, tok = load_model_and_tokenizer(str(vllm_tiny), dtype="float32")
    model.requires_grad_(True)  # loaded for inference; trained here as GRPO trains it
    setup = ESSetup(
        ModelConfig(name=str(vllm_tiny), dtype="float32"),
        BackendConfig(name="vllm", kv_cache_gb=1, max_model_len=256),
        batch_size=8,
        track_drift=False,
        seed=3,
    )
    real_apply = mempolicy.apply
    START["before"] = mempolicy.current()
    with pytest.MonkeyPatch.context() as mp:  # what mempolicy.kept() restores after the engine starts
        mp.setattr(mempolicy, "apply", lambda p: (START.setdefault("applied", []).append(p), real_apply(p))[1])
        gen = BACKENDS.get("vllm").for_policy(model, tok, setup)
    START["after"] = mempolicy.current()
    yield model, tok, gen
    gen.close()


def test_the_engine_in_process_leaves_the_trainers_memory_policy_as_it_was(policy):
    """vLLM's CPU worker binds the memory of the thread that builds it to one NUMA node (MPOL_BIND, strict); in
    process that is the trainer's main thread, whose memory would stay confined to one node (mempolicy.py). The
    engine's start restores the thread's policy: vLLM did bind it (mempolicy.kept had something to restore), and
    after the start it is what it was before."""
    assert START["before"] is not None, "get_mempolicy is not available on this machine"
    assert START.get("applied") == [START["before"]], (
        f"vLLM's CPU worker did not change the policy ({mempolicy.describe(START['before'])}): nothing restored"
    )
    assert START["after"] == START["before"], mempolicy.describe(START["after"])


def token_ids(gens) -> list[list[int]]:
    return [g.token_ids for g in gens]


def test_greedy_rollouts_follow_the_trained_module_after_every_step(policy):
    from esbatch.backends.hf import HFGenerator
    from esbatch.grpo.core import token_logprobs

    model, tok, gen = policy
    hf = HFGenerator(model, tok, batch_size=8)
    # long enough to fill several KV blocks: a prefix cache left over from older weights would show
    questions = ["Say a digit " + "and then another one, " * 4 + str(i) for i in range(4)]
    prompts = [gen.chat_prompt([{"role": "user", "content": q}]) for q in questions]
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    seen = []
    for step in range(4):
        ours, theirs = token_ids(gen.generate(prompts, GREEDY, step)), token_ids(hf.generate(prompts, GREEDY, step))
        assert ours == theirs, step
        assert gen.checksum() == checksum(dict(model.named_parameters()))
        seen.append(ours)
        # one policy-gradient step on the rollouts: up the first and third responses, down the others
        seqs = [tok(p, add_special_tokens=False)["input_ids"] + r for p, r in zip(prompts, ours)]
        width = max(len(x) for x in seqs)
        ids = torch.tensor([x + [0] * (width - len(x)) for x in seqs])
        attn = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in seqs])
        resp = torch.tensor(
            [[0] * (len(x) - len(r)) + [1] * len(r) + [0] * (width - len(x)) for x, r in zip(seqs, ours)]
        )
        logp = token_logprobs(model(input_ids=ids, attention_mask=attn).logits[:, :-1], ids[:, 1:], 1.0)
        loss = -((logp * resp[:, 1:]).sum(1) * adv).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        gen.load_policy(model.named_parameters())
    assert len({str(s) for s in seen}) > 1  # the greedy answers moved with the training: the loads mattered
    assert token_ids(gen.generate(prompts, GREEDY, 0)) == token_ids(hf.generate(prompts, GREEDY, 0))


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_engine_logprobs_are_the_trainers_to_1e4_in_fp32(policy, top_p):
    """grpo.rollout_correction's input: vLLM's log-prob of each sampled token (processed_logprobs: after the
    temperature and top_p) against the trainer's own forward, and against the HF generator's (the same quantity)."""
    from esbatch.backends.hf import HFGenerator
    from esbatch.grpo.core import token_logprobs

    model, tok, gen = policy
    gen.load_policy(model.named_parameters())
    prompts = [gen.chat_prompt([{"role": "user", "content": f"Say a digit #{i}"}]) for i in range(3)]
    sampling = SamplingParams(0.9, top_p, 10, n=4, logprobs=True)
    gens = gen.generate(prompts, sampling, 11)
    diffs = []
    for j, g in enumerate(gens):
        p = tok(prompts[j // 4], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([p + g.token_ids])
        with torch.no_grad():
            want = token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:], 0.9)[0, len(p) - 1 :]
        got = torch.tensor(g.logprobs)
        assert len(g.logprobs) == len(g.token_ids) > 0
        if top_p == 1.0:
            diffs.append((got - want).abs())
        else:  # the nucleus renormalised: at least the full distribution's log-prob
            assert bool((got >= want - 1e-4).all())
    if top_p == 1.0:
        d = torch.cat(diffs)
        print(f"vLLM vs trainer log-probs (fp32, CPU): mean |diff| {float(d.mean()):.2e}, max {float(d.max()):.2e}")
        assert float(d.max()) <= 1e-4
    # the HF generator's log-probs of its own samples are the same quantity (its own test compares it to the trainer)
    hf = HFGenerator(model, tok, batch_size=8).generate(prompts[:1], sampling, 11)
    assert all(len(g.logprobs) == len(g.token_ids) for g in hf)


def test_a_load_moves_only_the_tensors_sent_and_the_engine_keeps_no_copy(policy):
    model, _, gen = policy
    name = "model.norm.weight"
    gen.bucket_bytes = 0  # one RPC per tensor
    with torch.no_grad():
        model.get_parameter(name).mul_(1.5)
    assert gen.checksum() != checksum(dict(model.named_parameters()))
    gen.load_policy([(name, model.get_parameter(name))])  # the one tensor that changed
    assert gen.checksum() == checksum(dict(model.named_parameters()))
    n_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert gen.memory_report() == {"model_bytes": n_bytes, "master_bytes": 0, "theta0_bytes": 0}
    with pytest.raises(RuntimeError, match="no engine weight has the HF name"):
        gen.load_policy([("model.nothing.weight", torch.zeros(2))])
    with pytest.raises(RuntimeError, match=r"model.norm.weight is \(3,\), the engine's \(128,\)"):
        gen.load_policy([(name, torch.zeros(3))])


def grpo_config(tmp: Path, model: Path, name: str, backend: str) -> Path:
    """A 2-rank GRPO run (4 prompts, all in every batch) decoding by argmax, the KL term moving the policy."""
    cfg = {
        "algorithm": "grpo",
        "run": {"name": name, "seed": 3, "output_dir": str(tmp / "runs"), "threads": 1, "nproc_per_node": 2},
        "model": {"name": str(model), "dtype": "float32"},
        "backend": {"name": backend, "kv_cache_gb": 1, "max_model_len": 256},
        "task": {
            "name": "toy_vllm:RecordingDigitTask",
            "params": {"size": 4, "log": str(tmp / f"{name}.responses")},
            "heldout_size": 0,
            "few_shot": 1,
        },
        "generation": ARGMAX,
        "grpo": {
            "group_size": 2,
            "batch_size": 4,
            "learning_rate": 0.05,
            "weight_decay": 1.0,
            "beta": 0.5,
            "updates": 4,
        },
        "eval": {"every": 0},
        "tracking": {"experiment": "grpo"},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def responses(path: Path) -> list[tuple[str, str]]:
    """(question, response) of every line a RecordingDigitTask wrote, in order (its process id dropped)."""
    return [tuple(line.split("\t")[1:]) for line in path.read_text().splitlines()]


def test_grpo_with_vllm_rollouts_ends_where_hf_rollouts_do(tmp_path, vllm_tiny):
    runs = {b: train(grpo_config(tmp_path, vllm_tiny, b, b)) for b in ("vllm", "hf")}
    for rank in (0, 1):
        ours, theirs = (responses(tmp_path / f"{b}.responses.rank{rank}") for b in ("vllm", "hf"))
        assert ours == theirs and len(ours) == 4 * 2 * 2  # 4 steps x 2 prompts x G=2 on each rank
        texts = [{r for _, r in ours[i : i + 4]} for i in range(0, len(ours), 4)]
        assert texts[0] != texts[-1]  # the rollouts changed with the policy: a stale engine's would differ
    a, b = (load_file(str(runs[k] / "center.safetensors")) for k in ("vllm", "hf"))
    assert max(float((a[n] - b[n]).abs().max()) for n in a) == 0.0
    logs = {k: [yaml.safe_load(x) for x in (runs[k] / "log.jsonl").read_text().splitlines()] for k in runs}
    for k in runs:
        assert all(r["param_checksums"][0] == r["param_checksums"][1] for r in logs[k])  # the ranks agree
        assert (
            logs[k][-1]["metrics"]["policy/kl"] > 0 and logs[k][-1]["param_checksums"] != logs[k][0]["param_checksums"]
        )
    sync = [r["metrics"]["time/weight_sync_s"] for r in logs["vllm"]]
    assert sync[0] == 0 and all(s > 0 for s in sync[1:])  # loaded at start-up, then before each step's rollouts
    assert all(r["metrics"]["time/weight_sync_s"] < 0.05 for r in logs["hf"])  # nothing to load: HF reads the module


def test_a_pipeline_es_then_grpo_on_vllm(tmp_path, vllm_tiny):
    from esbatch.backends.hf import HFGenerator
    from esbatch.config import load_config
    from esbatch.train.problems import load_problems

    cfg = {
        "algorithm": "pipeline",
        "pipeline": {"stages": ["es", "grpo"], "updates": 2},
        "run": {"name": "p", "seed": 3, "output_dir": str(tmp_path / "runs"), "threads": 1},
        "model": {"name": str(vllm_tiny), "dtype": "float32"},
        "backend": {"name": "vllm", "kv_cache_gb": 1, "max_model_len": 256},
        "task": {
            "name": "toy_vllm:RecordingDigitTask",
            "params": {"size": 4, "log": str(tmp_path / "responses")},
            "heldout_size": 0,
            "few_shot": 1,
        },
        "generation": ARGMAX,
        "es": {"population_size": 4, "sigma": 0.1, "alpha": 0.5, "batch_size": 4},
        # argmax rollouts: identical within a group, no policy gradient; weight decay moves the weights (b)
        "grpo": {"group_size": 2, "batch_size": 4, "learning_rate": 0.01, "weight_decay": 1.0},
        "eval": {"every": 0},
        "tracking": {"experiment": "pipe"},
    }
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rd = train(path)
    stage1, stage2 = rd / "stage1-es", rd / "stage2-grpo"
    assert yaml.safe_load((stage2 / "config.yaml").read_text())["model"]["init_weights"] == str(
        stage1 / "center.safetensors"
    )
    assert [len(x.splitlines()) for x in ((s / "log.jsonl").read_text() for s in (stage1, stage2))] == [1, 1]
    lines = [line.split("\t") for line in (tmp_path / "responses.rank0").read_text().splitlines()]
    grpo_pid = lines[-1][0]
    first = {q: r for pid, q, r in lines if pid == grpo_pid}  # the GRPO stage's only rollouts: before its step
    assert len(first) == 4 and len(lines) == 4 * 4 + 4 * 2  # ES: 4 members x 4 prompts; GRPO: 4 prompts x G=2
    # they are the ES center's greedy answers (and not the base model's): the engine started on that center
    model, tok = load_model_and_tokenizer(str(vllm_tiny), dtype="float32")
    hf = HFGenerator(model, tok, batch_size=8)
    probs = load_problems(load_config(str(stage2 / "config.yaml")), hf)
    prompts = dict(zip((e.question for e in probs.train), probs.train_prompts))
    greedy = SamplingParams(0.0, 1.0, ARGMAX["max_new_tokens"])
    base = [repr(g.text) for g in hf.generate(list(prompts.values()), greedy, 0)]
    load_weights(model, str(stage1 / "center.safetensors"))
    es = [repr(g.text) for g in hf.generate(list(prompts.values()), greedy, 0)]
    assert [first[q] for q in prompts] == es != base
    final = load_file(str(rd / "center.safetensors"))
    es_center = load_file(str(stage1 / "center.safetensors"))
    assert any(not torch.equal(final[n], es_center[n]) for n in final)  # the GRPO stage's step moved the weights


def test_an_engine_that_ignores_a_weight_load_stops_the_run(tmp_path, vllm_tiny):
    path = grpo_config(tmp_path, vllm_tiny, "stale", "vllm")
    cfg = yaml.safe_load(path.read_text())
    cfg["run"]["nproc_per_node"] = 1
    cfg["grpo"]["updates"] = 3
    cfg["backend"].update(policy_engine="separate", worker_extension="toy_vllm:IgnoringLoadsWorkerExtension")
    path.write_text(yaml.safe_dump(cfg))
    p = run_esbatch("train", str(path), "--no-progress", timeout=900, threads=None)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert "StaleEngineError" in out and "its rollouts would come from stale weights" in out, out[-3000:]
    assert "(GRPO rollouts, separate process, weight transfer rpc)" in out  # CPU: rpc, the only transport
    rd = tmp_path / "runs" / "stale"
    log = [yaml.safe_load(x) for x in (rd / "log.jsonl").read_text().splitlines()]
    # the engine started on the model files, which the start-up load matches: the first step ran, its optimizer
    # step moved the policy, and the load before the second step's rollouts was the first one the engine ignored
    assert [r["t"] for r in log] == [0]
    assert yaml.safe_load((rd / "run.json").read_text())["status"] == "failed"
