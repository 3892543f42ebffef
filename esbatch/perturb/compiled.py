"""philox noise on accelerators: philox.eps_blocks compiled by torch.compile (Triton on CUDA), the same bits as
its eager run. ``draw_compiled`` returns None (the caller draws eagerly) when compiling is off
(ESBATCH_NOISE_FAST=0), unavailable, or failed once on that device type.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch

from esbatch.perturb.philox import eps_blocks, round_key_tensor, table_on


@functools.cache
def compiled_blocks() -> Any:
    """eps_blocks compiled by torch.compile (Triton) for CUDA; None when unavailable or ESBATCH_NOISE_FAST=0."""
    if os.environ.get("ESBATCH_NOISE_FAST", "1") == "0":
        return None
    try:
        return torch.compile(eps_blocks, dynamic=True)
    except Exception as e:  # noqa: BLE001 - any reason compile is unavailable: the eager path gives the same bits
        warnings.warn(f"esbatch noise: torch.compile unavailable ({e}); drawing noise eagerly (slower)", stacklevel=2)
        return None


_compile_failed: set[str] = set()


def draw_compiled(key: int, start: int, count: int, device: torch.device, gauss: bool) -> torch.Tensor | None:
    """eps of elements start .. start + count - 1 of the tensor whose tensor_seed is ``key``, fp32 on ``device``
    by compiled_blocks; None where there is no compiled path (the caller draws eagerly: the same bits)."""
    fn = compiled_blocks() if device.type not in _compile_failed else None
    if fn is None:
        return None
    b0, off = divmod(start, 4)
    b0t = torch.tensor(b0, dtype=torch.int64, device=device)
    try:
        return fn(b0t, (off + count + 3) // 4, round_key_tensor(key, device), table_on(device).long(), gauss)[
            off : off + count
        ]
    except Exception as e:  # noqa: BLE001 - e.g. no Triton on this machine: eager gives the same bits
        _compile_failed.add(device.type)
        warnings.warn(f"esbatch noise: compiling for {device.type} failed ({e}); drawing eagerly", stacklevel=2)
        return None
