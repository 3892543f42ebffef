"""Low-rank ES (es.perturbation: lowrank): the batched forward and generations against materialized member models,
the update against a float64 sum by hand, bit-identical replay, and the config checks.

Member weights are built here independently of the backend: A and B from the numpy reference generator
(tests/noise_reference.py) for the derived names "<name>#A" / "<name>#B", W + s A B^T / sqrt(r) in float64."""

import copy
import math

import pytest
import torch
from noise_reference import eps_tensor

from esbatch.backends import BACKENDS, PerturbedMember, SamplingParams
from esbatch.backends.hf import HFGenerator
from esbatch.backends.hf_lowrank import HFLowRankBackend
from esbatch.config import ConfigError, config_from_dict
from esbatch.es.config import LOWRANK_VECTORS, PERTURBATIONS, backend_setup
from esbatch.es.replay import replay
from esbatch.es.trainer import es_step
from esbatch.perturb import lowrank
from esbatch.perturb.lowrank import lowrank_update
from esbatch.perturb.noise import direction
from esbatch.perturb.update import UpdateSpec
from esbatch.train.problems import load_problems

FP32_ATOL = 2e-5  # logits of order 1: batched x W^T + s (x B) A^T vs x (W + s A B^T)^T, fp32 rounding only
MEMBERS = [PerturbedMember(*m) for m in [(11, 0.05, 101), (11, -0.05, 101), (2**32 - 1, 0.05, 7), (5, 0.02, 8)]]


def _eps(seed, name, shape):
    return eps_tensor(seed, name, tuple(shape)).double()


def member_state(params, seed, scale, rank, vectors):
    """theta + scale * E(seed) in float64, by hand: A B^T / sqrt(r) on matrices, eps on the rest (vectors: full)."""
    out = {}
    for name, p in params.items():
        w = p.detach().double()
        if p.dim() == 2:
            a, b = _eps(seed, f"{name}#A", (p.shape[0], rank)), _eps(seed, f"{name}#B", (p.shape[1], rank))
            w = w + scale * (a @ b.T) / math.sqrt(rank)
        elif vectors == "full":
            w = w + scale * _eps(seed, name, p.shape)
        out[name] = w
    return out


def materialized(backend, seed, scale, rank, vectors):
    """A copy of the backend's model holding member (seed, scale) in its weights."""
    model = copy.deepcopy(backend.model)
    state = member_state(dict(backend.model.named_parameters()), seed, scale, rank, vectors)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[name].to(p.dtype))
    return model


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def tiny_model(kind, vocab):
    """Llama with tied embeddings (as tests/unit/test_layout.py) or Qwen2 (q/k/v biases, untied lm_head)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    )
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
        with torch.no_grad():  # HF initializes biases to zero: give them values so their noise is visible
            for n, p in model.named_parameters():
                if n.endswith("bias"):
                    p.normal_(0, 0.1)
    return model.eval()


def backend_for(kind, tok, rank=2, vectors="full", batch_size=64):
    return HFLowRankBackend(tiny_model(kind, len(tok)), tok, batch_size=batch_size, rank=rank, vectors=vectors)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize(("rank", "vectors"), [(1, "full"), (3, "frozen")])
def test_batched_forward_equals_materialized_members(tok, kind, rank, vectors):
    b = backend_for(kind, tok, rank, vectors)
    ids = torch.randint(5, len(tok), (3, 7), generator=torch.Generator().manual_seed(1))  # 3 rows per member
    pop = b.population
    with pop._hooked():
        pop._batch = pop._prepare(MEMBERS)
        got = b.model(input_ids=ids.repeat(len(MEMBERS), 1)).logits.view(len(MEMBERS), 3, 7, -1)
    base = b.model(input_ids=ids).logits
    for k, (seed, scale, _) in enumerate(MEMBERS):
        want = materialized(b, seed, scale, rank, vectors)(input_ids=ids).logits
        assert (want - base).abs().max() > 100 * FP32_ATOL  # the perturbation shows in the logits
        torch.testing.assert_close(got[k], want, rtol=0, atol=FP32_ATOL)
    assert torch.equal(b.model(input_ids=ids).logits, base)  # hooks gone: the center again


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_generations_of_the_batch_equal_the_materialized_members(tok, kind):
    b = backend_for(kind, tok, rank=2, batch_size=6)  # 3 prompts: two members per generate call
    prompts = ["1+2=", "hello there", "x"]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    pop = b.evaluate_population(MEMBERS, prompts, greedy)
    for (seed, scale, g), gens in zip(MEMBERS, pop.generations):
        ref = HFGenerator(materialized(b, seed, scale, 2, "full"), tok).generate(prompts, greedy, g)
        assert [x.token_ids for x in gens] == [x.token_ids for x in ref]
    assert len({tuple(x.token_ids) for gens in pop.generations for x in gens}) > 3  # members differ


@pytest.mark.parametrize("batch_size", [64, 3])  # every member in one call; each member split over two calls
def test_sampled_generations_follow_each_members_own_seed(tok, batch_size):
    b = backend_for("qwen2", tok, rank=1, batch_size=batch_size)
    prompts = ["1+2=", "hello there", "x"]
    sampling = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=10, n=2, entropy=True)
    pop = b.evaluate_population(MEMBERS, prompts, sampling)
    for (seed, scale, g), gens in zip(MEMBERS, pop.generations):
        ref = HFGenerator(materialized(b, seed, scale, 1, "full"), tok, batch_size=batch_size)
        want = ref.generate(prompts, sampling, g)
        assert [x.token_ids for x in gens] == [x.token_ids for x in want]
        assert [x.entropy for x in gens] == pytest.approx([x.entropy for x in want], abs=1e-4)
    again = b.evaluate_population(MEMBERS, prompts, sampling).generations
    assert [[x.token_ids for x in m] for m in again] == [[x.token_ids for x in m] for m in pop.generations]


def test_a_rank_taking_members_from_a_shared_claim_gets_each_members_own_responses(tok):
    """es.dispatch: dynamic over ranks: a claim hands this rank members 3, 0, 2 (not 1); it evaluates them in
    calls of whole members and reports them ascending, each with the responses of the unclaimed evaluation."""
    b = backend_for("llama", tok, rank=1, batch_size=4)  # 2 prompts: 2 members per call
    prompts = ["1+2=", "x"]
    sampling = SamplingParams(temperature=0.8, top_p=1.0, max_new_tokens=6)
    full = b.evaluate_population(MEMBERS, prompts, sampling)
    handed = iter([3, 0, 2])
    pop = b.evaluate_population(MEMBERS, prompts, sampling, claim=lambda: next(handed, None))
    assert pop.members == [0, 2, 3]
    want = [[x.token_ids for x in full.generations[i]] for i in (0, 2, 3)]
    assert [[x.token_ids for x in m] for m in pop.generations] == want


def test_calls_take_whole_members_or_split_one_like_generate(tok):
    b = backend_for("llama", tok, batch_size=8)
    assert b.population.calls(5, 4, 1) == [([0, 1], slice(0, 4)), ([2, 3], slice(0, 4)), ([4], slice(0, 4))]
    assert b.population.calls(2, 5, 2) == [
        ([0], slice(0, 4)),
        ([0], slice(4, 5)),
        ([1], slice(0, 4)),
        ([1], slice(4, 5)),
    ]


@pytest.mark.parametrize("vectors", LOWRANK_VECTORS)
def test_perturb_materializes_the_member(tok, vectors):
    b = backend_for("qwen2", tok, rank=2, vectors=vectors)
    want = member_state(b.params, 9, -0.03, 2, vectors)
    before = {n: p.detach().clone() for n, p in b.params.items()}
    b.perturb(9, -0.03)
    for name, p in b.params.items():
        torch.testing.assert_close(p.double(), want[name], rtol=0, atol=1e-6)
    b.restore()
    assert all(torch.equal(p, before[n]) for n, p in b.params.items())


@pytest.mark.parametrize("noise", ["philox-gauss", "philox-rademacher", "legacy-cpu"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_populations_draw_at_once_has_each_members_bits(noise, threads, monkeypatch):
    """LowRankWeights.population (one round of C kernel jobs) against factors / direction member by member, scaled
    as the batched forwards did before: bit for bit, a factor longer than a kernel job (noise.JOB) included."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    live = {"emb": torch.zeros(70_001, 3), "m.weight": torch.zeros(7, 5), "norm.weight": torch.zeros(5)}
    w = lowrank.LowRankWeights(live, track_drift=False, noise=noise, rank=4)
    members = [(11, 0.05), (11, -0.05), (2**32 - 1, 1e-3), (0, -0.3)]
    mats, vecs = w.population(members)
    assert sorted(mats) == ["emb", "m.weight"] and sorted(vecs) == ["norm.weight"]
    for i, (seed, s) in enumerate(members):
        for name, (a, b) in mats.items():
            fa, fb = lowrank.factors(seed, name, live[name].shape, 4, noise)
            assert torch.equal(a[i], fa.mul_(s * 0.5)) and torch.equal(b[i], fb), (name, i)
        assert torch.equal(vecs["norm.weight"][i], direction(seed, "norm.weight", (5,), noise) * s)
    if noise != "legacy-cpu":  # the stack holds the generator's own values: one factor against the numpy reference
        want = eps_tensor(11, "m.weight#B", (5, 4), noise.removeprefix("philox-"))
        assert torch.equal(mats["m.weight"][1][0], want)


@pytest.mark.parametrize("vectors", LOWRANK_VECTORS)
@pytest.mark.parametrize("rank", [1, 4])
def test_update_is_the_explicit_low_rank_sum(vectors, rank):
    torch.manual_seed(3)
    center = {"m.weight": torch.randn(7, 5), "emb": torch.randn(3, 4), "norm.weight": torch.randn(5)}
    spec = UpdateSpec([1, 2**32 - 1, 3, 4], [0.7, -1.3, 0.0, 0.25], alpha=0.01, n=4)
    c64 = {n: t.double() for n, t in center.items()}
    want = {}
    for name, t in c64.items():
        step = torch.zeros_like(t)
        for seed, w in zip(spec.seeds, spec.weights):
            if t.dim() == 2:
                a, b = _eps(seed, f"{name}#A", (t.shape[0], rank)), _eps(seed, f"{name}#B", (t.shape[1], rank))
                step += w * (a @ b.T) / math.sqrt(rank)
            elif vectors == "full":
                step += w * _eps(seed, name, t.shape)
        want[name] = spec.alpha / spec.n * step
    l2 = lowrank_update(center, spec, rank, vectors)
    for name, t in center.items():
        torch.testing.assert_close(t.double(), c64[name] + want[name], rtol=0, atol=1e-6)
    assert l2 == pytest.approx(math.sqrt(sum(float(s.square().sum()) for s in want.values())), rel=1e-5)
    if vectors == "frozen":
        assert torch.equal(center["norm.weight"], c64["norm.weight"].float())


def test_update_is_independent_of_the_row_chunking(monkeypatch):
    torch.manual_seed(4)
    center = {"w": torch.randn(37, 11)}
    spec = UpdateSpec([8, 9], [1.0, -0.5], alpha=0.1, n=2)
    whole = {k: v.clone() for k, v in center.items()}
    lowrank_update(whole, spec, 3)
    monkeypatch.setattr(lowrank, "CHUNK", 20)  # blocks of one row
    lowrank_update(center, spec, 3)
    assert torch.equal(center["w"], whole["w"])


def lowrank_cfg(model_dir, **es):
    return config_from_dict(
        {
            "model": {"name": str(model_dir)},
            "task": {"name": "toy:DigitTask", "heldout_size": 0},
            "generation": {"temperature": 1.0, "max_new_tokens": 6},
            "es": {
                "population_size": 4,
                "sigma": 0.05,
                "alpha": 0.02,
                "batch_size": 3,
                "updates": 2,
                "perturbation": "lowrank",
                "rank": 2,
                **es,
            },
        }
    )


@pytest.mark.parametrize("es", [{}, {"estimator": "antithetic", "lowrank_vectors": "frozen"}])
def test_es_steps_then_replay_give_a_bit_identical_center(tiny_model_dir, es):
    cfg = lowrank_cfg(tiny_model_dir, **es)
    b = BACKENDS.get("hf").for_es(backend_setup(cfg))  # the registry picks the low-rank class by es.perturbation
    assert isinstance(b, HFLowRankBackend) and (b.rank, b.vectors) == (2, cfg.es.lowrank_vectors)
    probs = load_problems(cfg, b)
    records = [es_step(cfg, b, probs, t) for t in range(2)]
    assert any(len(set(r["rewards"])) > 1 for r in records)  # the center moved
    fresh = BACKENDS.get("hf").for_es(backend_setup(cfg))
    assert fresh.checksum() != b.checksum()
    replay(fresh, records)  # what a resume after a kill (and `esbatch center`) does
    for name, t in b.master.items():
        assert torch.equal(fresh.master[name], t), name
    half = BACKENDS.get("hf").for_es(backend_setup(cfg))  # resume from a checkpoint after update 1
    replay(half, records[:1])
    ckpt = half.center_state_dict()
    resumed = BACKENDS.get("hf").for_es(backend_setup(cfg))
    resumed.load_center(ckpt)
    replay(resumed, records[1:])
    assert all(torch.equal(resumed.master[n], t) for n, t in b.master.items())


def test_config_choices_match_the_perturb_package():
    assert PERTURBATIONS == lowrank.PERTURBATIONS and LOWRANK_VECTORS == lowrank.LOWRANK_VECTORS


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"es": {"master": "host"}}, "es.perturbation: lowrank needs es.master: device (got host)"),
        ({"es": {"restore": "inplace"}}, "es.perturbation: lowrank needs es.restore: exact (got inplace)"),
        ({"es": {"rank": 0}}, "es.rank"),
        ({"es": {"perturbation": "sparse"}}, "es.perturbation"),
        ({"es": {"lowrank_vectors": "zero"}}, "es.lowrank_vectors"),
    ],
)
def test_config_refuses_lowrank_where_it_cannot_run(tiny_model_dir, extra, words):
    data = {
        "model": {"name": str(tiny_model_dir)},
        "es": {"perturbation": "lowrank", "updates": 1, **extra.get("es", {})},
        **{k: v for k, v in extra.items() if k != "es"},
    }
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert words in str(e.value)
    ok = config_from_dict(
        {"model": {"name": str(tiny_model_dir)}, "es": {"perturbation": "lowrank", "rank": 4, "updates": 1}}
    )
    assert (ok.es.perturbation, ok.es.rank, ok.es.lowrank_vectors) == ("lowrank", 4, "full")
    on_vllm = config_from_dict(  # vLLM runs low rank too (tests/vllm_cpu/test_vllm_lowrank.py)
        {
            "model": {"name": str(tiny_model_dir)},
            "backend": {"name": "vllm"},
            "es": {"perturbation": "lowrank", "updates": 1},
        }
    )
    assert (on_vllm.backend.name, on_vllm.es.perturbation) == ("vllm", "lowrank")


def test_unsupported_modules_are_named(tok):
    model = tiny_model("llama", len(tok))
    model.model.register_parameter("gate_extra", torch.nn.Parameter(torch.ones(4)))  # a 1-D tensor no hook reads
    with pytest.raises(ValueError, match=r"gate_extra.*es.lowrank_vectors: frozen"):
        HFLowRankBackend(model, tok, rank=1)
    HFLowRankBackend(model, tok, rank=1, vectors="frozen")  # frozen: nothing to carry
