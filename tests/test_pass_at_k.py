"""pass@k evaluation (--eval-num-samples N): the unbiased estimator against hand-computed cases and against counting
every subset, maj@N's vote on answers (--answer-fn), the logged eval/pass@k and eval/maj@N against what samples.jsonl
keeps, training left as it is without the flag (the samples draw from a fork of torch's random stream), no maj@N
without an answer function, two processes, and the bad-value error."""

import itertools
import json
import math
import sys

import pytest

import ppo
from conftest import assert_one_line_error, run_main, run_script

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
TINY = ["--total-episodes", "32", "--batch-size", "16", "--eval-every", "1", "--max-new-tokens", "4"]
ROWS = 100  # the built-in task evaluates on all its 100 sums
# right or wrong by the text alone, about half of each: from random weights the built-in reward is almost never 1.0,
# which would leave pass@k and maj@N at 0 whatever they computed
REWARDS = '''
def even_length(prompts, completions, **kwargs):
    return [float(len(c) % 2 == 0) for c in completions]


def first_char(completion):
    return completion[:1] or None
'''


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 1, 1 / 4),  # pass@1 is the fraction right
    (4, 1, 2, 1 - 3 / 6),  # 1 - C(3, 2) / C(4, 2): of the 6 pairs, the 3 without the right one miss
    (4, 1, 4, 1.0),  # all 4 drawn: the right one is among them
    (5, 2, 2, 1 - 3 / 10),  # 1 - C(3, 2) / C(5, 2)
    (8, 3, 4, 1 - 5 / 70),  # 1 - C(5, 4) / C(8, 4)
    (4, 0, 4, 0.0),  # none right
    (4, 4, 1, 1.0),  # all right
])
def test_pass_at_k_equals_hand_computed_cases(n, c, k, expected):
    assert ppo.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_the_share_of_k_subsets_holding_a_right_sample():
    for n in range(1, 8):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                assert ppo.pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets), abs=1e-12)


@pytest.mark.parametrize("answers, right, expected", [
    # six samples answer 57 in their own words, two say "56" word for word: the vote on answers picks 57 (a vote on
    # whole texts picked the two identical wrong ones)
    (["57"] * 6 + ["56"] * 2, [True] * 6 + [False] * 2, True),
    (["56", "57", "57", "56", "56"], [False, True, True, False, False], False),  # the majority is wrong
    (["7", "7", "8", "8"], [False, True, True, False], True),  # a tie: the first seen (7), right in one sample
    ([None, None, "3", None], [True, True, False, True], False),  # no answer does not vote: the one answer is wrong
    ([None, None], [True, True], False),  # no answer found at all
])
def test_majority_votes_on_answers_and_is_right_when_a_sample_giving_it_is_right(answers, right, expected):
    assert ppo.majority_right(answers, right) is expected


def logged(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return rows, samples


@pytest.mark.parametrize("script", ["ppo.py", "rloo.py"])
def test_logged_pass_at_k_and_majority_follow_the_kept_samples_and_leave_training_as_it_is(script, tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    with_samples, without = tmp_path / "with", tmp_path / "without"
    for run_dir, extra in ((with_samples, ["--eval-num-samples", "5", "--answer-fn", "my_rewards:first_char"]),
                           (without, [])):
        result = run_main(script, *TINY, *extra, "--reward-fn", "my_rewards:even_length", "--output-dir", run_dir,
                          cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    rows, samples = logged(with_samples)
    plain_rows, _ = logged(without)
    assert len(rows) == 3  # the evaluation before training and after each of the 2 iterations
    for row, plain in zip(rows, plain_rows):
        assert {"eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/maj@5"} <= row.keys()
        assert not any(key.startswith(("eval/pass@", "eval/maj@")) for key in plain)
        assert "eval/pass@8" not in row and "eval/pass@5" not in row  # k = 1, 2, 4, ... <= N
        # the same training: every metric but the elapsed time and the new ones equal
        same = {k: v for k, v in row.items() if k != "elapsed_s" and not k.startswith(("eval/pass@", "eval/maj@"))}
        assert same == {k: v for k, v in plain.items() if k != "elapsed_s"}
        evals = [s for s in samples if s["iteration"] == row["iteration"]]
        assert len(evals) == ROWS and all(len(s["samples"]) == 5 for s in evals)
        right = [[x["score"] >= 1.0 for x in s["samples"]] for s in evals]
        for k in (1, 2, 4):
            by_subsets = [sum(map(any, itertools.combinations(r, k))) / math.comb(5, k) for r in right]
            assert row[f"eval/pass@{k}"] == pytest.approx(sum(by_subsets) / ROWS, abs=1e-9)
        majority = []
        for s, r in zip(evals, right):
            answers = [x["completion"][:1] or None for x in s["samples"]]
            assert answers == [x["answer"] for x in s["samples"]]
            counts = {a: answers.count(a) for a in answers if a is not None}
            top = max(counts, key=counts.get) if counts else None  # ties: the first seen (dicts keep their order)
            majority.append(any(ri for a, ri in zip(answers, r) if top is not None and a == top))
        assert row["eval/maj@5"] == pytest.approx(sum(majority) / ROWS, abs=1e-9)
        assert 0 < row["eval/pass@1"] < row["eval/pass@2"] < row["eval/pass@4"] < 1
    # the samples vary: at the start (random weights, temperature 1) some prompt's 5 samples are not all alike
    assert any(len({x["completion"] for x in s["samples"]}) > 1 for s in samples if s["iteration"] == 0)


def test_without_an_answer_function_maj_at_n_is_not_logged_and_that_is_said_once(tmp_path):
    """The built-in task brings its own answer (a sum's text); prompts of your own need --answer-fn for the vote."""
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    flags = [*TINY, "--eval-num-samples", "2", "--prompt-fn", "ppo:addition_prompt", "--reward-fn",
             "my_rewards:even_length"]
    result = run_main("rloo.py", *flags, "--output-dir", tmp_path / "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("no --answer-fn, so eval/maj@N is not logged") == 1
    rows, _ = logged(tmp_path / "run")
    assert all("eval/pass@2" in row and "eval/maj@2" not in row for row in rows)
    builtin = run_main("rloo.py", *TINY, "--eval-num-samples", "2", "--output-dir", tmp_path / "builtin")
    assert builtin.returncode == 0 and "no --answer-fn" not in builtin.stdout
    assert all("eval/maj@2" in row for row in logged(tmp_path / "builtin")[0])


def test_two_processes_gather_every_row_with_its_samples(tmp_path):
    run_dir = tmp_path / "run"
    result = run_script("rloo.py", *TINY, "--eval-num-samples", "2", "--output-dir", run_dir, launcher=TORCHRUN)
    assert result.returncode == 0, result.stderr[-3000:]
    rows, samples = logged(run_dir)
    final = [s for s in samples if s["iteration"] == rows[-1]["iteration"]]
    assert [s["prompt"] for s in final] == [r["prompt"] for r in ppo.addition_eval_rows()]  # the rows' order
    right = [sum(x["score"] >= 1.0 for x in s["samples"]) for s in final]
    assert rows[-1]["eval/pass@1"] == pytest.approx(sum(right) / (2 * ROWS), abs=1e-9)
    assert rows[-1]["eval/pass@2"] == pytest.approx(sum(c > 0 for c in right) / ROWS, abs=1e-9)


def test_a_negative_number_of_samples_is_refused():
    assert_one_line_error(run_main("ppo.py", "--eval-num-samples", "-1"), "--eval-num-samples", "-1")
