"""Exact token entropy inside a vLLM worker: H(p_t) of softmax(logits / T) over the whole vocabulary at every token
a tagged request samples, the definition of the HF backend's meter (esbatch/backends/hf.py:_EntropyMeter; T the
request's temperature, greedy T = 1, before top-p truncation).

``EngineEntropy`` hooks the model runner's sampler (a forward pre-hook): its ``logits`` are one row per request
of the step's batch, in the runner's order (``input_batch.req_ids``), after every change to the model's logits (the
low-rank hooks, esbatch/backends/vllm_lowrank.py) and before temperature and top-p. A request is measured when its
``SamplingParams.extra_args`` carry ``TAG`` (the driver, esbatch/backends/vllm.py, tags each sample of a call);
its entropies are a list per tag, in sampling order. A row whose sampled token vLLM discards (a prompt whose
prefill is split over steps, ``discard_request_mask``) is skipped, so each entry is one token of the response:
prefix-cache hits and a preempted request's recompute prefill sample once per token as well. The driver takes
and clears the lists after each generate call (es_entropy_take) and checks one entry per token.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch

TAG = "es_entropy"  # the extra_args key naming a measured request's list
_GREEDY = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it decodes greedily (measured at T = 1)
ROWS = 64  # rows per entropy computation: bounds its (rows x vocab) temporaries next to the sampler's


def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """H of softmax(logits / T) per row (nats), in fp32 as the HF meter computes it."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)


class EngineEntropy:
    """The token entropies of one model runner's tagged requests (module docstring)."""

    def __init__(self, runner: Any) -> None:
        missing = [a for a in ("sampler", "input_batch", "requests", "discard_request_mask") if not hasattr(runner, a)]
        if missing:
            raise RuntimeError(
                f"token entropy: this vLLM model runner ({type(runner).__name__}) has no {', '.join(missing)}; "
                "esbatch measures entropy on vLLM's V1 GPU/CPU model runner"
            )
        self.runner = runner
        self.steps: list[tuple[torch.Tensor, list[tuple[int, str]]]] = []  # (H of every row, its measured rows)
        self.discarded = 0  # tagged rows skipped: their sampled token was discarded (split prefill)
        self.error: str | None = None  # an exception in the hook, reported by take() (raising would kill the engine)
        self.handle = runner.sampler.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            self._record(kwargs["logits"] if "logits" in kwargs else args[0])
        except Exception:  # noqa: BLE001 - reported at the next take()
            self.error = self.error or traceback.format_exc()

    @torch.no_grad()
    def _record(self, logits: torch.Tensor) -> None:
        runner = self.runner
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        by_temperature: dict[float, list[tuple[int, str]]] = {}  # T -> the (row, tag) measured at it
        discard = runner.discard_request_mask.np
        for i, rid in enumerate(batch.req_ids[:num_reqs]):
            params = getattr(runner.requests.get(rid), "sampling_params", None)
            tag = (getattr(params, "extra_args", None) or {}).get(TAG)
            if tag is None:
                continue
            if discard[i]:
                self.discarded += 1
                continue
            t = float(params.temperature)
            by_temperature.setdefault(t if t >= _GREEDY else 1.0, []).append((i, tag))
        if not by_temperature:
            return
        if logits.shape[0] != num_reqs:
            raise RuntimeError(
                f"token entropy: the sampler got {logits.shape[0]} logits rows for {num_reqs} requests "
                "(speculative decoding is not supported)"
            )
        for t, picks in by_temperature.items():  # every row at T (no index copied to the device), ROWS at a time
            h = [token_entropy(logits[a : a + ROWS], t) for a in range(0, num_reqs, ROWS)]
            self.steps.append((torch.cat(h) if len(h) > 1 else h[0], picks))  # read at take(): no sync per step

    def take(self) -> dict[str, Any]:
        """{"entropy": {tag: [H per token]}, "discarded": rows skipped}, cleared; raises a hook's error."""
        steps, discarded, error = self.steps, self.discarded, self.error
        self.steps, self.discarded, self.error = [], 0, None
        if error is not None:
            raise RuntimeError(f"token entropy hook failed:\n{error}")
        values: dict[str, list[float]] = {}
        if steps:
            flat, at = torch.cat([h for h, _ in steps]).tolist(), 0
            for h, picks in steps:
                for i, tag in picks:
                    values.setdefault(tag, []).append(flat[at + i])
                at += h.shape[0]
        return {"entropy": values, "discarded": discarded}

    def close(self) -> None:
        self.handle.remove()
