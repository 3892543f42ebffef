"""An independent numpy implementation of the philox ES noise (esbatch/perturb/noise.py's docstring), written
apart from the torch code: Philox in plain uint64 products (no 16-bit splitting), the octave from frexp (not an
integer binary search), the interpolation in Python-semantics floor division. Only the recipe and the table's
values are shared."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
W0, W1 = 0x9E3779B9, 0xBB67AE85
MASK = np.uint64(0xFFFFFFFF)


def philox4x32_10(ctr: list[np.ndarray], key: tuple[int, int]) -> list[np.ndarray]:
    """Random123's philox4x32 with 10 rounds: counter words (uint64 arrays < 2^32), key (k0, k1)."""
    x = [np.asarray(c, dtype=np.uint64) for c in ctr]
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + W0) % 2**32, (k1 + W1) % 2**32
        p0 = x[0] * M0  # < 2^64: exact in uint64
        p1 = x[2] * M1
        x = [
            (p1 >> np.uint64(32)) ^ x[1] ^ np.uint64(k0),
            p1 & MASK,
            (p0 >> np.uint64(32)) ^ x[3] ^ np.uint64(k1),
            p0 & MASK,
        ]
    return x


def key_of(seed: int, name: str) -> tuple[int, int]:
    s = int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "little") & (2**63 - 1)
    return s % 2**32, s >> 32


def words(seed: int, name: str, start: int, count: int) -> np.ndarray:
    """The 32-bit word of elements start .. start + count - 1 (uint64)."""
    i = np.arange(start, start + count, dtype=np.uint64)
    block = i // np.uint64(4)
    zero = np.zeros_like(block)
    out = philox4x32_10([block & MASK, block >> np.uint64(32), zero, zero], key_of(seed, name))
    lane = (i % np.uint64(4)).astype(np.int64)
    return np.choose(lane, out)


def half_normal(m: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Fixed-point z(m) (int64) by the table: direct below 1024, else octave from frexp and linear sub-bins."""
    m = m.astype(np.int64)
    t = table.astype(np.int64)
    z = np.empty_like(m)
    direct = m < 1024
    z[direct] = t[m[direct]]
    mm = m[~direct]
    k = np.frexp(mm.astype(np.float64))[1] - 1  # floor(log2 mm), exact for integers < 2^53
    width = 2 ** (k - 10)
    j = mm // width - 1024
    f = mm % width
    base = 1024 + (k - 10) * 1025
    lo, hi = t[base + j], t[base + j + 1]
    z[~direct] = lo + ((hi - lo) * f) // width  # floor division: what an arithmetic shift does
    return z


def eps(seed: int, name: str, start: int, count: int, table: np.ndarray, kind: str = "gauss") -> np.ndarray:
    """float32 eps of elements start .. start + count - 1."""
    w = words(seed, name, start, count)
    negative = (w >> np.uint64(31)).astype(bool)
    if kind == "rademacher":
        return np.where(negative, np.float32(-1), np.float32(1))
    z = half_normal(w & np.uint64(0x7FFFFFFF), table)
    z = np.where(negative, -z, z)
    return z.astype(np.float32) * np.float32(2.0**-28)


def table() -> np.ndarray:
    """The committed table (data shared with the implementation; tests/unit/test_noise.py regenerates it)."""
    from esbatch.perturb.philox import TABLE_FILE

    return np.load(TABLE_FILE)


def eps_tensor(seed: int, name: str, shape: tuple[int, ...], kind: str = "gauss") -> torch.Tensor:
    """The default generator's eps (es.noise: philox-gauss) of a whole tensor, from this reference: fp32, CPU."""
    n = int(np.prod(shape, dtype=np.int64))
    return torch.from_numpy(eps(seed, name, 0, n, table(), kind)).reshape(tuple(shape))
