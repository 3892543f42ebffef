"""The vLLM backend for ``es.perturbation: lowrank`` (the registry's ``vllm`` backend for it): the driver side.

``VLLMLowRankBackend`` starts its engines eager with low-rank workers (es_setup's ``lowrank``), sends each batch of
members to an engine (es_lowrank_begin), generates all their requests in one call, each request naming its member
and salted with its (seed, scale) so cached attention states stay the member's own, then ends the batch
(es_lowrank_end). The worker side, the hooks adding each token's perturbation, is esbatch/backends/vllm_lowrank.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from esbatch import deadlines as watchdog  # the hang hooks the training watchdog runs
from esbatch.backends import dispatch as dispatching
from esbatch.backends.base import Generation, PerturbedMember, PopulationOutput, SamplingParams
from esbatch.backends.config import ESSetup
from esbatch.backends.vllm import VLLMBackend
from esbatch.backends.vllm_rpc import WorkerCall


class VLLMLowRankBackend(VLLMBackend):
    """VLLMBackend for ``es.perturbation: lowrank``: each engine generates its share of the population in one
    batch, every request carrying its member (esbatch/backends/vllm_lowrank.py, docs/lowrank.md); no weight is
    written for a member. The update, checkpoints and replay are LowRankWeights' (esbatch/perturb/lowrank.py), as
    in the HF backend, so both backends hold the same center for the same updates."""

    def __init__(self, model_dir: str, *, rank: int = 1, vectors: str = "full", **kwargs: Any) -> None:
        if kwargs.get("master", "device") != "device":
            raise ValueError(f"es.perturbation: lowrank needs es.master: device (got {kwargs['master']})")
        self.lowrank = {"rank": rank, "vectors": vectors}
        super().__init__(model_dir, **kwargs)

    @classmethod
    def es_options(cls, setup: ESSetup) -> dict[str, Any]:
        return {**super().es_options(setup), "rank": setup.rank, "vectors": setup.lowrank_vectors}

    def members_per_call(self, n_prompts: int, n: int, n_members: int) -> int:
        """Whole members per engine batch: as many as the scheduler runs at once (max_num_seqs sequences), and at
        most an even share of the population per engine, so every engine works."""
        try:
            seqs = int(self.engines[0].llm_engine.vllm_config.scheduler_config.max_num_seqs)
        except AttributeError:
            seqs = 256
        share = -(-n_members // len(self.engines))
        return max(1, min(share, seqs // max(1, n_prompts * n)))

    def evaluate_population(
        self,
        members: Sequence[PerturbedMember],
        prompts: Sequence[str],
        sampling: SamplingParams,
        claim: dispatching.Claim | None = None,
    ) -> PopulationOutput:
        """Members in batches of whole members, spread over the engines by ``self.dispatch`` (or taken from
        ``claim``); each batch is one es_lowrank_begin, one generate of all its members' requests, one
        es_lowrank_end. Member k's requests have the sampling seeds ``generate`` gives its generation seed."""
        per = self.members_per_call(len(prompts), sampling.n, len(members))
        chunks: list[list[int]] = []
        items: Sequence[int] | dispatching.Claim
        if claim is None:
            chunks = [list(range(i, min(i + per, len(members)))) for i in range(0, len(members), per)]
            items = range(len(chunks))
        else:
            lock = threading.Lock()

            def items() -> int | None:  # a claim of whole batches, taken member by member from the shared one
                with lock:
                    got: list[int] = []
                    while len(got) < per and (i := claim()) is not None:
                        got.append(i)
                    if not got:
                        return None
                    chunks.append(got)
                    return len(chunks) - 1

        ids = self.tok(list(prompts), add_special_tokens=False)["input_ids"]

        def work(e: int, j: int) -> tuple[list[list[Generation]], float]:
            idx = chunks[j]
            t0 = time.perf_counter()
            self._rpc(e, WorkerCall.LOWRANK_BEGIN, [members[i] for i in idx])
            t1 = time.perf_counter()
            requests, params = [], []
            for k, i in enumerate(idx):
                m = members[i]
                salt = f"es:{m.seed}:{m.scale!r}"  # attention states are the member's own (module docstring)
                requests += [{"prompt_token_ids": p, "cache_salt": salt} for p in ids]
                params += self._sampling(sampling, m.gen_seed, len(ids), {"es_member": k})
            with watchdog.waiting_on(f"vLLM engine {e}: generate ({len(idx)} low-rank members x {len(ids)} prompts)"):
                outs = self.engines[e].generate(requests, params, use_tqdm=False)
            t2 = time.perf_counter()
            self._rpc(e, WorkerCall.LOWRANK_END)
            gens = self._generations(outs)
            rows = len(gens) // len(idx)
            return [gens[k * rows : (k + 1) * rows] for k in range(len(idx))], (t1 - t0) + (time.perf_counter() - t2)

        done = dispatching.dispatch(items, len(self.engines), work, self.dispatch, self._pool)
        got = {i: g for j in done.order for i, g in zip(chunks[j], done.results[j][0])}
        move = sum(done.results[j][1] for j in done.order) / len(self.engines)
        order = sorted(got)
        return PopulationOutput(
            [got[i] for i in order],
            generation_s=done.wall_s - move,
            perturb_restore_s=move,
            idle_s=done.idle_s,
            members=order,
        )
