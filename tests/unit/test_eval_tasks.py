"""Evaluation tasks (MATH-500, AIME, AMC, DeepScaleR, GPQA, CommonsenseQA, HotpotQA): loading from local
fixtures, the real hub calls (with `datasets.load_dataset` stubbed), splits, prompts and demo self-consistency."""

import json
from collections import Counter
from pathlib import Path

import pytest

from esbatch.tasks.base import SYSTEM_PROMPTS
from esbatch.tasks.choice import CommonsenseQATask, GPQATask
from esbatch.tasks.hotpotqa import HotpotQATask
from esbatch.tasks.math_tasks import AIME2024Task, AIME2025Task, AMC2023Task, DeepScaleRTask, Math500Task
from esbatch.tasks.verify import Verdict

FIX = Path(__file__).resolve().parents[1] / "fixtures"
C, W, M = Verdict.CORRECT, Verdict.WRONG, Verdict.MISSING

BENCHMARKS = [
    (Math500Task, "math500", 6, "math"),
    (AIME2024Task, "aime", 5, "math"),
    (AMC2023Task, "amc", 4, "math"),
    (GPQATask, "gpqa", 6, "multiple_choice"),
    (CommonsenseQATask, "csqa", 6, "multiple_choice"),
    (HotpotQATask, "hotpotqa", 4, "open_qa"),
]


def fixture(name: str) -> str:
    return str(FIX / f"{name}_tiny.jsonl")


@pytest.mark.parametrize("cls, name, n, family", BENCHMARKS)
def test_benchmark_eval_examples_and_demo_self_consistency(cls, name, n, family):
    task = cls(fixture(name))
    assert task.family == family
    rows = task.eval_examples(None)
    assert len(rows) == n and task.eval_examples(n + 10) == rows and task.eval_examples(0) == rows
    sub = task.eval_examples(3, seed=1)
    assert len(sub) == 3 and sub == task.eval_examples(3, seed=1)
    assert [r.question for r in sub] == [r.question for r in rows if r in sub]  # dataset order kept
    picks = {tuple(e.question for e in task.eval_examples(2, seed=s)) for s in range(10)}
    assert len(picks) > 1  # the seed chooses the subset
    for ex in rows:
        demo = task.demo_response(ex)
        assert task.score(demo, ex) is C, (ex.answer, demo)
        assert task.answer_key(demo, ex) is not None
        assert task.score("I am not sure.", ex) is M and task.answer_key("I am not sure.", ex) is None
    msgs = task.messages(rows[0], [])
    assert msgs[0] == {"role": "system", "content": SYSTEM_PROMPTS[family]}
    assert msgs[-1] == {"role": "user", "content": task.user_message(rows[0])}


@pytest.mark.parametrize("cls, name, n, family", BENCHMARKS)
def test_benchmark_splits_have_no_train_and_heldout_is_eval_examples(cls, name, n, family):
    task = cls(fixture(name))
    sp = task.splits(0, 3, 0, seed=4)
    assert sp["train"] == [] and sp["demo"] == [] and sp["heldout"] == task.eval_examples(3, seed=4)
    assert task.splits(None, 0, 0, seed=0)["heldout"] == []
    with pytest.raises(ValueError, match="no training split"):
        task.splits(10, 3, 0, seed=0)


def test_math_benchmarks_have_no_demo_pool_unless_given_one():
    task = Math500Task(fixture("math500"))
    with pytest.raises(ValueError, match="few_shot: 0"):
        task.splits(0, 2, 1, seed=0)
    pooled = Math500Task(fixture("math500"), demo_path=fixture("deepscaler"))
    sp = pooled.splits(0, 2, 3, seed=0)
    assert len(sp["demo"]) == 3 and all(pooled.score(pooled.demo_response(d), d) is C for d in sp["demo"])


def test_demos_never_repeat_a_heldout_question():
    task = CommonsenseQATask(fixture("csqa"), demo_path=fixture("csqa"))
    sp = task.splits(0, 4, 10, seed=0)
    assert len(sp["demo"]) == 2  # 6 rows, 4 held out
    assert not {d.question for d in sp["demo"]} & {e.question for e in sp["heldout"]}
    with pytest.raises(ValueError, match="demo_path"):
        CommonsenseQATask(fixture("csqa")).splits(0, 2, 1, seed=0)


def test_math500_rows_and_scoring():
    task = Math500Task(fixture("math500"))
    ex = task.eval_examples(None)[0]
    assert ex.answer == r"\left( 3, \frac{\pi}{2} \right)" and ex.meta["subject"] == "Precalculus"
    assert task.user_message(ex).startswith("Convert the point $(0,3)$")
    assert task.score(r"So the point is \boxed{(3, \frac{\pi}{2})}.", ex) is C
    assert task.score(r"\boxed{(3, \pi)}", ex) is W
    assert task.answer_key(r"\boxed{(3,\frac{\pi}{2})}", ex) == task.answer_key(r"\boxed{\left(3, \pi/2\right)}", ex)


def test_aime2024_gold_comes_from_the_boxed_solution():
    task = AIME2024Task(fixture("aime"))
    rows = task.eval_examples(None)
    assert [r.answer for r in rows] == ["204", "113", "540", "601", "055"]
    assert task.score(r"\boxed{55}", rows[-1]) is C and task.score(r"\boxed{56}", rows[-1]) is W
    assert task.demo_response(rows[0]) == r"The answer is \boxed{204}."


def test_aime2025_layout_with_an_answer_field(tmp_path):
    f = tmp_path / "aime25.jsonl"
    rows = [
        {"problem": f"Find the sum of all integer bases $b>{i}$ ...", "answer": str(70 + i), "id": str(i)}
        for i in range(3)
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    exs = AIME2025Task(str(f)).eval_examples(None)
    assert [e.answer for e in exs] == ["70", "71", "72"] and exs[0].meta["id"] == "0"


def test_amc2023_float_answers_become_integers():
    task = AMC2023Task(fixture("amc"))
    exs = task.eval_examples(None)
    assert [e.answer for e in exs] == ["27", "36", "45", "8"]
    assert exs[0].question.startswith("Cities $A$ and $B$")
    assert task.score(r"They meet \boxed{27} miles from A.", exs[0]) is C


def test_missing_fields_are_named(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prob": "x", "answer": "1"}\n')
    with pytest.raises(ValueError, match="problem, question"):
        Math500Task(str(f)).eval_examples(None)
    f.write_text('{"problem": "x", "solution": "no box here"}\n')
    with pytest.raises(ValueError, match="boxed"):
        AIME2024Task(str(f)).eval_examples(None)


def test_deepscaler_splits_disjoint_deduplicated_and_stable_across_seeds():
    task = DeepScaleRTask(fixture("deepscaler"))
    sp = task.splits(None, 3, 2, seed=0)
    assert [len(sp[k]) for k in ("train", "heldout", "demo")] == [6, 3, 2]  # 12 rows, one repeated problem
    qs = [[e.question for e in sp[k]] for k in ("train", "heldout", "demo")]
    assert sum(map(len, qs)) == len(set().union(*map(set, qs)))
    other = task.splits(4, 3, 2, seed=1)
    assert other["heldout"] == sp["heldout"] and other["demo"] == sp["demo"]  # the partition ignores the seed
    assert len(other["train"]) == 4 and set(e.question for e in other["train"]) <= set(qs[0])
    for ex in sum(sp.values(), []):
        assert task.score(task.demo_response(ex), ex) is C, task.demo_response(ex)
    with pytest.raises(ValueError, match="distinct problems"):
        task.splits(None, 10, 2, seed=0)


def test_deepscaler_demo_response_keeps_worked_solutions():
    task = DeepScaleRTask(fixture("deepscaler"))
    exs = {e.answer: e for e in sum(task.splits(None, 0, 0, seed=0).values(), [])}
    assert task.demo_response(exs[r"-\frac{2}{3}"]).endswith(r"Thus, the answer is $\boxed{-\frac{2}{3}}$.")
    assert task.demo_response(exs["26"]).endswith("\n\nThe answer is \\boxed{26}.")  # solution without a box
    assert task.demo_response(exs["4"]) == r"The answer is \boxed{4}."  # empty solution
    assert task.score(r"\boxed{80}", exs[r"80\%"]) is C


def test_gpqa_options_shuffled_deterministically_and_spread(tmp_path):
    task = GPQATask(fixture("gpqa"))
    exs = task.eval_examples(None)
    ex = exs[0]
    assert ex.meta["options"][ex.answer] == "10^-4 eV" and ex.meta["gold_letter"] == ex.answer
    prompt = task.user_message(ex)
    assert prompt.startswith("Two quantum states") and all(f"{k}. {v}" in prompt for k, v in ex.meta["options"].items())
    assert sorted(ex.meta["options"].values()) == sorted(["10^-4 eV", "10^-11 eV", "10^-8 eV", "10^-9 eV"])
    assert [e.answer for e in GPQATask(fixture("gpqa")).eval_examples(None)] == [e.answer for e in exs]
    assert task.score(rf"\boxed{{{ex.answer.lower()}}}", ex) is C
    wrong = next(k for k in "ABCD" if k != ex.answer)
    assert task.score(rf"\boxed{{({wrong})}}", ex) is W and task.answer_key(rf"\boxed{{({wrong})}}", ex) == wrong
    # many questions: the correct letter lands on every position about equally often
    f = tmp_path / "gpqa_many.jsonl"
    rows = [
        {
            "Question": f"Question {i}?",
            "Correct Answer": "right",
            "Incorrect Answer 1": "w1",
            "Incorrect Answer 2": "w2",
            "Incorrect Answer 3": "w3",
        }
        for i in range(400)
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = Counter(e.answer for e in GPQATask(str(f)).eval_examples(None))
    assert set(counts) == set("ABCD") and min(counts.values()) > 70, counts
    reseeded = [e.answer for e in GPQATask(str(f), shuffle_seed=1).eval_examples(None)]
    assert reseeded != [e.answer for e in GPQATask(str(f)).eval_examples(None)]


def test_commonsenseqa_prompt_and_letters(tmp_path):
    task = CommonsenseQATask(fixture("csqa"))
    ex = task.eval_examples(None)[0]
    assert ex.answer == "A" and ex.meta["options"]["E"] == "new york"
    assert task.user_message(ex).endswith("A. bank\nB. library\nC. department store\nD. mall\nE. new york")
    assert task.score(r"\boxed{a}", ex) is C and task.score(r"\boxed{bank}", ex) is C
    assert task.score(r"\boxed{(b)}", ex) is W and task.answer_key(r"\boxed{(b)}", ex) == "B"
    assert task.answer_key(r"\boxed{F}", ex) is None
    f = tmp_path / "csqa_test.jsonl"
    f.write_text(
        json.dumps({"id": "x", "question": "q?", "choices": {"label": ["A", "B"], "text": ["a", "b"]}, "answerKey": ""})
        + "\n"
    )
    with pytest.raises(ValueError, match="validation"):
        CommonsenseQATask(str(f)).eval_examples(None)


def test_hotpotqa_prompt_has_context_and_scoring():
    task = HotpotQATask(fixture("hotpotqa"))
    exs = task.eval_examples(None)
    ex = exs[1]
    msg = task.user_message(ex)
    assert msg.startswith("Context:\nKiss and Tell (1945 film): Kiss and Tell is a 1945")
    assert (
        "diplomat who was Hollywood's number one box-office draw as a child actress from 1935 to 1938. As an adult"
        in msg
    )
    assert msg.endswith("\n\nQuestion: " + ex.question) and "Meet Corliss Archer:" in msg
    assert task.score("<answer>Chief of Protocol</answer>", ex) is C
    assert task.score("<answer>US ambassador to Ghana</answer>", ex) is W
    assert task.score("Chief of Protocol", ex) is M
    assert task.answer_key("<answer> The Chief of Protocol. </answer>", ex) == "chief of protocol"
    assert task.f1("<answer>Chief of Protocol of the United States</answer>", ex) == pytest.approx(2 / 3)
    assert task.f1("no tags", ex) == 0.0
    assert task.score("<answer>Yes</answer>", exs[0]) is C and task.score("<answer>no</answer>", exs[0]) is W
    assert task.messages(ex, [exs[0]])[2] == {"role": "assistant", "content": "<answer>yes</answer>"}


def test_hub_paths_call_datasets_with_the_right_ids(monkeypatch):
    """The hub is unreachable here; check the real loading code asks `datasets` for the right thing."""
    import datasets

    calls = []
    math_rows = [{"problem": f"p{i}", "answer": str(i), "solution": ""} for i in range(6)]
    gpqa_rows = [
        {
            "Question": f"q{i}",
            "Correct Answer": "r",
            "Incorrect Answer 1": "a",
            "Incorrect Answer 2": "b",
            "Incorrect Answer 3": "c",
        }
        for i in range(3)
    ]
    csqa_rows = [
        {"id": str(i), "question": f"q{i}", "choices": {"label": list("AB"), "text": ["x", "y"]}, "answerKey": "B"}
        for i in range(3)
    ]
    hotpot_rows = [
        {"id": str(i), "question": f"q{i}", "answer": "x", "context": {"title": ["T"], "sentences": [["S."]]}}
        for i in range(3)
    ]

    def fake_load(path, name=None, split=None, revision=None, **kw):
        calls.append((path, name, split, revision))
        if path == "Idavidrein/gpqa":
            return gpqa_rows
        if path == "tau/commonsense_qa":
            return csqa_rows
        if path == "hotpotqa/hotpot_qa":
            return hotpot_rows
        return math_rows

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    for cls in (Math500Task, AIME2024Task, AIME2025Task, AMC2023Task):
        assert len(cls().eval_examples(None)) == 6
    assert len(DeepScaleRTask(revision="abc123").splits(None, 2, 1, seed=0)["train"]) == 3
    assert len(GPQATask().eval_examples(None)) == 3
    sp = CommonsenseQATask().splits(0, 2, 1, seed=0)
    assert len(sp["heldout"]) == 2 and len(sp["demo"]) == 1
    assert len(HotpotQATask().eval_examples(None)) == 3
    assert calls == [
        ("HuggingFaceH4/MATH-500", None, "test", None),
        ("math-ai/aime24", None, "test", None),
        ("math-ai/aime25", None, "test", None),
        ("math-ai/amc23", None, "test", None),
        ("agentica-org/DeepScaleR-Preview-Dataset", None, "train", "abc123"),
        ("Idavidrein/gpqa", "gpqa_diamond", "train", None),
        ("tau/commonsense_qa", None, "validation", None),
        ("tau/commonsense_qa", None, "train[:1000]", None),
        ("hotpotqa/hotpot_qa", "distractor", "validation", None),
    ]


def test_params_are_validated():
    errors: list[str] = []
    Math500Task.check_params({"hub_id": "x", "revison": "main", "timeout_s": "5"}, "eval.tasks[0].params", errors)
    assert any("revison" in e and "revision" in e for e in errors), errors
    assert any("timeout_s" in e and "float" in e for e in errors), errors
    assert set(GPQATask.param_spec()) == {"hub_id", "hub_config", "split", "revision", "demo_path", "shuffle_seed"}
    assert set(DeepScaleRTask.param_spec()) == {"hub_id", "split", "revision", "timeout_s"}


# ----------------------------------------------------------------------------- Countdown-Task-GOLD

GOLD_SYSTEM = (
    "You are a helpful assistant. You first think about the reasoning process in the mind and then provide the "
    "user with the answer."
)


def gold_user(nums, target):
    return (
        f"Using the numbers {nums}, create an equation that equals {target}. You can use basic arithmetic "
        "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. "
        "And return the final equation and answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 = 1 "
        "</answer>."
    )


def gold_rows():
    """Rows in the hub's `test` config schema: prompt (role/content messages), target, nums."""
    problems = [([44, 19, 35], 98), ([63, 95, 96], 64), ([95, 11, 56], 28), ([19, 74, 45], 48)]
    return [
        {
            "prompt": [{"content": GOLD_SYSTEM, "role": "system"}, {"content": gold_user(n, t), "role": "user"}],
            "target": t,
            "nums": n,
        }
        for n, t in problems
    ]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_countdown_gold_local_file_uses_the_datasets_messages(tmp_path, suffix):
    import datasets

    from esbatch.tasks import TASKS

    path = tmp_path / f"gold.{suffix}"
    if suffix == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in gold_rows()))
    else:
        datasets.Dataset.from_list(gold_rows()).to_parquet(str(path))
    task = TASKS.get("countdown-gold")(str(path))
    assert task.family == "countdown"
    exs = task.eval_examples(None)
    assert [(e.meta["numbers"], e.meta["target"]) for e in exs] == [(r["nums"], r["target"]) for r in gold_rows()]
    ex = exs[0]
    assert task.messages(ex, []) == gold_rows()[0]["prompt"]  # verbatim: the task statement is not rewritten
    assert ex.question == gold_user([44, 19, 35], 98)
    assert task.score("<think>...</think> <answer>(44 + 19) + 35 = 98</answer>", ex) is C
    assert task.score("<answer>44 + 19 + 35</answer>", ex) is C
    assert task.score("<answer>44 + 19 * 35</answer>", ex) is W
    assert task.score("<answer>44 + 35 + 19 + 0</answer>", ex) is W
    assert task.score("98", ex) is M
    assert task.answer_key("<answer> 44 + 19 + 35 </answer>", ex) == "44+19+35"
    sp = task.splits(0, 2, 0, seed=0)
    assert len(sp["heldout"]) == 2 and sp["train"] == [] and sp["demo"] == []
    with pytest.raises(ValueError, match="no training split"):
        task.splits(5, 0, 0, seed=0)
    with pytest.raises(ValueError, match="few-shot"):
        task.splits(0, 2, 1, seed=0)


def test_countdown_gold_prompt_goes_through_the_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer

    from esbatch.tasks.countdown_gold import CountdownGoldTask

    task = CountdownGoldTask()
    ex = task._convert(gold_rows()[1])
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = tok.apply_chat_template(task.messages(ex, []), tokenize=False, add_generation_prompt=True)
    assert GOLD_SYSTEM in text and gold_user([63, 95, 96], 64) in text
    assert text.index(GOLD_SYSTEM) < text.index(gold_user([63, 95, 96], 64))
    assert task.messages(ex, [], "custom")[0] == {"role": "system", "content": "custom"}  # explicit override only


def test_countdown_gold_verified_rows_and_demos(tmp_path):
    """verified_* configs: `messages` ending with the teacher's correct assistant turn (a JSON string is read too)."""
    from esbatch.tasks.countdown_gold import CountdownGoldTask

    reply = "<think>95 - 11 = 84, 84 / 56 ...</think>\n<answer>(95 - 11) * 56 / 168</answer>"
    rows = []
    for r in gold_rows():
        rows.append({"messages": [*r["prompt"], {"role": "assistant", "content": reply}], **r})
        del rows[-1]["prompt"]
    rows[1]["messages"] = json.dumps(rows[1]["messages"])
    demo = tmp_path / "verified.jsonl"
    demo.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = CountdownGoldTask(demo_path=str(demo))
    ex = task._convert(json.loads(demo.read_text().splitlines()[1]))
    assert [m["role"] for m in ex.meta["messages"]] == ["system", "user"]  # the reply is not part of the prompt
    assert task.demo_response(ex) == reply and ex.answer == "(95 - 11) * 56 / 168"
    msgs = task.messages(task._convert(gold_rows()[3]), [ex])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"] == GOLD_SYSTEM and msgs[2]["content"] == reply


def test_countdown_gold_hub_id_and_bad_rows(monkeypatch, tmp_path):
    import datasets

    from esbatch.tasks import TASKS

    calls = []

    def fake_load(path, name=None, split=None, revision=None, **kw):
        calls.append((path, name, split, revision))
        return gold_rows()

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert len(TASKS.get("countdown-gold")().eval_examples(None)) == 4
    assert len(TASKS.get("countdown-gold")(hub_config="all", split="train").eval_examples(2)) == 2
    assert calls == [
        ("HuggingFaceTB/Countdown-Task-GOLD", "test", "test", None),
        ("HuggingFaceTB/Countdown-Task-GOLD", "all", "train", None),
    ]
    monkeypatch.undo()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"target": 3, "nums": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match="prompt, messages"):
        TASKS.get("countdown-gold")(str(bad)).eval_examples(None)
    bad.write_text(json.dumps({"prompt": [{"role": "system", "content": "x"}], "target": 3, "nums": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match="no user turn"):
        TASKS.get("countdown-gold")(str(bad)).eval_examples(None)
