"""HF transformers backend: batched sampling with a KV cache and left padding; in-place weight moves.

The center lives in an fp32 master copy (``self.master``). The live parameters are always
``master.to(compute dtype)`` at the center, so ``restore()`` is an exact copy, and a perturbation is
computed in fp32 and rounded once. Cost: one fp32 copy of the parameters (4 bytes/param), plus
another for theta_0 when drift tracking is on. In-place add/subtract would need no copy but does not
restore exactly (8% of SmolLM2 fp32 elements off after one cycle at sigma=0.01, measured).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from esbatch.backends.base import Generation, GenerationBackend, SamplingParams, UpdateStats
from esbatch.es.core import es_update
from esbatch.es.noise import direction


class HFGenerator:
    """Batched generation with an HF causal LM (no ES state): what evaluation and inference need."""

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 64) -> None:
        self.model, self.tok, self.batch_size = model, tokenizer, batch_size
        eos = {tokenizer.eos_token_id}
        gen_eos = getattr(model.generation_config, "eos_token_id", None)
        eos |= set(gen_eos) if isinstance(gen_eos, (list, tuple)) else {gen_eos}
        self.eos_ids = sorted(e for e in eos if e is not None)

    # ---------------------------------------------------------------- generation
    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [len(ids) for ids in self.tok(list(texts), add_special_tokens=False)["input_ids"]]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], sampling: SamplingParams, seed: int) -> list[Generation]:
        from transformers import GenerationConfig, LogitsProcessorList

        greedy = sampling.temperature == 0
        n = sampling.n
        if greedy and n > 1:
            raise ValueError("greedy decoding gives one response per prompt; use n=1 or temperature > 0")
        gcfg = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None if greedy else 0,  # no top-k truncation: sampling is temperature + top_p only
            max_new_tokens=sampling.max_new_tokens,
            pad_token_id=self.tok.pad_token_id,
            eos_token_id=self.eos_ids,
            num_return_sequences=n,
        )
        torch.manual_seed(seed)
        out: list[Generation] = []
        per_call = max(1, self.batch_size // n)  # batch_size counts sequences: n samples of each prompt
        for i in range(0, len(prompts), per_call):
            chunk = list(prompts[i : i + per_call])
            enc = self.tok(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(self.model.device)
            meter = _EntropyMeter(self.eos_ids, sampling.temperature) if sampling.entropy else None
            seqs = self.model.generate(
                **enc, generation_config=gcfg, logits_processor=LogitsProcessorList([meter]) if meter else None
            )
            ent = meter.means() if meter else None
            for r, row in enumerate(seqs[:, enc["input_ids"].shape[1] :].tolist()):
                n_tok = len(row)
                for k, tok_id in enumerate(row):
                    if tok_id in self.eos_ids:
                        n_tok = k + 1
                        break
                text = self.tok.decode(row[:n_tok], skip_special_tokens=True)
                out.append(Generation(text, n_tok, None if ent is None else ent[r], row[:n_tok]))
        return out


class _EntropyMeter:
    """A logits processor that leaves the scores alone and accumulates each row's token entropy.

    HF runs custom processors before its temperature/top-p warpers, so the meter divides by the temperature
    itself: H is that of softmax(logits / T), the temperature-scaled distribution before top-p truncation
    (TRL's convention; greedy: T = 1). Rows stop counting after EOS. Memory: two floats per row instead of
    keeping (steps x vocab) scores.
    """

    def __init__(self, eos_ids: list[int], temperature: float = 1.0) -> None:
        self.eos = torch.tensor(eos_ids)
        self.temperature = temperature or 1.0
        self.total: torch.Tensor | None = None
        self.count: torch.Tensor | None = None
        self.done: torch.Tensor | None = None
        self.start: int | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.total is None:
            b = scores.shape[0]
            self.total, self.count = torch.zeros(b, dtype=torch.float64), torch.zeros(b, dtype=torch.float64)
            self.done, self.start = torch.zeros(b, dtype=torch.bool), input_ids.shape[1]
        elif input_ids.shape[1] > self.start:  # the previous step's token ended the row?
            self.done |= torch.isin(input_ids[:, -1].cpu(), self.eos)
        logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        h = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1).double().cpu()
        live = ~self.done
        self.total += torch.where(live, h, 0.0)
        self.count += live.double()
        return scores

    def means(self) -> list[float]:
        return (self.total / self.count.clamp(min=1)).tolist()


class HFBackend(HFGenerator, GenerationBackend):
    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 64, track_drift: bool = True) -> None:
        super().__init__(model, tokenizer, batch_size=batch_size)
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())  # tied weights once
        self.master = {n: p.detach().to(torch.float32, copy=True) for n, p in self.params.items()}
        self.theta0 = {n: t.clone() for n, t in self.master.items()} if track_drift else None
        self._theta0_norm = _norm(self.theta0.values()) if self.theta0 else None
        self.perturbed = False

    @classmethod
    def from_config(cls, cfg: Any) -> HFBackend:
        from esbatch.models import load_model_and_tokenizer

        m = cfg.model
        model, tok = load_model_and_tokenizer(m.name, m.gguf_file, m.revision, m.dtype, m.device)
        backend = cls(model, tok, batch_size=cfg.generation.batch_size, track_drift=cfg.tracking.drift)
        if m.init_weights:  # an earlier stage's weights; theta_0 (drift) stays the base model
            from safetensors.torch import load_file

            backend.load_center(load_file(m.init_weights))
        return backend

    # ---------------------------------------------------------------- weights
    @torch.no_grad()
    def perturb(self, seed: int, scale: float) -> None:
        if self.perturbed:
            raise RuntimeError("perturb() called on perturbed weights; call restore() first")
        self.perturbed = True
        for name, p in self.params.items():
            eps = direction(seed, name, p.shape).to(p.device)
            p.copy_(eps.mul_(scale).add_(self.master[name]))

    @torch.no_grad()
    def restore(self) -> None:
        for name, p in self.params.items():
            p.copy_(self.master[name])
        self.perturbed = False

    @torch.no_grad()
    def update(self, seeds: Sequence[int], weights: Sequence[float], alpha: float, n: int) -> UpdateStats:
        if self.perturbed:
            raise RuntimeError("update() called on perturbed weights; call restore() first")
        l2 = es_update(self.master, seeds, weights, alpha, n)
        changed = total = 0
        for name, p in self.params.items():
            new = self.master[name].to(p.dtype)
            changed += int((new != p).sum())
            total += p.numel()
            p.copy_(new)
        return UpdateStats(update_l2=l2, changed_fraction=changed / total, rel_distance=self.rel_distance())

    def rel_distance(self) -> float | None:
        if self.theta0 is None:
            return None
        diff = _norm(self.master[n] - t0 for n, t0 in self.theta0.items())
        return diff / self._theta0_norm

    def checksum(self) -> float:
        return center_checksum(self.master)

    def center_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.master.items()}

    @torch.no_grad()
    def load_center(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self.master) ^ set(state)
        if missing:
            raise KeyError(f"checkpoint and model disagree on parameters: {sorted(missing)[:5]}")
        for name, t in state.items():
            self.master[name].copy_(t)
            self.params[name].copy_(self.master[name])
        self.perturbed = False

    def save_pretrained(self, path: str | Path) -> None:
        if self.perturbed:
            raise RuntimeError("save_pretrained() on perturbed weights; call restore() first")
        self.model.save_pretrained(path)
        self.tok.save_pretrained(path)

    def memory_report(self) -> dict[str, float]:
        model_bytes = sum(p.numel() * p.element_size() for p in self.params.values())
        master_bytes = sum(t.numel() * 4 for t in self.master.values())
        theta0_bytes = master_bytes if self.theta0 is not None else 0
        return {"model_bytes": model_bytes, "master_bytes": master_bytes, "theta0_bytes": theta0_bytes}


@torch.no_grad()
def center_checksum(center: dict[str, torch.Tensor]) -> float:
    """sum_k (k+1) * sum(tensor_k) in float64, tensors in name order: position-sensitive and cheap."""
    return float(sum(float(center[n].sum(dtype=torch.float64)) * (k + 1) for k, n in enumerate(sorted(center))))


def _norm(tensors: Any) -> float:
    return sum(float(t.double().square().sum()) for t in tensors) ** 0.5
