"""interleave.py's checks and its PRM phase's NaN guard, a reward with no prompt source
(it scores the built-in task's prompts), and metrics combined over processes (counts summed, means averaged)."""

import json
import sys
import textwrap

import pytest

from conftest import assert_one_line_error, run_main, run_script

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
RL_TINY = ["--total-episodes", "32", "--batch-size", "16", "--num-mini-batches", "2", "--num-ppo-epochs", "2",
           "--eval-every", "1"]
INTERLEAVE_TINY = ["--total-steps", "2", "--eval-every", "2", "--sft.batch-size", "8", "--rloo.batch-size", "8",
                   "--prm.batch-size", "8"]
NOTE = "note: no --dataset or --prompt-fn"

REWARD = textwrap.dedent('''
    def score(prompts, completions, answer, **kwargs):
        """Checks that the rows are the built-in task's ('3+4=' with its answer), then scores as the README's does."""
        for p, a in zip(prompts, answer):
            x, y = p[:-1].split("+")
            assert p.endswith("=") and int(x) + int(y) == int(a), (p, a)
        return [1.0 if c.strip() == a else 0.5 * sum(u == v for u, v in zip(c.strip(), a)) / len(a)
                for c, a in zip(completions, answer)]
''')

COMBINE = textwrap.dedent('''
    import os
    import sys

    import torch

    import ppo
    import rloo
    import stepwise_prm

    rank, world, device = ppo.setup_distributed()
    metrics = {"val/num_eos_tokens": float(rank + 1), "objective/scores": float(rank + 1),
               "loss/nonfinite_skipped": 1.0, "sampling/importance_sampling_ratio/min": 0.5 + rank / 4,
               "sampling/importance_sampling_ratio/max": 1.5 + rank / 4}
    for module in (ppo, rloo, stepwise_prm):
        out = module.average_metrics(metrics, device, counts=("val/num_eos_tokens",))
        assert out == {"val/num_eos_tokens": 3.0, "objective/scores": 1.5, "loss/nonfinite_skipped": 1.0,
                       "sampling/importance_sampling_ratio/min": 0.5,
                       "sampling/importance_sampling_ratio/max": 1.75}, out
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    print(f"rank {rank} combined", flush=True)
    os._exit(0)
''')


def rows_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---- item 11: a reward with no prompt source trains on the built-in task's prompts ----------------------------------


@pytest.mark.parametrize("script, reward", [("ppo.py", "fn"), ("rloo.py", "fn"), ("rloo.py", "prm")])
def test_a_reward_without_prompts_scores_the_builtin_prompts(script, reward, tmp_path, tiny_prm_dir):
    (tmp_path / "my_rewards.py").write_text(REWARD)
    flags = ["--reward-fn", "my_rewards.py:score"] if reward == "fn" else ["--prm-model", str(tiny_prm_dir)]
    result = run_main(script, *RL_TINY, *flags, "--output-dir", tmp_path / "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(NOTE) == 1, result.stdout[-2000:]
    rows = rows_of(tmp_path / "run")
    assert rows[-1]["episode"] == 32 and "task/accuracy" in rows[-1]


# ---- item 7: interleave.py's checks, and a NaN in the PRM phase -----------------------------------------------------


@pytest.mark.parametrize("args, world, flag, words", [
    (["--rloo.batch-size", "8", "--rloo.rloo-k", "4"], "4", "--rloo.batch-size", ["4 process(es)", "whole groups"]),
    (["--sft.batch-size", "8"], "3", "--sft.batch-size", ["divisible by 3 process(es)"]),
    (["--sft.batch-size", "0"], "1", "--sft.batch-size", ["positive"]),
    (["--rloo.max-steps", "-1"], "1", "--rloo.max-steps", ["positive, or 0"]),
])
def test_interleave_checks_name_the_right_flag(args, world, flag, words, tmp_path):
    """WORLD_SIZE as torchrun sets it: the check runs before the process group exists, so no group is needed here."""
    result = run_main("interleave.py", *INTERLEAVE_TINY, *args, "--output-dir", tmp_path, env={"WORLD_SIZE": world})
    assert_one_line_error(result, flag, *words)


def test_interleave_prm_phase_nan_stops_with_one_line_or_is_skipped(tmp_path):
    """A NaN learning rate turns the PRM's weights into NaN at step 1, so step 2's loss is NaN."""
    args = ["--phases", "prm", "--total-steps", "2", "--eval-every", "2", "--prm.batch-size", "8",
            "--prm.learning-rate", "nan"]
    line = assert_one_line_error(run_main("interleave.py", *args, "--output-dir", tmp_path / "stop"),
                                 "--prm.skip-nonfinite", "at step 2")
    assert "NaN" in line or "nan" in line, line
    result = run_main("interleave.py", *args, "--prm.skip-nonfinite", "--output-dir", tmp_path / "skip")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = rows_of(tmp_path / "skip")
    assert [r["prm/train/nonfinite_skipped"] for r in rows[1:]] == [0.0, 1.0]


# ---- item 14: counts summed over processes, means averaged ----------------------------------------------------------


def test_average_metrics_sums_counts_and_averages_means_over_two_processes(tmp_path):
    """Counts summed, means averaged, and keys ending in /min and /max their minimum and maximum."""
    (tmp_path / "combine.py").write_text(COMBINE)
    result = run_script(str(tmp_path / "combine.py"), launcher=TORCHRUN, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 combined" in result.stdout and "rank 1 combined" in result.stdout, result.stdout


def test_interleave_counts_are_of_the_global_batch_under_torchrun(tmp_path):
    """The PRM batch is the same global batch at 1 and 2 processes, so its token count must be the same; the RLOO
    phase, with a reward and no prompts, says once (rank 0) that it scores the built-in prompts."""
    (tmp_path / "my_rewards.py").write_text(REWARD)
    args = [*INTERLEAVE_TINY, "--phases", "rloo", "prm", "--rloo.reward-fn", "my_rewards.py:score"]
    one = run_script("interleave.py", *args, "--output-dir", tmp_path / "one", cwd=tmp_path)
    two = run_script("interleave.py", *args, "--output-dir", tmp_path / "two", cwd=tmp_path, launcher=TORCHRUN)
    for result in (one, two):
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.count(NOTE) == 1, result.stdout[-2000:]
    rows = {n: {r["phase"]: r for r in rows_of(tmp_path / n)} for n in ("one", "two")}
    assert rows["two"]["prm"]["prm/train/tokens"] == rows["one"]["prm"]["prm/train/tokens"] > 0
    eos = rows["two"]["rloo"]["rloo/val/num_eos_tokens"]
    assert eos == int(eos) and 0 <= eos <= 8  # a count of the 8 responses, not a mean per process
