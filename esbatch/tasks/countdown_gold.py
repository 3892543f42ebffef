"""Countdown-Task-GOLD (HuggingFaceTB, 2025): the Countdown held-out task of the Easy Setting (App. G.5, G.6).

The paper: "Countdown uses the role/content messages distributed with the dataset and renders them without
rewriting the task statement"; answers go in ``<answer>`` tags and are scored by :func:`check_countdown`
(each given number exactly once, ``+ - * /`` and parentheses, exact rational arithmetic).

Hub id and schema. The paper cites "HuggingFaceTB Countdown-task-gold" (a Hugging Face dataset) without an
id; the id ``HuggingFaceTB/Countdown-Task-GOLD`` and the schema below come from public code that loads it,
because the dataset card could not be read from this machine (no hub access): huggingface/trl
``docs/source/gold_trainer.md`` (config ``verified_Qwen2.5-0.5B-Instruct``, split ``train``), a TRL-based
``countdown_eval.py`` pointing to the HuggingFaceH4 on-policy-distillation write-up (config ``test``, split
``test``; ``prompt`` rendered with ``apply_chat_template``, its system turn replaced only on request; ``nums``,
``target``; 500 problems drawn with a seed by default), and several evaluation and data scripts that read the
same fields (``prompt[0]`` system, ``prompt[1]`` user; ``all`` / ``verified_*`` rows with ``messages``):

* config ``test``, split ``test`` (the default here): ``prompt`` = the chat messages, a list of
  ``{"role", "content"}`` (system, then user: "Using the numbers [..], create an equation that equals T. ...
  return the final equation and answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 = 1
  </answer>."), ``nums`` (list of int) and ``target`` (int);
* config ``all`` and ``verified_<teacher model>`` (e.g. ``verified_Qwen2.5-7B-Instruct``), split ``train``:
  ``nums``, ``target`` and ``messages`` (the verified ones end with the teacher's correct assistant turn).

Assumed, not confirmed against the card: the field names are exactly ``prompt`` / ``messages``, ``nums`` and
``target`` (every script read them so), the messages may also be stored as a JSON string (accepted), and the
``test`` split is the evaluation set (those scripts evaluate on it). Either message field is read; the
prompt is every message before the first assistant turn, and that assistant turn (verified configs) is the
row's worked solution, usable as a few-shot demonstration through ``demo_path``.

A local ``data_path`` (jsonl/json/parquet/csv, rows in the same schema) replaces the hub. Evaluation-only,
like the other held-out benchmarks (:class:`esbatch.tasks.math_tasks.BenchmarkTask`): ``limit`` picks a
seeded random subset; there is no training split. The offline ``countdown`` task (reasoning-gym) stays.
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
