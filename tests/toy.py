"""Test helpers: a tiny random-init Llama with a character tokenizer, and a toy task whose reward
varies for random text (so ES updates are non-zero). Nothing is downloaded."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from esbatch.tasks.base import Example, Task, disjoint_splits
from esbatch.tasks.verify import Verdict
from esbatch.train import stop

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


ROOT = Path(__file__).resolve().parents[1]


def run_esbatch(*args: str, timeout: float = 600, threads: int | None = 1) -> subprocess.CompletedProcess:
    """`python -m esbatch ARGS` from the repository root, toy tasks importable, output captured."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "esbatch", *args]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def spawn_esbatch(*args: str) -> subprocess.Popen:
    """`python -m esbatch ARGS` started in the background (one thread, toy tasks importable), output piped."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "esbatch", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def toy_config(model_dir: str | Path, *, heldout: int = 4, gen_batch: int = 8, **sections) -> dict:
    """The run config most integration tests train: the toy digit task on a tiny model, ES N=4 B=4.

    Each keyword replaces or adds one top-level section (`es=`, `grpo=`, `eval=`, `algorithm=`, ...);
    `es_updates=` only sets `es.updates`. Sections passed as None are dropped."""
    es_updates = sections.pop("es_updates", None)
    cfg = {
        "run": {"seed": 3, "threads": 1},
        "model": {"name": str(model_dir), "dtype": "float32"},
        "task": {"name": "toy:DigitTask", "params": {"size": 16}, "heldout_size": heldout, "few_shot": 1},
        "generation": {"temperature": 1.0, "max_new_tokens": 6, "batch_size": gen_batch},
        "es": {"population_size": 4, "sigma": 0.05, "alpha": 0.02, "batch_size": 4},
        **sections,
    }
    if es_updates is not None:
        cfg["es"] = {**cfg["es"], "updates": es_updates}
    return {k: v for k, v in cfg.items() if v is not None}


_SESSION_TINY: list[Path] = []


def session_tiny_model(tmp_path_factory: Any) -> Path:
    """The test session's tiny model (make_tiny_model's defaults), built once: the ``tiny_model_dir`` fixture, which
    the fast tier builds before its first test (tests/unit/conftest.py) so that no test's time includes it."""
    if not _SESSION_TINY:
        _SESSION_TINY.append(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))
    return _SESSION_TINY[0]


def make_tiny_model(path: str | Path, seed: int = 0, *, hidden: int = 32, heads: int = 4, kind: str = "llama") -> Path:
    """Save a 2-layer Llama (hidden 32, tied embeddings) with a character-level tokenizer as an HF directory;
    ``kind="qwen2"``: a Qwen2 (q/k/v biases and norm weights given values, one norm weight entry 0; untied lm_head).

    vLLM's CPU attention needs head_dim >= 32 or so: use hidden=128, heads=2 for it."""
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "<|im_end|>", "<|im_start|>"]
    chars = sorted(set(" \n0123456789+-*/=.,:?!()[]{}<>\\_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>"
    )
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=256,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    )
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
        with torch.no_grad():  # HF initializes biases to zero and norm weights to one: give them values
            for n, p in model.named_parameters():
                if n.endswith("bias"):
                    p.normal_(0, 0.1)
                elif n.endswith("norm.weight"):
                    p.normal_(1, 0.1)
            model.model.layers[0].post_attention_layernorm.weight[3] = 0  # vLLM low rank: a norm it cannot divide by
    path = Path(path)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


class DigitTask(Task):
    """Toy task for tests: 'correct' if the response contains the gold digit, 'wrong' if it has another
    digit, 'missing' if it has none. Random text scores differently across ES members."""

    family = "math"

    def __init__(self, data_path: str | None = None, *, size: int = 40) -> None:
        super().__init__(data_path)
        self.size = size

    def splits(self, n_train, n_heldout, n_demo, seed):
        def make(n, s):
            return [Example(f"Say a digit #{s}-{i}", str((s + i) % 10)) for i in range(n)]

        return disjoint_splits(make, n_train or self.size, n_heldout, n_demo, seed)

    def demo_response(self, ex):
        return ex.answer

    def score(self, response, ex):
        if ex.answer in response:
            return Verdict.CORRECT
        return Verdict.WRONG if any(c.isdigit() for c in response) else Verdict.MISSING


class RaisingDigitTask(DigitTask):
    """DigitTask whose scorer raises on every response with a digit in it (a broken verifier)."""

    def score(self, response, ex):
        if any(c.isdigit() for c in response):
            raise ValueError(f"cannot read {response[:8]!r}")
        return Verdict.MISSING


class HangingDigitTask(DigitTask):
    """DigitTask whose scorer never returns once, to test the watchdog: the ``hang_after``-th call to score
    (counted per process) on rank ``rank`` blocks forever if the file ``marker`` exists, and deletes it first,
    so the resumed run does not hang again."""

    def __init__(self, data_path=None, *, size=40, marker="", hang_after=0, rank="0"):
        super().__init__(data_path, size=size)
        self.marker, self.hang_after, self.rank, self.calls = marker, hang_after, str(rank), 0

    def score(self, response, ex):
        self.calls += 1
        if self.calls > self.hang_after and os.environ.get("RANK", "0") == self.rank and os.path.exists(self.marker):
            os.remove(self.marker)
            threading.Event().wait()  # never returns
        return super().score(response, ex)


class GatedDigitTask(DigitTask):
    """DigitTask whose scorer waits once at a test's gate (tests/gate.py): on rank ``rank``, at the first response
    to the ``after_examples + 1``-th distinct problem the process scores, so it is inside the update (or eval
    chunk) that brings that problem (``examples_before``). Scores as DigitTask, so a gated run ends on the center
    of an ungated one. ``argv``: only in a process whose command line has an argument containing it (a pipeline's
    stage, e.g. "stage2-grpo"). ``idle_tracking``: first wait until the process's tracking writer is idle
    (tracking_idle)."""

    def __init__(self, data_path=None, *, size=40, gate="", after_examples=0, rank="0", argv="", idle_tracking=False):
        super().__init__(data_path, size=size)
        self.gate, self.after, self.rank = gate, int(after_examples), str(rank)
        self.idle_tracking = bool(idle_tracking)
        self.here = not argv or any(argv in a for a in sys.argv)
        self.seen: set[str] = set()
        self._lock = threading.Lock()

    def score(self, response, ex):
        with self._lock:  # scorers may run in threads
            new = ex.question not in self.seen
            self.seen.add(ex.question)
            due = new and len(self.seen) == self.after + 1
        if due and self.here and os.environ.get("RANK", "0") == self.rank:
            from gate import wait_at

            if self.idle_tracking:
                tracking_idle()
            tag = f"{os.getpid()}"
            if "SLURM_JOB_ID" in os.environ:  # "pid job" where job is what scancel/scontrol take
                array = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
                tag += " " + (f"{array[0]}_{array[1]}" if all(array) else os.environ["SLURM_JOB_ID"])
            if wait_at(self.gate, tag) == "stop" and not stop.STOP.wait(600):
                raise RuntimeError("released by the gate to stop, but no stop signal arrived in 600 s")
        return super().score(response, ex)


def run_page_sections(metric_keys: Any) -> list[str]:
    """The chart sections of a run's page in MLflow 3's UI, in order: one per metric-name prefix (the part before
    the last ``/``), sorted by name (RunsChartsCardConfig.getBaseChartAndSectionConfigs); ``system/`` goes to its
    own tab and names without a prefix to a last section, so neither is listed."""
    return sorted({k.rsplit("/", 1)[0] for k in metric_keys if "/" in k} - {"system"})


def tracking_idle(limit_s: float = 300) -> None:
    """Until this process's tracking writers (esbatch/tracking/writer.py) have sent everything logged so far (a
    safety limit only): a run waiting at a gate then writes nothing more while it waits (its main thread is held,
    its writer has nothing to send), so a test comparing the run's files and store sees only other processes'
    writes. Waits on the writer's own condition, no polling."""
    import gc

    from esbatch.tracking.writer import TrackingWriter

    for w in [o for o in gc.get_objects() if isinstance(o, TrackingWriter)]:
        with w._cond:
            w._cond.wait_for(w._done, timeout=limit_s)


def examples_before(cfg: dict, update: int, rank: int = 0) -> int:
    """Distinct problems a run of ``cfg`` (a toy config) has scored on ``rank`` before update ``update`` brings
    its first new one: the held-out problems (evaluated first, on rank 0 only), then B new training problems per
    update (within the first pass over the training set). The same for ES and GRPO and any population or group
    size, and for every rank (each scores its members on all B prompts)."""
    algo = cfg.get("algorithm", "es")
    b = cfg[algo if algo in ("es", "grpo") else "es"]["batch_size"]
    assert update * b <= cfg["task"]["params"]["size"], "the gate counts problems within the first epoch"
    return (cfg["task"].get("heldout_size", 0) if rank == 0 else 0) + update * b


def gated(cfg: dict, gate: str, update: int, rank: int = 0) -> dict:
    """``cfg`` (a toy config) with its task waiting at ``gate`` inside update ``update`` on rank ``rank``."""
    params = {**cfg["task"].get("params", {}), "gate": gate, "after_examples": examples_before(cfg, update, rank)}
    return {**cfg, "task": {**cfg["task"], "name": "toy:GatedDigitTask", "params": {**params, "rank": str(rank)}}}


def fuse(hf_state):
    """The engine layout of an HF state dict (what vLLM's loader builds): used to test ``hf_views``."""
    import torch

    from esbatch.backends.layout import fused_name

    groups: dict = {}
    for name, t in hf_state.items():
        target, pos = fused_name(name) or (name, 0)
        groups.setdefault(target, []).append((pos, t))
    return {k: torch.cat([t for _, t in sorted(v, key=lambda x: x[0])]) for k, v in groups.items()}


def live_state_dict(backend, engine: int = 0):
    """The weights a vLLM engine generates with, as fp32 under HF names (to compare with the HF backend)."""
    return backend._state("live", engine)


def logged(run_dir: str | Path) -> int:
    """Updates in a run folder's log.jsonl (complete lines)."""
    log = Path(run_dir) / "log.jsonl"
    return log.read_bytes().count(b"\n") if log.exists() else 0


class LauncherDouble:
    """A launcher that records what it is asked to submit (each call's keys) and starts nothing."""

    foreground = False

    def __init__(self):
        self.submitted = []

    def submit(self, sd, name, keys, after=None):
        self.submitted.append(list(keys))
        return [{"job_id": "99", "keys": list(keys)}]

    def describe(self, sd, name, n_tasks):
        return f"would submit {n_tasks} task(s)"
