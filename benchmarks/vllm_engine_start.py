"""One vLLM engine on CPU started, asked for 4 tokens and shut down, on a tiny random Llama (tests/toy.py): what each
engine start costs the vLLM tests (an EngineCore and a worker process, both spawned, each importing vLLM). Prints
the phases' wall times and the CPU time of this process and of its children. Run it in `.venv-vllm`; compare
environments with benchmarks/cpu_ab.py (issue 40):

    python benchmarks/cpu_ab.py --cmd "A/bin/python benchmarks/vllm_engine_start.py" --cmd "B/bin/python ..."
"""

import os
import resource
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    os.environ.update(VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    from toy import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", hidden=128, heads=2)  # vLLM's CPU attention: head_dim >= 32
        t0 = time.perf_counter()
        import vllm

        t1 = time.perf_counter()
        llm = vllm.LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
        t2 = time.perf_counter()
        llm.generate(["hello"], vllm.SamplingParams(max_tokens=4), use_tqdm=False)
        t3 = time.perf_counter()
        del llm  # shuts the engine down: its processes exit and are reaped
        t4 = time.perf_counter()
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"import vllm {t1 - t0:.2f} s, LLM() {t2 - t1:.2f} s, generate {t3 - t2:.2f} s, shutdown {t4 - t3:.2f} s")
    print(f"CPU: this process {own.ru_utime + own.ru_stime:.2f} s, its children {kids.ru_utime + kids.ru_stime:.2f} s")


if __name__ == "__main__":  # spawned engine processes import this file again: nothing may run at import
    main()
