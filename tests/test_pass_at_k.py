"""pass@k evaluation (--eval-num-samples N): the unbiased estimator against hand-computed cases and against counting
every subset, the logged eval/pass@k and eval/maj@N against what samples.jsonl keeps, training left as it is without
the flag (the samples draw from a fork of torch's random stream), two processes, and the bad-value error."""

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


def logged(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return rows, samples


@pytest.mark.parametrize("script", ["ppo.py", "rloo.py"])
def test_logged_pass_at_k_and_majority_follow_the_kept_samples_and_leave_training_as_it_is(script, tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    with_samples, without = tmp_path / "with", tmp_path / "without"
    for run_dir, extra in ((with_samples, ["--eval-num-samples", "5"]), (without, [])):
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
            texts = [x["completion"].strip() for x in s["samples"]]
            counts = {t: texts.count(t) for t in texts}
            top = max(counts.values())
            winners = [i for i, t in enumerate(texts) if counts[t] == top]
            majority.append(r[winners[0]])  # ties: the first seen of the most frequent texts
        assert row["eval/maj@5"] == pytest.approx(sum(majority) / ROWS, abs=1e-9)
        assert 0 < row["eval/pass@1"] < row["eval/pass@2"] < row["eval/pass@4"] < 1
    # the samples vary: at the start (random weights, temperature 1) some prompt's 5 samples are not all alike
    assert any(len({x["completion"] for x in s["samples"]}) > 1 for s in samples if s["iteration"] == 0)


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
