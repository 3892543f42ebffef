"""Per-update FLOP accounting of ES and GRPO, and the population/group sizes that match them (paper Sec. 3.2, App. G.2).

Convention (Kaplan et al., 2020): a forward pass costs 2P FLOPs per token (one multiply-add per weight)
and a backward pass 4P, so a training step costs 6P per token. P is ALL parameters, as
``sum(p.numel())`` counts them; this slightly overstates the input-embedding lookup (not a matmul) and,
like the 2P rule itself, ignores the attention-score FLOPs (~2 n_layer n_ctx d_model per token). Both
omissions scale with the same token counts on both sides, so they do not move the matched N or G.
A generated response costs a forward over its prompt (prefill) and each generated token (KV cache):
2P (L_p + L_g). Prompts are not shared across samples (no prefix caching). With L = L_p + L_g:

ES, one update (App. G.1): N members each generate one response to each of the B prompts, forward only.
    generation       2 P N B L
    perturb+restore  4 P N        theta += sigma eps_i, then -= sigma eps_i (one multiply-add each)
    update           2 P N        theta += alpha/N sum_i z_i eps_i (one multiply-add per direction)
GRPO, one step (TRL, one optimizer step per generation batch, num_iterations=1): G responses to each of B prompts.
    generation       2 P G B L
    old_logprobs     2 P G B L    only when old log-probs are recomputed (verl; TRL with num_iterations > 1)
    reference        2 P G B L    only when beta > 0 (TRL loads no reference model at beta = 0)
    train_fwd_bwd    6 P G B L
    optimizer        12 P         AdamW ~10-14 FLOPs/param (moments, bias correction, sqrt, divide, decay)
Gaussian noise generation (ES) and gradient clipping (GRPO) are not counted.

The model passes dominate: with equal B and L, no reference and no recomputed old log-probs,
2 N = 8 G, so N = 32 matches G = 8 exactly -- the paper's pairing. The per-parameter terms add about
3 / (B L) to the ES total (7e-5 at B = 32, L = 1280), so the match of totals is exact only to that level.
"""

from __future__ import annotations

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


def _grpo_per_token(beta: float, recompute_old_logprobs: bool) -> int:
    """FLOPs per parameter per token of one GRPO step: 2 (generate) [+2 old] [+2 ref] + 6 (train)."""
    return FORWARD * (1 + int(recompute_old_logprobs) + int(beta > 0)) + FORWARD + BACKWARD


def grpo_flops(
    params: float,
    G: int,
    B: int,
    prompt_tokens: int,
    gen_tokens: int,
    beta: float = 0.0,
    recompute_old_logprobs: bool = False,
) -> dict[str, float]:
    """FLOPs of one GRPO step: F = (2 [+2] [+2] + 6) P G B (L_p + L_g) + 12 P (terms in the module docstring)."""
    _check(params, G, B, prompt_tokens, gen_tokens)
    fwd = FORWARD * params * G * B * (prompt_tokens + gen_tokens)
    terms = {
        "generation": fwd,
        "old_logprobs": fwd if recompute_old_logprobs else 0,
        "reference": fwd if beta > 0 else 0,
        "train_fwd_bwd": (FORWARD + BACKWARD) * params * G * B * (prompt_tokens + gen_tokens),
        "optimizer": ADAMW * params,
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
) -> float:
    """The G with grpo_flops(G)["total"] == es_total:  G = (F_ES - 12 P) / (c P B L), c = 8 [+2] [+2].

    overhead=False matches the model passes only (pass ``es_flops(...)["passes"]``): G = F / (c P B L).
    """
    _check(params, 1, B, prompt_tokens, gen_tokens)
    per_response = _grpo_per_token(beta, recompute_old_logprobs) * params * B * (prompt_tokens + gen_tokens)
    return (es_total - (ADAMW * params if overhead else 0)) / per_response


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
) -> str:
    """A readable table of every term, per update and for a run of ``updates`` updates, and the matched N and G."""
    es = es_flops(params, N, B, prompt_tokens, gen_tokens)
    grpo = grpo_flops(params, G, B, prompt_tokens, gen_tokens, beta, recompute_old_logprobs)
    labels = {"generation": f"generation (N={N})", "perturb_restore": "perturb + restore", "update": "update"}
    grpo_labels = {
        "generation": f"generation (G={G})",
        "old_logprobs": "old log-probs" + ("" if recompute_old_logprobs else " (not recomputed)"),
        "reference": "reference forward" + (f" (beta={beta:g})" if beta > 0 else " (beta=0, none)"),
        "train_fwd_bwd": "train forward + backward",
        "optimizer": "AdamW step",
    }
    run = f"per run (U={updates})"
    lines = [
        f"FLOPs per update: P={params:.3e} parameters (all), B={B} prompts, "
        f"L_p={prompt_tokens} prompt + L_g={gen_tokens} generated tokens",
        "2 FLOPs/param/token forward, 4 backward; attention-score FLOPs not counted",
        "",
        f"{'method':<7}{'term':<34}{'per update':>12}{run:>18}{'share':>9}",
    ]
    for method, flops, names, terms in (("ES", es, labels, ES_TERMS), ("GRPO", grpo, grpo_labels, GRPO_TERMS)):
        for key in (*terms, "total"):
            name = names.get(key, "total")
            share = 100 * flops[key] / flops["total"]
            lines.append(f"{method:<7}{name:<34}{flops[key]:>12.3e}{flops[key] * updates:>18.3e}{share:>8.3f}%")
    n_match = match_es_population(grpo["total"], params, B, prompt_tokens, gen_tokens)
    n_passes = match_es_population(grpo["passes"], params, B, prompt_tokens, gen_tokens, overhead=False)
    g_match = match_grpo_group(es["total"], params, B, prompt_tokens, gen_tokens, beta, recompute_old_logprobs)
    lines += [
        "",
        f"GRPO / ES per update: {grpo['total'] / es['total']:.4f}",
        f"FLOP-matched ES population for G={G}: N = {n_match:.3f} ({n_passes:.3f} on the model passes alone)",
        f"FLOP-matched GRPO group for N={N}: G = {g_match:.3f}",
    ]
    return "\n".join(lines)
