"""interleave.py's one-line errors name its own flags: an error that ppo.py's or stepwise_prm.py's helpers raise as
--reward-fn or --dataset reads --rloo.reward-fn or --sft.dataset here, whether it comes from the checks before
loading, from loading a phase's data, or from a reward function called during the run."""

import pytest

from conftest import assert_one_line_error, run_main

TINY = ["--total-steps", "2", "--eval-every", "2", "--sft.batch-size", "8", "--rloo.batch-size", "8",
        "--ppo.batch-size", "8", "--prm.batch-size", "8"]
RAISES = '''
def score(prompts, completions, **kwargs):
    """A reward function with a bug."""
    raise KeyError("answer")
'''


@pytest.mark.parametrize("args, flag, words", [
    # the checks before anything loads (ppo.check_task)
    (["--phases", "ppo", "--ppo.prompt-fn", "ppo:addition_prompt"], "--ppo.reward-fn",
     ["need a reward", "give --ppo.reward-fn and/or --ppo.reward-model"]),
    (["--rloo.reward-fn", "ppo:addition_reward", "--rloo.reward-weights", "1", "2"], "--rloo.reward-weights",
     ["one weight per --rloo.reward-fn"]),
    # loading a phase's data (ppo.load_task, ppo.load_prompt_dataset, stepwise_prm.load_stepwise)
    (["--rloo.reward-fn", "no_such_module:score"], "--rloo.reward-fn", ["cannot import no_such_module"]),
    (["--sft.dataset", "demos.txt"], "--sft.dataset", ["unknown file type"]),
    (["--phases", "prm", "--prm.dataset", "steps.txt"], "--prm.dataset", ["unknown file type"]),
    # a reward function that raises, first called by the evaluation before step 1
    (["--rloo.reward-fn", "raises.py:score"], "--rloo.reward-fn", ["raised KeyError", "fix the function"]),
])
def test_errors_name_the_phase_flags(args, flag, words, tmp_path):
    (tmp_path / "demos.txt").write_text("not a table\n")
    (tmp_path / "steps.txt").write_text("not a table\n")
    (tmp_path / "raises.py").write_text(RAISES)
    result = run_main("interleave.py", *TINY, *args, "--output-dir", tmp_path / "run", cwd=tmp_path)
    line = assert_one_line_error(result, flag, *words)
    assert " --reward" not in line and " --dataset" not in line, line  # no unprefixed flag left in the fix either


def test_only_the_task_flags_are_renamed():
    """The flags of TaskArgs get the phase's prefix; the shared ones (--max-new-tokens, --model) stay as they are,
    and a longer flag is not mistaken for a shorter one that starts it (--dataset-split, --reward-model-weight)."""
    import interleave

    with pytest.raises(SystemExit) as e, interleave.phase_flags("rloo"):
        raise SystemExit("error: --dataset 'p.jsonl': too long with --max-new-tokens for --model; check "
                         "--dataset-split/--eval-split, --reward-model-weight")
    assert str(e.value) == ("error: --rloo.dataset 'p.jsonl': too long with --max-new-tokens for --model; check "
                            "--rloo.dataset-split/--rloo.eval-split, --rloo.reward-model-weight")
