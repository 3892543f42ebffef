"""Per-update FLOP accounting of ES and GRPO, and the population/group sizes that match them (paper Sec. 3.2, App. G.2).

A forward pass costs 2P FLOPs per token, a backward 4P (Kaplan et al., 2020; P = all parameters, attention scores
ignored); a response costs 2P L, L = L_p + L_g (no prefix caching). Per update:

    ES (App. G.1)   generation 2PNBL + perturb/restore 4PN + update 2PN
    GRPO            generation 2PGBL [+ old_logprobs 2PGBL: recomputed, or mu > 1] [+ reference 2PGBL: beta > 0]
                    + train_fwd_bwd mu 6PGBL + optimizer mu 12P (AdamW)        mu = grpo.iterations

Noise generation (ES) and gradient clipping (GRPO) are not counted. On the model passes 2N = 8G, so N = 32
matches G = 8, the paper's pairing; the per-parameter terms make the match of totals approximate.

`esbatch flops` takes P from the model's config on the meta device (esbatch/models.py:meta_parameter_count: no
weights loaded, tied embeddings once) and L_p from the tokenizer alone (``mean_prompt_tokens``).
"""

from __future__ import annotations

from typing import Any

FORWARD = 2  # FLOPs per parameter per token
BACKWARD = 4
ES_PERTURB = 4  # per parameter per member: add then subtract sigma * eps
ES_UPDATE = 2  # per parameter per direction
ADAMW = 12  # per parameter per optimizer step

ES_TERMS = ("generation", "perturb_restore", "update")
GRPO_TERMS = ("generation", "old_logprobs", "reference", "train_fwd_bwd", "optimizer")


def _check(params: float, members: float, B: int, prompt_tokens: int, gen_tokens: int) -> None:
    if params <= 0 or members <= 0 or B <= 0:
        raise ValueError(f"params, N/G and B must be > 0, got {params}, {members}, {B}")
    if prompt_tokens < 0 or gen_tokens < 0 or prompt_tokens + gen_tokens == 0:
        raise ValueError(f"token counts must be >= 0 and not both 0, got {prompt_tokens}, {gen_tokens}")


def _totals(terms: dict[str, float], passes: tuple[str, ...]) -> dict[str, float]:
    """Add 'passes' (the per-token model passes) and 'total' (everything) to a breakdown."""
    return {**terms, "passes": sum(terms[k] for k in passes), "total": sum(terms.values())}


def es_flops(params: float, N: int, B: int, prompt_tokens: int, gen_tokens: int) -> dict[str, float]:
    """FLOPs of one ES update: F = 2 P N B (L_p + L_g) + 4 P N + 2 P N (terms in the module docstring)."""
    _check(params, N, B, prompt_tokens, gen_tokens)
    terms = {
        "generation": FORWARD * params * N * B * (prompt_tokens + gen_tokens),
        "perturb_restore": ES_PERTURB * params * N,
        "update": ES_UPDATE * params * N,
    }
    return _totals(terms, ("generation",))


def _grpo_per_token(beta: float, recompute_old_logprobs: bool, iterations: int = 1) -> int:
    """FLOPs per parameter per token of one generated batch: 2 (generate) [+2 old] [+2 ref] + mu 6 (train)."""
    old = recompute_old_logprobs or iterations > 1
    return FORWARD * (1 + int(old) + int(beta > 0)) + iterations * (FORWARD + BACKWARD)


def grpo_flops(
    params: float,
    G: int,
    B: int,
    prompt_tokens: int,
    gen_tokens: int,
    beta: float = 0.0,
    recompute_old_logprobs: bool = False,
    iterations: int = 1,
) -> dict[str, float]:
    """FLOPs of one generated batch and its mu = ``iterations`` optimizer steps:

        F = (2 [+2 old] [+2 ref] + 6 mu) P G B (L_p + L_g) + 12 mu P

    old log-probs are counted when ``recompute_old_logprobs`` or mu > 1 (terms in the module docstring).
    """
    _check(params, G, B, prompt_tokens, gen_tokens)
    if iterations < 1:
        raise ValueError(f"iterations (mu) must be >= 1, got {iterations}")
    fwd = FORWARD * params * G * B * (prompt_tokens + gen_tokens)
    terms = {
        "generation": fwd,
        "old_logprobs": fwd if recompute_old_logprobs or iterations > 1 else 0,
        "reference": fwd if beta > 0 else 0,
        "train_fwd_bwd": iterations * (FORWARD + BACKWARD) * params * G * B * (prompt_tokens + gen_tokens),
        "optimizer": iterations * ADAMW * params,
    }
    return _totals(terms, ("generation", "old_logprobs", "reference", "train_fwd_bwd"))


def match_es_population(
    grpo_total: float, params: float, B: int, prompt_tokens: int, gen_tokens: int, overhead: bool = True
) -> float:
    """The N with es_flops(N)["total"] == grpo_total:  N = F_GRPO / (P (2 B L + 4 + 2)).

    overhead=False matches the model passes only (pass ``grpo_flops(...)["passes"]``): N = F / (2 P B L).
    """
    _check(params, 1, B, prompt_tokens, gen_tokens)
    per_member = FORWARD * params * B * (prompt_tokens + gen_tokens)
    if overhead:
        per_member += (ES_PERTURB + ES_UPDATE) * params
    return grpo_total / per_member


def match_grpo_group(
    es_total: float,
    params: float,
    B: int,
    prompt_tokens: int,
    gen_tokens: int,
    beta: float = 0.0,
    recompute_old_logprobs: bool = False,
    overhead: bool = True,
    iterations: int = 1,
) -> float:
    """The G with grpo_flops(G)["total"] == es_total:  G = (F_ES - 12 mu P) / (c P B L), c = 2 + 6 mu [+2] [+2].

    overhead=False matches the model passes only (pass ``es_flops(...)["passes"]``): G = F / (c P B L).
    """
    _check(params, 1, B, prompt_tokens, gen_tokens)
    per_token = _grpo_per_token(beta, recompute_old_logprobs, iterations)
    per_response = per_token * params * B * (prompt_tokens + gen_tokens)
    return (es_total - (iterations * ADAMW * params if overhead else 0)) / per_response


def format_accounting(
    params: float,
    B: int,
    prompt_tokens: int,
    gen_tokens: int,
    *,
    N: int = 32,
    G: int = 8,
    beta: float = 0.0,
    recompute_old_logprobs: bool = False,
    updates: int = 1,
    iterations: int = 1,
) -> str:
    """A readable table of every term, per update and for a run of ``updates`` updates, and the matched N and G.

    A GRPO "update" is one generated batch with its mu = ``iterations`` optimizer steps; the run of ``updates``
    optimizer steps (TRL's max_steps) holds updates / mu of them.
    """
    es = es_flops(params, N, B, prompt_tokens, gen_tokens)
    grpo = grpo_flops(params, G, B, prompt_tokens, gen_tokens, beta, recompute_old_logprobs, iterations)
    old = recompute_old_logprobs or iterations > 1
    labels = {"generation": f"generation (N={N})", "perturb_restore": "perturb + restore", "update": "update"}
    grpo_labels = {
        "generation": f"generation (G={G})",
        "old_logprobs": "old log-probs" + ("" if old else " (not recomputed)"),
        "reference": "reference forward" + (f" (beta={beta:g})" if beta > 0 else " (beta=0, none)"),
        "train_fwd_bwd": "train forward + backward" + (f" (mu={iterations})" if iterations > 1 else ""),
        "optimizer": "AdamW step" + (f"s (mu={iterations})" if iterations > 1 else ""),
    }
    run = f"per run (U={updates})"
    lines = [
        f"FLOPs per update: P={params:.3e} parameters (all), B={B} prompts, "
        f"L_p={prompt_tokens} prompt + L_g={gen_tokens} generated tokens",
        "2 FLOPs/param/token forward, 4 backward; attention-score FLOPs not counted",
        "",
        f"{'method':<7}{'term':<34}{'per update':>12}{run:>18}{'share':>9}",
    ]
    runs = (("ES", es, labels, ES_TERMS, updates), ("GRPO", grpo, grpo_labels, GRPO_TERMS, updates / iterations))
    for method, flops, names, terms, batches in runs:
        for key in (*terms, "total"):
            name = names.get(key, "total")
            share = 100 * flops[key] / flops["total"]
            lines.append(f"{method:<7}{name:<34}{flops[key]:>12.3e}{flops[key] * batches:>18.3e}{share:>8.3f}%")
    n_match = match_es_population(grpo["total"], params, B, prompt_tokens, gen_tokens)
    n_passes = match_es_population(grpo["passes"], params, B, prompt_tokens, gen_tokens, overhead=False)
    g_match = match_grpo_group(
        es["total"], params, B, prompt_tokens, gen_tokens, beta, recompute_old_logprobs, iterations=iterations
    )
    lines += [
        "",
        f"GRPO / ES per update: {grpo['total'] / es['total']:.4f}",
        f"FLOP-matched ES population for G={G}: N = {n_match:.3f} ({n_passes:.3f} on the model passes alone)",
        f"FLOP-matched GRPO group for N={N}: G = {g_match:.3f}",
    ]
    return "\n".join(lines)


class _ChatTemplate:
    """What load_problems needs of a generator (prompts rendered with the model's chat template), without a model."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def mean_prompt_tokens(cfg: Any, n: int = 64) -> float:
    """Mean token count of the task's first ``n`` training prompts (chat template, few-shot turns and system prompt
    included), from the model's tokenizer alone: no weights are loaded."""
    from esbatch.models import load_tokenizer
    from esbatch.train.problems import load_problems

    m = cfg.model
    tok = load_tokenizer(m.name, m.gguf_file, m.revision)
    prompts = load_problems(cfg, _ChatTemplate(tok)).train_prompts[:n]  # type: ignore[arg-type]
    return sum(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts) / len(prompts)
