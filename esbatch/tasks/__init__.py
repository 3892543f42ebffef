"""Task registry. ``TASKS.get(name)`` returns the task class; unknown names list the available ones."""

from esbatch.registry import Registry
from esbatch.tasks.base import SYSTEM_PROMPTS, DataFileError, Example, Task
from esbatch.tasks.verify import Verdict

TASKS: Registry[type[Task]] = Registry("task", expect=Task)
TASKS.register("gsm8k", "esbatch.tasks.gsm8k:GSM8KTask", help="GSM8K math word problems (hub or local file)")
TASKS.register("arithmetic", "esbatch.tasks.gym:ArithmeticTask", help="integer arithmetic, offline (reasoning-gym)")
TASKS.register("chain_sum", "esbatch.tasks.gym:ChainSumTask", help="+ and - over 3-4 numbers, offline (reasoning-gym)")
TASKS.register("countdown", "esbatch.tasks.gym:CountdownTask", help="Countdown numbers game, offline (reasoning-gym)")
TASKS.register(
    "countdown-gold",
    "esbatch.tasks.countdown_gold:CountdownGoldTask",
    help="Countdown-Task-GOLD (HuggingFaceTB), the dataset's own chat prompt, <answer> equation",
)
TASKS.register("math500", "esbatch.tasks.math_tasks:Math500Task", help="MATH-500 competition math, math-verify")
TASKS.register("aime2024", "esbatch.tasks.math_tasks:AIME2024Task", help="AIME 2024 (math-ai), math-verify")
TASKS.register("aime2025", "esbatch.tasks.math_tasks:AIME2025Task", help="AIME 2025 (math-ai), math-verify")
TASKS.register("amc2023", "esbatch.tasks.math_tasks:AMC2023Task", help="AMC 2023 (math-ai), math-verify")
TASKS.register(
    "deepscaler", "esbatch.tasks.math_tasks:DeepScaleRTask", help="DeepScaleR-Preview math training set, math-verify"
)
TASKS.register("gpqa", "esbatch.tasks.choice:GPQATask", help="GPQA-Diamond, 4 shuffled options, boxed letter (gated)")
TASKS.register("commonsenseqa", "esbatch.tasks.choice:CommonsenseQATask", help="CommonsenseQA, 5 options, boxed letter")
TASKS.register("hotpotqa", "esbatch.tasks.hotpotqa:HotpotQATask", help="HotpotQA distractor, <answer> EM (and F1)")
TASKS.register(
    "mbpp", "esbatch.tasks.mbpp:MBPPTask", help="MBPP Python problems, asserts run in a sandbox (hub or local file)"
)
TASKS.register(
    "sst2", "esbatch.tasks.sst2:SST2Task", help="SST-2 sentiment (stanfordnlp/sst2), one-word label; App. E control"
)

__all__ = ["TASKS", "SYSTEM_PROMPTS", "DataFileError", "Example", "Task", "Verdict"]
