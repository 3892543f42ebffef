"""Live weights whose fp32 center is kept away from them: ``es.master: host`` and ``es.master: disk``.

Same bits as ``es.master: device`` (esbatch/perturb/centered.py), less memory where the weights live (bytes per
parameter: docs/architecture.md). ``HostStore`` (``host``, the GPU layout): the fp32 center in host memory, pinned
on CUDA, plus a compute-dtype copy next to the weights so restore() stays on the device. ``DiskStore`` (``disk``,
the CPU layout, or a host short of RAM): the fp32 center in an unlinked scratch file in ``folder`` (default
$TMPDIR), read and written with pread/pwrite. Both go ``CHUNK`` elements at a time through centered.py's operations
in the same order, so the layouts agree bit for bit (tests/unit/test_offload.py); only the float64 norms
(rel_distance, checksum), summed chunk by chunk, may differ in their last bits.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Mapping

import torch

from esbatch.perturb.jobs import run_jobs
from esbatch.perturb.noise import DEFAULT_NOISE, check_noise, draw, eps_device, perturb_into, spans
from esbatch.perturb.update import UpdateSpec, cpu_jobs, flat, step_chunk

MASTERS = ("device", "host", "disk")  # es.master


class HostStore:
    """fp32 tensors in host memory, pinned when CUDA is there to copy them to."""

    where = "host"

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        pin = torch.cuda.is_available() and any(t.is_cuda for t in tensors.values())
        self.t: dict[str, torch.Tensor] = {}
        for n, x in tensors.items():
            flat_fp32 = torch.empty(x.numel(), dtype=torch.float32, pin_memory=pin)
            flat_fp32.copy_(x.detach().reshape(-1))
            self.t[n] = flat_fp32

    def read(self, name: str, s: int, e: int, device: torch.device) -> torch.Tensor:
        """Elements s .. e-1 of the flat tensor, fp32 on ``device`` (a view when device is the CPU)."""
        return self.t[name][s:e].to(device, non_blocking=True)

    def write(self, name: str, s: int, chunk: torch.Tensor) -> None:
        self.t[name][s : s + chunk.numel()].copy_(chunk)

    def nbytes(self) -> int:
        return sum(x.numel() * 4 for x in self.t.values())

    def close(self) -> None:
        self.t.clear()


class DiskStore:
    """fp32 tensors, one after the other, in an unlinked scratch file read and written with pread/pwrite."""

    where = "disk"

    def __init__(self, tensors: Mapping[str, torch.Tensor], folder: str | os.PathLike[str] | None = None) -> None:
        self.fd = -1
        folder = folder or tempfile.gettempdir()
        try:
            fd, path = tempfile.mkstemp(prefix="esbatch-center-", suffix=".f32", dir=folder)
        except OSError as e:
            raise OSError(f"es.master: disk: cannot create the center's scratch file in {folder}: {e}") from None
        os.unlink(path)  # the open descriptor keeps it; nothing is left behind when the process ends
        self.fd, self.folder = fd, str(folder)
        self.offset: dict[str, int] = {}
        pos = 0
        for n, x in tensors.items():
            self.offset[n] = pos
            pos += x.numel() * 4
        self.size = pos
        for n, x in tensors.items():
            with flat(x.detach()) as src:
                for s in range(0, x.numel(), 1 << 20):
                    self.write(n, s, src[s : s + (1 << 20)].to("cpu", torch.float32))

    def read(self, name: str, s: int, e: int, device: torch.device) -> torch.Tensor:
        buf = torch.empty(e - s, dtype=torch.float32)
        view, pos, end = memoryview(buf.numpy()).cast("B"), self.offset[name] + 4 * s, 4 * (e - s)
        got = 0
        while got < end:
            k = os.preadv(self.fd, [view[got:]], pos + got)
            if k <= 0:
                raise OSError(f"es.master: disk: short read of {name} from the scratch file in {self.folder}")
            got += k
        return buf if device.type == "cpu" else buf.to(device)

    def write(self, name: str, s: int, chunk: torch.Tensor) -> None:
        data = memoryview(chunk.detach().to("cpu", torch.float32).contiguous().numpy()).cast("B")
        pos, done = self.offset[name] + 4 * s, 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], pos + done)

    def nbytes(self) -> int:
        return self.size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


class OffloadedWeights:
    """CenteredWeights' interface and bits with the fp32 center in a HostStore or DiskStore (module docstring)."""

    restore_mode = "exact"
    master = None  # no fp32 center next to the weights: state_dict() reads it from the store

    def __init__(
        self,
        live: Mapping[str, torch.Tensor],
        track_drift: bool = True,
        noise: str = DEFAULT_NOISE,
        master: str = "host",
        folder: str | os.PathLike[str] | None = None,
    ) -> None:
        if master not in ("host", "disk"):
            raise ValueError(f"es.master: {master!r} is not an offloaded layout; valid here: host, disk")
        self.noise = check_noise(noise)
        self.live = dict(live)
        self.where = master

        def store(tensors: Mapping[str, torch.Tensor]) -> HostStore | DiskStore:
            return HostStore(tensors) if master == "host" else DiskStore(tensors, folder)

        self.center = store(self.live)
        self.theta0 = store(self.live) if track_drift else None
        # host: the center in the compute dtype next to the weights, so restore() never crosses to the host
        self.copy = {n: p.detach().clone() for n, p in self.live.items()} if master == "host" else None
        self._theta0_norm = self._norm(self._chunks(self.center)) if self.theta0 else None
        self.perturbed = False

    def _chunks(self, store: HostStore | DiskStore) -> Iterator[torch.Tensor]:
        for name, p in self.live.items():
            for s, e in spans(p.numel(), self.noise):
                yield store.read(name, s, e, p.device)

    @staticmethod
    def _norm(chunks: Iterator[torch.Tensor]) -> float:
        return sum(float(c.double().square().sum()) for c in chunks) ** 0.5

    @torch.no_grad()
    def perturb(self, seed: int, scale: float, over: bool = False) -> None:
        """live <- center + scale * eps(seed), read from the store chunk by chunk."""
        if self.perturbed and not over:  # over: straight from one member to the next (every weight is rewritten)
            raise RuntimeError("perturb() called on perturbed weights: restore first")
        self.perturbed = True
        for name, p in self.live.items():
            where = eps_device(self.noise, p.device)
            with flat(p) as dst:
                for s, e in spans(p.numel(), self.noise):
                    c = self.center.read(name, s, e, p.device)
                    if perturb_into(seed, name, s, scale, c, dst[s:e], self.noise):
                        continue
                    eps = draw(seed, name, s, e - s, where, self.noise).to(p.device)
                    dst[s:e].copy_(eps.mul_(scale).add_(c))

    @torch.no_grad()
    def restore(self) -> None:
        """live <- the center in the compute dtype: from the device copy (host) or the scratch file (disk)."""
        for name, p in self.live.items():
            if self.copy is not None:
                p.copy_(self.copy[name])
                continue
            with flat(p) as dst:
                for s, e in spans(p.numel(), self.noise):
                    dst[s:e].copy_(self.center.read(name, s, e, p.device))
        self.perturbed = False

    @torch.no_grad()
    def update(self, spec: UpdateSpec) -> tuple[float, float]:
        """es_update's step on the stored fp32 center, chunk by chunk, copied to the live weights (and the host
        layout's device copy); (update L2, fraction of live elements whose compute-dtype value changed)."""
        if self.perturbed:
            raise RuntimeError("update() called on perturbed weights: restore first")
        sq, changed, total = 0.0, 0, 0
        for name, p in self.live.items():
            where = eps_device(self.noise, p.device)
            with flat(p) as dst:
                for s, e in spans(p.numel(), self.noise):
                    c = self.center.read(name, s, e, p.device)
                    if (jobs := cpu_jobs(spec, name, c, s, self.noise)) is not None:
                        parts = run_jobs(jobs)  # fp32 on the CPU: the C kernel, es_update's bits and parts
                    else:
                        acc = step_chunk(spec, name, s, e, where, self.noise)
                        c.add_(acc.to(p.device))
                        parts = [float(torch.linalg.vector_norm(acc, dtype=torch.float64)) ** 2]
                    for q in parts:  # in es_update's order: the same float64 sum
                        sq += q
                    self.center.write(name, s, c)
                    new = c.to(p.dtype)
                    changed += int((new != dst[s:e]).sum())
                    dst[s:e].copy_(new)
            if self.copy is not None:
                self.copy[name].copy_(p)
            total += p.numel()
        return sq**0.5, changed / total

    @torch.no_grad()
    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the center (resume, or an earlier stage's weights)."""
        if diff := set(self.live) ^ set(state):
            raise KeyError(f"checkpoint and model disagree on parameters: {sorted(diff)[:5]}")
        for name, t in state.items():
            p = self.live[name]
            with flat(t.detach().to(torch.float32)) as src, flat(p) as dst:
                for s, e in spans(p.numel(), self.noise):
                    self.center.write(name, s, src[s:e])
                    dst[s:e].copy_(src[s:e].to(p.device))
            if self.copy is not None:
                self.copy[name].copy_(p)
        self.perturbed = False

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 center on the CPU (what center.safetensors holds); a transient full copy."""
        out = {}
        for name, p in self.live.items():
            out[name] = self.center.read(name, 0, p.numel(), torch.device("cpu")).clone().view(p.shape)
        return out

    def rel_distance(self) -> float | None:
        """||theta_t - theta_0|| / ||theta_0|| when drift is tracked (float64, summed chunk by chunk)."""
        if self.theta0 is None:
            return None
        diffs = (c - t0 for c, t0 in zip(self._chunks(self.center), self._chunks(self.theta0)))
        return self._norm(diffs) / self._theta0_norm

    def checksum(self) -> float:
        """esbatch/models.py:checksum of the fp32 center, its per-tensor float64 sums taken chunk by chunk."""
        total = 0.0
        for k, name in enumerate(sorted(self.live)):
            p = self.live[name]
            sums = (
                float(self.center.read(name, s, e, p.device).sum(dtype=torch.float64))
                for s, e in spans(p.numel(), self.noise)
            )
            total += sum(sums) * (k + 1)
        return total

    def memory_report(self) -> dict[str, float]:
        model_bytes = sum(p.numel() * p.element_size() for p in self.live.values())
        copy_bytes = sum(t.numel() * t.element_size() for t in self.copy.values()) if self.copy else 0
        theta0_bytes = self.theta0.nbytes() if self.theta0 is not None else 0
        return {
            "model_bytes": model_bytes,
            "master_bytes": self.center.nbytes(),
            "theta0_bytes": theta0_bytes,
            "device_copy_bytes": copy_bytes,
            f"{self.where}_bytes": self.center.nbytes() + theta0_bytes,
        }

    def close(self) -> None:
        self.center.close()
        if self.theta0 is not None:
            self.theta0.close()
