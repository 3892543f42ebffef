"""Task registry. ``TASKS.get(name)`` returns the task class; unknown names list the available ones."""

from esbatch.registry import Registry
from esbatch.tasks.base import SYSTEM_PROMPTS, Example, Task
from esbatch.tasks.verify import Verdict

TASKS: Registry[type[Task]] = Registry("task")
TASKS.register("gsm8k", "esbatch.tasks.gsm8k:GSM8KTask", help="GSM8K math word problems (hub or local file)")
TASKS.register("arithmetic", "esbatch.tasks.gym:ArithmeticTask", help="integer arithmetic, offline (reasoning-gym)")
TASKS.register("chain_sum", "esbatch.tasks.gym:ChainSumTask", help="+ and - over 3-4 numbers, offline (reasoning-gym)")
TASKS.register("countdown", "esbatch.tasks.gym:CountdownTask", help="Countdown numbers game, offline (reasoning-gym)")

__all__ = ["TASKS", "SYSTEM_PROMPTS", "Example", "Task", "Verdict"]
