"""DAPO's dynamic sampling in rloo.py (--dynamic-sampling): groups whose k rewards are all equal are set aside and
more prompts are drawn, in rounds, until the batch is full of groups with signal or --max-sampling-rounds ran out
(then set-aside groups fill it); the prompt stream moves by every round, a resumed run equals one left alone, and
two processes draw in step."""

import json
import shutil
import sys

import pytest
import torch

import rloo
from conftest import run_main, run_script

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
REWARDS = '''
def half_flat(prompts, completions, **kwargs):
    """0 for every response to a prompt whose first digit is even (no signal), else the text's character sum mod 7."""
    return [0.0 if int(p.split("+")[0]) % 2 == 0 else float(sum(map(ord, c)) % 7) for p, c in zip(prompts, completions)]


def flat(prompts, completions, **kwargs):
    return [0.0 for _ in prompts]
'''
TINY = ["--total-episodes", "64", "--batch-size", "16", "--eval-every", "100", "--num-eval-prompts", "4",
        "--max-new-tokens", "6", "--dynamic-sampling", "--max-sampling-rounds", "3"]


@pytest.fixture
def rewards_dir(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def rows_of(run_dir):
    return [r for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "lr" in (r := json.loads(line))]


def test_stacked_groups_are_padded_as_the_rollout_pads_them():
    pad = 0
    a = {"queries": torch.tensor([[5, 6], [5, 6]]), "responses": torch.tensor([[7, 2], [8, 9]]),
         "masks": torch.tensor([[1, 1], [1, 1]]), "rewards": torch.tensor([1.0, 0.0]), "ended": torch.tensor([1, 0])}
    b = {"queries": torch.tensor([[4], [4]]), "responses": torch.tensor([[3, 3, 2], [3, 2, 0]]),
         "masks": torch.tensor([[1, 1, 1], [1, 1, 0]]), "rewards": torch.tensor([0.5, 0.5]),
         "ended": torch.tensor([1, 1])}
    batch = rloo.stack_groups([a, b], pad)
    assert torch.equal(batch["queries"], torch.tensor([[5, 6], [5, 6], [pad, 4], [pad, 4]]))  # left-padded
    assert torch.equal(batch["responses"], torch.tensor([[7, 2, pad], [8, 9, pad], [3, 3, 2], [3, 2, 0]]))
    assert torch.equal(batch["masks"], torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 0]]))
    assert torch.equal(batch["rewards"], torch.tensor([1.0, 0.0, 0.5, 0.5]))
    assert torch.equal(rloo.stack_groups([a], pad)["responses"], a["responses"])  # one round: the rollout itself


def test_groups_with_signal_fill_the_batch_in_rounds(rewards_dir):
    run = rewards_dir / "run"
    result = run_main("rloo.py", *TINY, "--reward-fn", "my_rewards:half_flat", "--output-dir", run, cwd=rewards_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = rows_of(run)
    assert len(rows) == 4 and rows[-1]["episode"] == 64  # episodes count the trained responses
    assert all(1 <= r["sampling/rounds"] <= 3 for r in rows) and any(r["sampling/rounds"] > 1 for r in rows)
    assert any(r["sampling/rounds"] < 3 for r in rows)  # so the check below is made
    for r in rows:  # a batch filled before the rounds ran out holds no group without signal
        if r["sampling/rounds"] < 3:
            assert r["rloo/frac_equal_groups"] == 0.0, r
    assert 0 < sum(r["sampling/equal_frac"] for r in rows) / len(rows) < 1


def test_without_signal_the_rounds_run_out_and_the_stream_moves_by_each(rewards_dir):
    run = rewards_dir / "run"
    result = run_main("rloo.py", *TINY, "--reward-fn", "my_rewards:flat", "--dataset", rewards_dir / "sums.jsonl",
                      "--save-every", "1", "--output-dir", run, cwd=rewards_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = rows_of(run)
    assert all(r["sampling/rounds"] == 3 and r["sampling/equal_frac"] == 1.0 for r in rows)
    assert all(r["rloo/frac_equal_groups"] == 1.0 for r in rows)  # trained on what it has, and says so
    state = torch.load(run / "checkpoints" / "iter_000004" / "state.pt", weights_only=False)
    assert state["prompt_state"]["epoch"] == 0 and state["prompt_state"]["pos"] == 4 * 3 * 16 // 4  # 3 rounds of 4


def test_dynamic_sampling_resumes_exactly(rewards_dir):
    full, resumed = rewards_dir / "full", rewards_dir / "resumed"
    args = [*TINY, "--reward-fn", "my_rewards:half_flat", "--save-every", "2", "--keep-checkpoints", "0"]
    result = run_main("rloo.py", *args, "--output-dir", full, cwd=rewards_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "iter_000002", resumed / "checkpoints" / "iter_000002")
    lines = (full / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("".join(line + "\n" for line in lines[:3]))  # iterations 0, 1, 2
    shutil.copy(full / "samples.jsonl", resumed / "samples.jsonl")
    result = run_script("rloo.py", *args, "--output-dir", resumed, "--resume", "latest", cwd=rewards_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    strip = lambda rows: [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rows]  # noqa: E731
    assert strip(rows_of(resumed)) == strip(rows_of(full))
    assert any(r["sampling/rounds"] > 1 for r in rows_of(full)[2:])  # the resumed part drew in rounds


@pytest.mark.parametrize("fsdp", [[], ["--fsdp"]])
def test_two_processes_draw_in_step(fsdp, rewards_dir):
    run = rewards_dir / "run"
    result = run_script("rloo.py", *TINY, *fsdp, "--reward-fn", "my_rewards:half_flat", "--output-dir", run,
                        cwd=rewards_dir, launcher=TORCHRUN)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = rows_of(run)
    assert len(rows) == 4 and all(1 <= r["sampling/rounds"] <= 3 for r in rows)
    assert any(r["sampling/rounds"] > 1 for r in rows) and any(r["sampling/rounds"] < 3 for r in rows)
    for r in rows:  # each process filled its own share, or the rounds ran out for all
        if r["sampling/rounds"] < 3:
            assert r["rloo/frac_equal_groups"] == 0.0, r
