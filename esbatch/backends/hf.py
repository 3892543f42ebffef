"""HF transformers backend: batched sampling with a KV cache and left padding; in-place weight moves.

The parameters follow an fp32 center (``self.master``) with exact restore (esbatch/perturb/centered.py), or,
with ``es.restore: inplace``, are perturbed, restored and updated in place in the compute dtype as the paper
does (esbatch/perturb/inplace.py; no master).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from esbatch.backends.base import ESBackend, Generation, Generator, SamplingParams, UpdateStats
from esbatch.backends.config import BackendConfig, ESSetup
from esbatch.models import ModelConfig, load_model_and_tokenizer, load_weights
from esbatch.perturb import DEFAULT_NOISE, weights_for
from esbatch.perturb.inplace import coordinate_sample
from esbatch.perturb.update import UpdateSpec

if TYPE_CHECKING:
    from transformers import GenerationConfig


class HFGenerator(Generator):
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

    def generation_config(self, sampling: SamplingParams, *, sample: bool | None = None) -> Any:
        """The GenerationConfig of ``sampling``: temperature + top_p only (no top-k truncation); ``sample=False``
        decodes greedily whatever the temperature (the low-rank backend samples in its own logits processor)."""
        from transformers import GenerationConfig

        greedy = sampling.temperature == 0
        n = sampling.n
        if greedy and n > 1:
            raise ValueError("greedy decoding gives one response per prompt; use n=1 or temperature > 0")
        do_sample = not greedy if sample is None else sample
        return GenerationConfig(
            do_sample=do_sample,
            temperature=sampling.temperature if do_sample else None,
            top_p=sampling.top_p if do_sample else None,
            top_k=0 if do_sample else None,  # no top-k truncation: sampling is temperature + top_p only
            max_new_tokens=sampling.max_new_tokens,
            pad_token_id=self.tok.pad_token_id,
            eos_token_id=self.eos_ids,
            num_return_sequences=n,
        )

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], sampling: SamplingParams, seed: int) -> list[Generation]:
        gcfg = self.generation_config(sampling)
        torch.manual_seed(seed)
        out: list[Generation] = []
        per_call = max(1, self.batch_size // sampling.n)  # batch_size counts sequences: n samples of each prompt
        for i in range(0, len(prompts), per_call):
            out += self.generate_call(list(prompts[i : i + per_call]), gcfg, sampling)
        return out

    def generate_call(
        self, chunk: list[str], gcfg: GenerationConfig, sampling: SamplingParams, processors: Sequence[Any] = ()
    ) -> list[Generation]:
        """One model.generate over ``chunk`` (left-padded together), ``processors`` run after the entropy meter."""
        from transformers import LogitsProcessorList

        enc = self.tok(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(self.model.device)
        meter = _EntropyMeter(self.eos_ids, sampling.temperature) if sampling.entropy else None
        lp = _SampledLogprobs(sampling.temperature, sampling.top_p) if sampling.logprobs else None
        procs = [p for p in (meter, lp, *processors) if p is not None]
        seqs = self.model.generate(
            **enc, generation_config=gcfg, logits_processor=LogitsProcessorList(procs) if procs else None
        )
        ent = meter.means() if meter else None
        per_token = meter.tokens() if meter else None
        logprobs = lp.finish(seqs) if lp else None
        out: list[Generation] = []
        for r, row in enumerate(seqs[:, enc["input_ids"].shape[1] :].tolist()):
            n_tok = len(row)
            for k, tok_id in enumerate(row):
                if tok_id in self.eos_ids:
                    n_tok = k + 1
                    break
            text = self.tok.decode(row[:n_tok], skip_special_tokens=True)
            h = None if per_token is None else per_token[r]
            gen = Generation(text, n_tok, None if ent is None else ent[r], row[:n_tok], h)
            gen.logprobs = None if logprobs is None else logprobs[r][:n_tok]
            out.append(gen)
        return out


class _SampledLogprobs:
    """A logits processor that leaves the scores alone and records, for each row, the log-prob of the token
    sampled at each step under the distribution it was sampled from: softmax(logits / T) cut to top_p by HF's own
    TopPLogitsWarper (custom processors see the scores before HF's warpers, so it applies them itself; greedy:
    T = 1, no cut). The token of step k is known at step k + 1 (``input_ids``' last column) or, for the last
    step, from the finished sequences (``finish``). vLLM's processed_logprobs are the same quantity."""

    def __init__(self, temperature: float, top_p: float) -> None:
        from transformers import TopPLogitsWarper

        self.temperature = temperature or 1.0
        self.top_p = TopPLogitsWarper(top_p) if temperature and top_p < 1.0 else None
        self.pending: torch.Tensor | None = None  # the last step's log-probs [rows, V]
        self.steps: list[torch.Tensor] = []  # each step's sampled token's log-prob [rows]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self._take(input_ids[:, -1])
        z = scores.float() / self.temperature
        if self.top_p is not None:
            z = self.top_p(input_ids, z)
        self.pending = torch.log_softmax(z, dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        assert self.pending is not None
        self.steps.append(self.pending.gather(-1, tokens.view(-1, 1).to(self.pending.device)).squeeze(-1).cpu())
        self.pending = None

    def finish(self, sequences: torch.Tensor) -> list[list[float]]:
        """Each row's log-probs, one per generated step (past a row's EOS they are those of its padding)."""
        if self.pending is not None:
            self._take(sequences[:, -1])
        if not self.steps:
            return [[] for _ in range(sequences.shape[0])]
        return torch.stack(self.steps, dim=1).tolist()


class _EntropyMeter:
    """A logits processor that leaves the scores alone and accumulates each row's token entropy.

    HF runs custom processors before its temperature/top-p warpers, so the meter divides by the temperature
    itself: H is that of softmax(logits / T), the temperature-scaled distribution before top-p truncation
    (TRL's convention; greedy: T = 1). Rows stop counting after EOS. Memory: a float per row and step (each
    token's entropy, ``tokens``) instead of keeping (steps x vocab) scores.
    """

    def __init__(self, eos_ids: list[int], temperature: float = 1.0) -> None:
        self.eos = torch.tensor(eos_ids)
        self.temperature = temperature or 1.0
        self.total: torch.Tensor | None = None
        self.count: torch.Tensor | None = None
        self.done: torch.Tensor | None = None
        self.start: int | None = None
        self.steps: list[torch.Tensor] = []  # each step's H of every row

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
        self.steps.append(h)
        return scores

    def means(self) -> list[float]:
        return (self.total / self.count.clamp(min=1)).tolist()

    def tokens(self) -> list[list[float]]:
        """Each row's per-token entropies: its first ``count`` steps (a row counts until its EOS)."""
        if not self.steps:
            return []
        table = torch.stack(self.steps, dim=1).tolist()
        return [row[: int(n)] for row, n in zip(table, self.count.tolist())]


class HFBackend(HFGenerator, ESBackend):
    """One HF model whose parameters ES moves: CenteredWeights (fp32 center, exact restore) or InplaceWeights
    (in place in the compute dtype), by ``restore`` (es.restore)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        batch_size: int = 64,
        track_drift: bool = True,
        restore: str = "exact",
        noise: str = DEFAULT_NOISE,
        master: str = "device",
    ) -> None:
        super().__init__(model, tokenizer, batch_size=batch_size)
        params = dict(model.named_parameters())  # tied weights once
        self.master_layout = master  # es.master: where the fp32 center lives (esbatch/perturb/offload.py)
        self.weights = self.make_weights(params, restore, track_drift, noise)
        self.params, self.master, self.theta0 = self.weights.live, self.weights.master, self.weights.theta0
        self.restore_mode = restore

    def make_weights(self, params: dict[str, torch.Tensor], restore: str, track_drift: bool, noise: str) -> Any:
        """The keeper of the live weights (esbatch/perturb); the low-rank backend keeps low-rank directions."""
        return weights_for(params, restore, track_drift, noise, self.master_layout)

    @classmethod
    def for_es(cls, setup: ESSetup) -> HFBackend:
        m = setup.model
        model, tok = load_model_and_tokenizer(m.name, m.gguf_file, m.revision, m.dtype, m.device)
        backend = cls(model, tok, **cls.es_options(setup))
        if m.init_weights:  # an earlier stage's weights; theta_0 (drift) stays the base model
            from safetensors.torch import load_file

            backend.load_center(load_file(m.init_weights))
        return backend

    @classmethod
    def es_options(cls, setup: ESSetup) -> dict[str, Any]:
        """The constructor's keyword arguments."""
        return {
            "batch_size": setup.batch_size,
            "track_drift": setup.track_drift,
            "restore": setup.restore,
            "noise": setup.noise,
            "master": setup.master,
        }

    @classmethod
    def for_inference(
        cls, model: ModelConfig, center: Path | None, batch_size: int, backend: BackendConfig | None = None
    ) -> HFGenerator:
        """One model on model.device (``backend``'s engine settings do not apply)."""
        lm, tok = load_model_and_tokenizer(model.name, model.gguf_file, model.revision, model.dtype, model.device)
        if center is not None:
            load_weights(lm, center)
        return HFGenerator(lm, tok, batch_size=batch_size)

    @classmethod
    def for_policy(cls, module: Any, tokenizer: Any, setup: ESSetup) -> HFGenerator:
        """Generation from the trained module itself: nothing to load after an optimizer step."""
        return HFGenerator(module, tokenizer, batch_size=setup.batch_size)

    # ---------------------------------------------------------------- weights
    @property
    def perturbed(self) -> bool:
        return self.weights.perturbed

    def perturb(self, seed: int, scale: float) -> None:
        self.weights.perturb(seed, scale)

    def restore(self) -> None:
        self.weights.restore()

    @property
    def chains_members(self) -> bool:  # type: ignore[override]
        """es.restore: exact: perturb() writes every weight from the fp32 center, so no restore between members."""
        return self.restore_mode == "exact"

    def perturb_next(self, seed: int, scale: float) -> None:
        if self.chains_members:
            self.weights.perturb(seed, scale, over=True)
        else:
            super().perturb_next(seed, scale)

    def update(self, spec: UpdateSpec) -> UpdateStats:
        l2, changed = self.weights.update(spec)
        return UpdateStats(update_l2=l2, changed_fraction=changed, rel_distance=self.weights.rel_distance())

    def checksum(self) -> float:
        return self.weights.checksum()

    def replica_samples(self) -> list[torch.Tensor]:
        return [coordinate_sample(self.weights.live)]

    def center_state_dict(self) -> dict[str, torch.Tensor]:
        return self.weights.state_dict()

    def load_center(self, state: dict[str, torch.Tensor]) -> None:
        self.weights.load(state)

    def save_pretrained(self, path: str | Path) -> None:
        if self.perturbed:
            raise RuntimeError("save_pretrained() on perturbed weights; call restore() first")
        self.model.save_pretrained(path)
        self.tok.save_pretrained(path)

    def memory_report(self) -> dict[str, float]:
        return self.weights.memory_report()

    def close(self) -> None:
        if close := getattr(self.weights, "close", None):  # es.master: disk closes its scratch file
            close()
