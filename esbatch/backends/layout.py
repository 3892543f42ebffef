"""HF parameter names -> slices of an inference engine's fused tensors (plain torch, no vLLM needed).

ES noise is defined on HF names (esbatch/es/noise.py): eps(seed, "model.layers.0.self_attn.q_proj.weight").
vLLM stores some HF tensors concatenated along dim 0 (``qkv_proj`` = [q; k; v], ``gate_up_proj`` = [gate; up])
and may pad the vocabulary rows of embeddings. ``hf_views`` returns, for every HF name, a *view* into the
engine's tensor, so the HF backend's code (perturb by name, es_update on a name -> tensor mapping) runs
unchanged on the engine's memory and one seed moves both backends identically.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

# HF module name -> (fused module name, position in the concatenation). Llama, Qwen2/2.5/3, Mistral.
FUSED: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def fused_name(hf_name: str) -> tuple[str, int] | None:
    """("...qkv_proj.weight", 1) for "...k_proj.weight"; None when the tensor is not fused."""
    *prefix, module, leaf = hf_name.split(".")
    if module not in FUSED:
        return None
    target, pos = FUSED[module]
    return ".".join([*prefix, target, leaf]), pos


def hf_rows(
    engine_params: Mapping[str, torch.Tensor], hf_shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, list[tuple[str, int, int]]]:
    """engine tensor name -> its HF parts [(hf name, first row, rows)] in row order (a fused tensor has several).

    Raises ValueError when an HF tensor has no place in the engine, when shapes disagree, or when an engine
    tensor is left partly uncovered (apart from padded rows beyond the HF size, which ES never touches).
    """
    parts: dict[str, list[tuple[int, str]]] = {}  # engine name -> [(position, hf name)]
    for hf in hf_shapes:
        fused = fused_name(hf)
        target, pos = fused if fused and fused[0] in engine_params else (hf, 0)
        if target not in engine_params:
            raise ValueError(
                f"HF parameter {hf!r} has no counterpart in the engine (looked for {target!r}); "
                f"engine tensors look like {sorted(engine_params)[:4]}"
            )
        parts.setdefault(target, []).append((pos, hf))
    rows_of: dict[str, list[tuple[str, int, int]]] = {}
    for target, members in parts.items():
        t = engine_params[target]
        row, spans = 0, []
        for _, hf in sorted(members):
            shape = tuple(hf_shapes[hf])
            rows = shape[0] if shape else 1
            if tuple(t.shape[1:]) != shape[1:] or row + rows > (t.shape[0] if t.dim() else 1):
                raise ValueError(f"{hf} {shape} does not fit in engine tensor {target} {tuple(t.shape)} at row {row}")
            spans.append((hf, row, rows))
            row += rows
        if len(members) > 1 and row != t.shape[0]:
            raise ValueError(f"engine tensor {target} {tuple(t.shape)}: its HF parts cover only {row} rows")
        rows_of[target] = spans
    if missing := sorted(set(engine_params) - set(parts)):
        raise ValueError(f"engine tensors with no HF counterpart (ES would never move them): {missing[:5]}")
    return rows_of


def hf_views(
    engine_params: Mapping[str, torch.Tensor], hf_shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """A view into ``engine_params`` for every HF name in ``hf_shapes`` (same shape as the HF tensor); the errors
    of ``hf_rows``."""
    views: dict[str, torch.Tensor] = {}
    for target, spans in hf_rows(engine_params, hf_shapes).items():
        t = engine_params[target]
        for hf, row, rows in spans:
            views[hf] = t.narrow(0, row, rows) if t.dim() else t
    return views
