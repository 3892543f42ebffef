"""Seeded Gaussian directions, rebuilt on demand from (direction seed, parameter name).

Each tensor gets its own generator seeded with blake2b(f"{seed}/{name}"), so directions are
independent across tensors (not one stream restarted per tensor), independent of the order in which
tensors are visited, and identical in every backend that knows the HF parameter names. Noise is
always drawn on the CPU in fp32, so a seed means the same direction on any device.
"""

from __future__ import annotations

import hashlib

import torch


def tensor_seed(seed: int, name: str) -> int:
    """64-bit generator seed for one tensor of direction ``seed`` (a 32-bit integer)."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"direction seeds are 32-bit unsigned integers, got {seed}")
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def direction(seed: int, name: str, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """eps for tensor ``name`` of direction ``seed``: standard normal, fp32, on the CPU."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(tensor_seed(seed, name))
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float32)
