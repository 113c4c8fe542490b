"""examples/reasoning_gym.py: the written splits (chat prompts, held out), the reward against the tasks' own scorers,
the one-line errors, and a tiny rloo.py run on a written dataset with the reward."""

import importlib.util
import json
import random
import re
import tomllib

import pytest

pytest.importorskip("reasoning_gym")
pytest.importorskip("math_verify")

import rloo  # noqa: E402
from conftest import ROOT, assert_one_line_error, run_main, run_script  # noqa: E402

spec = importlib.util.spec_from_file_location("reasoning_gym_example", ROOT / "examples" / "reasoning_gym.py")
rg_example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rg_example)
rg = rg_example.reasoning_gym

TASKS = ["leg_counting", "basic_arithmetic"]


def write(tmp_path, task: str, *flags: str, size: int = 60, eval_size: int = 30, seed: int = 3):
    out = tmp_path / task
    rg_example.main(["--task", task, "--size", str(size), "--eval-size", str(eval_size), "--seed", str(seed),
                     "--out", str(out), *flags])
    return out


def load(folder, split: str) -> list[dict]:
    """The split as the scripts load it (--dataset folder --dataset-split/--eval-split)."""
    return list(rloo.load_prompt_dataset(str(folder), split, "prompt"))


# ---- the written dataset --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
def test_rows_are_chat_prompts_with_a_shot_and_the_entry(tmp_path, task):
    train, test = load(folder := write(tmp_path, task), "train"), load(folder, "test")
    assert (len(train), len(test)) == (60, 30)
    expected = list(rg.create_dataset(task, seed=3, size=60))
    for i, r in enumerate(train):
        entry = json.loads(r["entry"])
        assert entry == json.loads(json.dumps(expected[i]))  # train row i: the task's entry of seed 3 + i
        shot = expected[(i + 1) % 60]
        assert [m["role"] for m in r["prompt"]] == ["system", "user", "assistant", "user"]
        assert r["prompt"][0]["content"] == rg.utils.SYSTEM_PROMPTS["default"]
        assert r["prompt"][1:] == [{"role": "user", "content": shot["question"]},
                                   {"role": "assistant", "content": f"<answer>{shot['answer']}</answer>"},
                                   {"role": "user", "content": entry["question"]}]
    for r in test:  # a test row's shot is a train entry too
        assert r["prompt"][1]["content"] in {e["question"] for e in expected}
        assert r["prompt"][-1]["content"] == json.loads(r["entry"])["question"]


@pytest.mark.parametrize("task", TASKS)
def test_the_test_split_is_held_out(tmp_path, task):
    folder = write(tmp_path, task, "--shots", "0", "--system-prompt", "none")
    train, test = load(folder, "train"), load(folder, "test")
    train_q = [json.loads(r["entry"])["question"] for r in train]
    test_q = [json.loads(r["entry"])["question"] for r in test]
    assert not set(train_q) & set(test_q) and len(set(test_q)) == len(test_q)
    # the test split's entries come from the seeds after the train split's, skipping repeated questions
    later = [e for e in rg.create_dataset(task, seed=3 + 60, size=300)]
    assert all(json.loads(r["entry"]) in [json.loads(json.dumps(e)) for e in later] for r in test)
    assert [r["prompt"] for r in test[:2]] == [[{"role": "user", "content": q}] for q in test_q[:2]]


def test_a_small_task_cannot_fill_a_held_out_split(tmp_path):
    # chain_sum with two one-digit terms asks about 200 questions, which 500 train rows nearly exhaust
    config = '{"max_terms": 2, "max_digits": 1}'
    result = run_main("examples/reasoning_gym.py", "--task", "chain_sum", "--config", config, "--size", "500",
                      "--eval-size", "64", "--out", tmp_path / "d")
    assert_one_line_error(result, "--eval-size 64", "lower --size or --eval-size")


@pytest.mark.parametrize(("flags", "flag", "words"), [
    (["--task", "leg_count"], "--task 'leg_count'", ["--list"]),
    (["--config", '{"max_animal": 3}'], "--config", ["LegCountingConfig"]),
    (["--config", "[3]"], "--config '[3]'", ["JSON object"]),
    (["--shots", "60"], "--shots 60", ["give 0 to --size - 1"]),
    (["--task", "arc_agi"], "--task 'arc_agi'", ["tuples"]),  # its grids are tuples, which JSON makes lists
])
def test_bad_flags_stop_with_one_line(tmp_path, flags, flag, words):
    result = run_main("examples/reasoning_gym.py", "--size", "60", "--eval-size", "5", "--out", tmp_path / "d", *flags)
    assert_one_line_error(result, flag, *words)
    assert not (tmp_path / "d").exists()


def test_metadata_json_has_no_type_for_is_written_as_text(tmp_path):
    entries = list(rg.create_dataset("gsm_symbolic", seed=3, size=100))
    assert any("Fraction" in json.dumps(e, default=lambda v: type(v).__name__) for e in entries)  # json.dumps raises
    rows = load(write(tmp_path, "gsm_symbolic", size=100, eval_size=5), "train")
    answers = [f"<answer>{json.loads(r['entry'])['answer']}</answer>" for r in rows]
    assert rg_example.score(None, answers, entry=[r["entry"] for r in rows]) == [1.0] * 100


# ---- the reward ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
def test_reward_agrees_with_the_tasks_scorer(tmp_path, task):
    rows = load(write(tmp_path, task), "test")
    entries = [json.loads(r["entry"]) for r in rows]
    scorer = rg.get_score_answer_fn(task)
    prompts, columns = [r["prompt"] for r in rows], {"entry": [r["entry"] for r in rows]}
    right = [f"Two and two.\n<answer>{e['answer']}</answer>" for e in entries]
    wrong = [f"<answer>{int(e['answer']) + 1}</answer>" for e in entries]  # n + 1 never holds n as a substring
    missing = [f"The answer is {e['answer']}." for e in entries]
    for completions, expected in ((right, 1.0), (wrong, 0.0), (missing, 0.0)):
        got = rg_example.score(prompts, completions, completion_ids=[[1]] * len(rows), **columns)
        by_scorer = [scorer(rg_example.final_answer(c), e) for c, e in zip(completions, entries)]
        assert got == by_scorer == [expected] * len(rows)
        chat = [[{"role": "assistant", "content": c}] for c in completions]  # as the scripts pass chat completions
        assert rg_example.score(prompts, chat, **columns) == got


def test_integer_answers_are_compared_as_numbers_by_math_verify():
    entry = rg.create_dataset("leg_counting", seed=1, size=1)[0]
    assert entry["answer"] == "292"
    scorer, row = rg.get_score_answer_fn("leg_counting"), [json.dumps(entry)]
    for text in ["292 legs", "\\boxed{292}", "292.0", "$292$"]:
        assert scorer(text, entry) < 1.0
        assert rg_example.score(None, [f"<answer>{text}</answer>"], entry=row) == [1.0]
    # the generic scorer's substring credit pays a wrong number that holds the right one; the reward does not
    assert scorer("2920", entry) == 0.75
    assert rg_example.score(None, ["<answer>2920</answer>", "<answer>29 2</answer>"], entry=row * 2) == [0.0, 0.0]


def test_other_answers_keep_the_tasks_own_scorer():
    for task in ["gsm_symbolic", "fraction_simplification", "prime_factorization"]:
        entry = rg.create_dataset(task, seed=2, size=1)[0]
        scorer, row = rg.get_score_answer_fn(task), [json.dumps(entry)]
        answers = [entry["answer"], "12", "abc", "1/2"]
        got = rg_example.score(None, [f"<answer>{a}</answer>" for a in answers], entry=row * 4)
        expected = []
        for a in answers:
            try:
                expected.append(scorer(a, entry))
            except ValueError:  # prime_factorization's scorer raises on text it cannot read: the reward gives 0
                expected.append(0.0)
        assert got == expected and got[0] == 1.0 and all(0.0 <= g <= 1.0 for g in got)
    # fractions are left to the task: a fraction not in lowest terms is not the answer
    entry = rg.create_dataset("fraction_simplification", seed=2, size=1)[0]
    n, d = map(int, re.findall(r"\d+", entry["answer"]))
    unreduced = f"{2 * n}/{2 * d}"
    got = rg_example.score(None, [f"<answer>{unreduced}</answer>"], entry=[json.dumps(entry)])
    assert got == [rg.get_score_answer_fn("fraction_simplification")(unreduced, entry)] and got[0] < 1.0


def test_an_integer_answers_sign_is_read_and_a_scorer_that_drops_it_is_overruled():
    """'+3', '- 3' and the Unicode minus are signs math-verify did not read; an expression (the question echoed) or
    two numbers are not an answer; gsm_symbolic's own scorer reads -747 as 747 (its regex drops the sign): where
    math-verify reads another number, the task's 1 is no credit."""
    entry = rg.create_dataset("basic_arithmetic", seed=1, size=6, max_terms=2, max_digits=1)[5]
    assert entry["answer"] == "-45"
    config, row = json.dumps({"max_digits": 1, "max_terms": 2}), [json.dumps(entry)]
    texts = ["-45", "- 45", "\u221245", "45", "+45", "-5 * 9", "45 - 90", "-44 or -45", "-45 apples"]
    assert rg_example.score(None, [f"<answer>{t}</answer>" for t in texts], entry=row * 9, config=[config] * 9) == [
        1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]  # the question echoed, or two answers: no number given
    entry = rg.create_dataset("gsm_symbolic", seed=2, size=1)[0]
    assert rg.get_score_answer_fn("gsm_symbolic")(f"-{entry['answer']}", entry) == 1.0  # the task's own scorer
    texts = [f"-{entry['answer']}", f"+{entry['answer']}", str(int(entry["answer"]) + 1)]
    assert rg_example.score(None, [f"<answer>{t}</answer>" for t in texts], entry=[json.dumps(entry)] * 3) == [
        0.0, 1.0, 0.01]


def test_the_scorer_is_built_under_the_written_config(tmp_path):
    """decimal_arithmetic's tolerance is 10^-max_num_decimal_places: under the task's defaults an answer 9e-4 off the
    right one scored 1 on a dataset written with 6 decimal places."""
    config = '{"min_num_decimal_places": 6, "max_num_decimal_places": 6, "precision": 12}'
    rows = load(write(tmp_path, "decimal_arithmetic", "--config", config, size=20, eval_size=5), "test")
    off = [f"<answer>{float(json.loads(r['entry'])['answer']) + 9e-4}</answer>" for r in rows]
    right = [f"<answer>{json.loads(r['entry'])['answer']}</answer>" for r in rows]
    columns = {"entry": [r["entry"] for r in rows], "config": [r["config"] for r in rows]}
    assert rg_example.score(None, off, **columns) == [0.0] * 5 and rg_example.score(None, right, **columns) == [1.0] * 5
    assert rg_example.score(None, off, entry=columns["entry"]) == [1.0] * 5  # no config column: the task's defaults


def test_a_task_whose_entries_carry_no_answer_takes_no_shots(tmp_path):
    """graph_color's entries have answer None (its scorer checks a colouring): a shot would show <answer>None</answer>
    and teach the model to write it."""
    with pytest.raises(SystemExit, match=r"error: --shots 1: .* use --shots 0"):
        write(tmp_path, "graph_color", size=5, eval_size=2)
    rows = load(write(tmp_path, "graph_color", "--shots", "0", size=5, eval_size=2), "train")
    assert all("None" not in m["content"] for r in rows for m in r["prompt"])


def test_prompt_fn_rows_pass_the_scripts_check():
    rng = random.Random(0)
    rows = rloo.check_rows([rg_example.prompt(rng) for _ in range(3)], "examples/reasoning_gym.py:prompt")
    assert len({r["entry"] for r in rows}) == 3
    for r in rows:
        entry = json.loads(r["entry"])
        assert entry["metadata"]["source_dataset"] == rg_example.TASK
        assert r["prompt"][-1] == {"role": "user", "content": entry["question"]}
        assert rg_example.score(None, [f"<answer>{entry['answer']}</answer>"], entry=[r["entry"]]) == [1.0]


def test_header_pins_are_requirements_dev_pins():
    text = (ROOT / "examples" / "reasoning_gym.py").read_text()
    block = re.search(r"^# /// script\n((?:#.*\n)*?)# ///$", text, re.M)
    header = tomllib.loads("".join(line[2:] for line in block.group(1).splitlines(keepends=True)))
    pins = (ROOT / "requirements-dev.txt").read_text().splitlines()
    assert sorted(header["dependencies"]) == ["math-verify==0.9.0", "reasoning-gym==0.1.25"]
    assert set(header["dependencies"]) <= set(pins)


# ---- a tiny run ------------------------------------------------------------------------------------------------------


def test_rloo_trains_on_a_written_dataset_with_the_reward(tmp_path):
    # the built-in model's context is 256 tokens of one character each: short prompts, no system prompt
    folder = write(tmp_path, "basic_arithmetic", "--system-prompt", "none", "--config",
                   '{"max_terms": 2, "max_digits": 1}', size=40, eval_size=8)
    out = tmp_path / "run"
    result = run_script("rloo.py", "--dataset", folder, "--eval-split", "test", "--reward-fn",
                        "examples/reasoning_gym.py:score", "--total-episodes", "16", "--batch-size", "8",
                        "--max-new-tokens", "8", "--eval-every", "1", "--num-eval-prompts", "8", "--output-dir", out,
                        timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "task/accuracy" in r]
    assert [r["iteration"] for r in evals] == [0, 1, 2]
    assert all(0.0 <= r["eval/scores"] <= 1.0 for r in evals)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    test_q = [json.loads(r["entry"])["question"] for r in load(folder, "test")]
    assert [s["prompt"][-1]["content"] for s in samples[:8]] == test_q  # evaluated on the held-out split, in order
