"""What eps(seed, tensor name) is: the es.noise generators' names, the per-tensor seed, Philox4x32-10 and the
Gaussian quantile table, written as eager torch on int64 tensors.

This is the definition every fast path (the C kernel, cpu_kernel.py; the compiled torch, compiled.py) reproduces
bit for bit, and the eager fallback ``noise.draw`` takes when neither is there. The recipe and the reasons for
it: noise.py's docstring and docs/noise.md; an independent numpy copy: tests/noise_reference.py.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from statistics import NormalDist

import numpy as np
import torch

NOISES = ("philox-gauss", "philox-rademacher", "legacy-cpu")  # es.noise
DEFAULT_NOISE = "philox-gauss"  # new runs
LEGACY_NOISE = "legacy-cpu"  # runs recorded before es.noise existed

PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10

TABLE_FILE = Path(__file__).with_name("gauss_table.npy")
TABLE_SCALE_BITS = 28  # z in fixed point: round(z * 2^28), max 6.34 * 2^28 < 2^31
TABLE_DIRECT = 1024  # m < 1024: one entry per m
TABLE_SUB = 1024  # sub-bins per octave above
TABLE_OCTAVES = 21  # k = 10 .. 30 (m < 2^31)
TABLE_LEN = TABLE_DIRECT + TABLE_OCTAVES * (TABLE_SUB + 1)
TABLE_SHA256 = "572bd90067724e1f83d769adf07c493e55f6700b8f721adb715453f971ce45c6"

_MASK32 = 0xFFFFFFFF


def tensor_seed(seed: int, name: str) -> int:
    """63-bit generator seed (blake2b of seed and name, top bit cleared) for one tensor of direction ``seed`` (a
    32-bit integer)."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"direction seeds are 32-bit unsigned integers, got {seed}")
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def check_noise(noise: str) -> str:
    if noise not in NOISES:
        raise ValueError(f"es.noise: unknown noise generator {noise!r}; valid: {', '.join(NOISES)}")
    return noise


def key_words(key: int) -> tuple[int, int]:
    """The two 32-bit Philox key words (k0, k1) of a tensor_seed: its low and high halves."""
    return key & _MASK32, key >> 32


# ----------------------------------------------------------------------------- the table


def table_point(m: int) -> float:
    """The table's abscissa m -> z = -Phi^{-1}((m + 0.5) / 2^32) in float64 (stdlib)."""

    return -NormalDist().inv_cdf((m + 0.5) / 2**32)


def table_abscissae() -> list[int]:
    """The m of every table entry: 0..1023, then per octave k = 10..30: (1024 + j) << (k - 10), j = 0..1024."""
    ms = list(range(TABLE_DIRECT))
    for sh in range(TABLE_OCTAVES):
        ms += [(TABLE_SUB + j) << sh for j in range(TABLE_SUB + 1)]
    return ms


def build_table() -> np.ndarray:
    """The fixed-point half-normal quantile table (what TABLE_FILE holds): int32, round(z * 2^28)."""
    return np.array([round(table_point(m) * 2**TABLE_SCALE_BITS) for m in table_abscissae()], dtype=np.int32)


@functools.cache
def load_table() -> np.ndarray:
    """TABLE_FILE as int32 numpy, once its sha256 is checked against TABLE_SHA256."""
    raw = TABLE_FILE.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != TABLE_SHA256:
        raise RuntimeError(
            f"{TABLE_FILE}: sha256 {digest} is not the recorded {TABLE_SHA256}: the Gaussian table changed, so "
            "every philox-gauss direction would change. Restore the file from git (never regenerate it in place)."
        )
    return np.load(TABLE_FILE)


@functools.cache
def table_on(device: torch.device) -> torch.Tensor:
    """load_table() as an int32 tensor on ``device`` (the C kernel reads its data_ptr on the CPU)."""
    return torch.from_numpy(load_table()).to(device)  # int32


# ----------------------------------------------------------------------------- philox in int64 tensors


def mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of a * m for a < 2^32 in int64, m a 32-bit constant: every product < 2^48."""
    t = a * (m & 0xFFFF)
    s = a * (m >> 16) + (t >> 16)
    return s >> 16, ((s & 0xFFFF) << 16) | (t & 0xFFFF)


def philox4x32_10(ctr: list[torch.Tensor], keys: torch.Tensor) -> list[torch.Tensor]:
    """Philox4x32-10 of the 4 counter words (int64 tensors < 2^32); keys: int64 (rounds, 2), the bumped key of
    every round (``round_keys``)."""
    x0, x1, x2, x3 = ctr
    for r in range(PHILOX_ROUNDS):
        hi0, lo0 = mulhilo(x0, PHILOX_M[0])
        hi1, lo1 = mulhilo(x2, PHILOX_M[1])
        x0, x1, x2, x3 = hi1 ^ x1 ^ keys[r, 0], lo1, hi0 ^ x3 ^ keys[r, 1], lo0
    return [x0, x1, x2, x3]


def round_keys(key: int) -> list[list[int]]:
    """The Philox key words of every round: (k0 + r * W0, k1 + r * W1) mod 2^32, r = 0 .. PHILOX_ROUNDS - 1."""
    k0, k1 = key_words(key)
    return [[(k0 + r * PHILOX_W[0]) & _MASK32, (k1 + r * PHILOX_W[1]) & _MASK32] for r in range(PHILOX_ROUNDS)]


def round_key_tensor(key: int, device: torch.device) -> torch.Tensor:
    """The Philox round keys of ``key`` as the int64 tensor the torch paths (compiled and eager) take."""
    return torch.tensor(round_keys(key), dtype=torch.int64, device=device)


def gaussian(w: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """fp32 eps of 32-bit words w (int64): sign bit and the interpolated half-normal quantile of the rest."""
    m = w & 0x7FFFFFFF
    k = torch.zeros_like(m)
    for step in (16, 8, 4, 2, 1):  # k = floor(log2 m) for m >= 1 (m = 0: k = 0)
        k = k + step * ((m >> (k + step)) != 0).to(m.dtype)
    sh = (k - 10).clamp_(min=0)
    idx = (m >> sh) + (TABLE_SUB + 1) * sh
    f = m & ((1 << sh) - 1)
    lo = table[idx]
    z = lo + (((table[idx + 1] - lo) * f) >> sh)
    z = torch.where((w >> 31) != 0, -z, z)
    return z.to(torch.int32).to(torch.float32) * (2.0**-TABLE_SCALE_BITS)


def rademacher(w: torch.Tensor) -> torch.Tensor:
    """fp32 eps of 32-bit words w (int64): -1 where the top bit is set, else +1."""
    return 1.0 - 2.0 * (w >> 31).to(torch.float32)


def eps_blocks(b0: torch.Tensor, nb: int, keys: torch.Tensor, table: torch.Tensor, gauss: bool) -> torch.Tensor:
    """eps of the 4 * nb elements of blocks b0 .. b0 + nb - 1 (b0: int64 0-d tensor), element order; keys:
    round_key_tensor, table: table_on(...).long()."""
    block = b0 + torch.arange(nb, dtype=torch.int64, device=keys.device)
    zero = torch.zeros_like(block)
    words = philox4x32_10([block & _MASK32, block >> 32, zero, zero], keys)
    eps = [gaussian(w, table) for w in words] if gauss else [rademacher(w) for w in words]
    return torch.stack(eps, dim=-1).view(-1)
