"""Countdown-Task-GOLD (HuggingFaceTB, 2025): the Countdown held-out task of the Easy Setting (App. G.5, G.6).

As the paper says, the dataset's role/content messages are rendered without rewriting; the ``<answer>`` equation
is scored by :func:`check_countdown` (each number once, ``+ - * /``, parentheses, exact rational arithmetic).
The paper gives no hub id: ``HUB_ID`` and the schema come from public code that loads it (TRL's GOLD trainer docs,
evaluation scripts), not from the dataset card. Config ``test``, split ``test`` (default): ``prompt`` (system and
user messages), ``nums``, ``target``; configs ``all`` / ``verified_<teacher>``, split ``train``: ``messages``, the
verified ones ending in the teacher's assistant turn (a demonstration through ``demo_path``). Messages may be a
JSON string; the prompt is every message before the first assistant turn. Evaluation only, like
:class:`esbatch.tasks.math_tasks.BenchmarkTask` (``limit``: a seeded subset); a local ``data_path`` in the same
schema replaces the hub.
"""

from __future__ import annotations

import json
from typing import Any

from esbatch.tasks.base import Example
from esbatch.tasks.gym import CountdownTask
from esbatch.tasks.math_tasks import BenchmarkTask, field
from esbatch.tasks.verify import Verdict, check_countdown, countdown_key, extract_answer_tag

HUB_ID = "HuggingFaceTB/Countdown-Task-GOLD"


def chat_messages(value: Any, what: str) -> list[dict[str, str]]:
    """The row's role/content messages as plain dicts (a JSON string of them is accepted too)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what}: messages are a string that is not JSON ({e})") from None
    if not isinstance(value, list) or not value:
        raise ValueError(f"{what}: expected a non-empty list of role/content messages, got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{what}: message {i} is not a {{'role': ..., 'content': ...}} mapping: {m!r:.120}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


class CountdownGoldTask(BenchmarkTask):
    """Countdown-Task-GOLD: the dataset's own chat prompt; the ``<answer>`` equation must reach the target."""

    family = "countdown"
    title = "Countdown-Task-GOLD"

    def __init__(
        self,
        data_path: str | None = None,
        *,
        hub_id: str = HUB_ID,
        hub_config: str = "test",
        split: str = "test",
        revision: str | None = None,
        demo_path: str | None = None,
    ) -> None:
        super().__init__(
            data_path, hub_id=hub_id, split=split, hub_config=hub_config, revision=revision, demo_path=demo_path
        )

    def _convert(self, row: dict[str, Any]) -> Example:
        msgs = chat_messages(field(row, "prompt", "messages", what=self.title), self.title)
        first_reply = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
        prompt, reply = msgs[:first_reply], msgs[first_reply:]
        if not any(m["role"] == "user" for m in prompt):
            raise ValueError(f"{self.title}: the row's messages have no user turn before the first assistant turn")
        nums = field(row, "nums", "numbers", what=self.title)
        base = CountdownTask._example(list(nums), field(row, "target", what=self.title))
        meta = {**base.meta, "messages": prompt}
        solution = reply[0]["content"] if reply else ""
        if solution:
            meta["solution"] = solution
        answer = (extract_answer_tag(solution) or "") if solution else ""
        question = [m["content"] for m in prompt if m["role"] == "user"][-1]
        return Example(question=question, answer=answer, meta=meta)

    # --- prompting -------------------------------------------------------------------------
    def user_message(self, ex: Example) -> str:
        """The dataset's (last) user turn, word for word."""
        return [m["content"] for m in ex.meta["messages"] if m["role"] == "user"][-1]

    def messages(self, ex: Example, demos: list[Example], system_prompt: str | None = None) -> list[dict[str, str]]:
        """The row's messages as distributed (its system turn included); demonstrations go after the system
        turn as user/assistant pairs. ``system_prompt`` (a config's explicit override) replaces the system turn."""
        own = [dict(m) for m in ex.meta["messages"]]
        system = [m for m in own if m["role"] == "system"]
        if system_prompt is not None:
            system = [{"role": "system", "content": system_prompt}]
        turns = []
        for d in demos:
            turns.append({"role": "user", "content": self.user_message(d)})
            turns.append({"role": "assistant", "content": self.demo_response(d)})
        return system + turns + [m for m in own if m["role"] != "system"]

    def demo_response(self, ex: Example) -> str:
        """The row's own assistant turn (``verified_*`` configs), else its answer expression in tags."""
        if ex.meta.get("solution"):
            return ex.meta["solution"]
        if ex.answer:
            return f"<answer>{ex.answer}</answer>"
        raise ValueError(
            f"{self.title}: these rows carry no solution to demonstrate; use few_shot: 0 (the paper's setting) or "
            "a demo_path from a verified_* config"
        )

    # --- scoring ---------------------------------------------------------------------------
    def score(self, response: str, ex: Example) -> Verdict:
        return check_countdown(response, ex.meta["numbers"], ex.meta["target"])

    def answer_key(self, response: str, ex: Example) -> str | None:
        return countdown_key(response)
