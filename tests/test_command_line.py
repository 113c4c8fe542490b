"""What a newcomer meets first: --help names the named configurations and the flags most runs set, a configuration
is taken before or after the flags and a misspelt one is one line, the run folder is said at the start, a reward that
never varies is said once, and a reward function with the wrong signature is told the right one."""

import json

import pytest

import interleave
import rloo
from conftest import run_main

SHORT = ["--total-episodes", "64", "--batch-size", "16", "--eval-every", "100"]


def test_help_names_every_configuration_and_the_common_flags():
    text = run_main("rloo.py", "--help").stdout
    head = text[:text.index("--exp-name")]  # before the full list of flags
    for name, (description, _) in rloo.RECIPES.items():
        assert f"{name}: {description}" in head
    for flag in ("--model", "--dataset", "--prompt-fn", "--reward-fn", "--total-episodes", "--output-dir"):
        assert flag in head
    assert "2560 are 10" in head  # a short run, worked out: 10 iterations of the default batch
    text = run_main("interleave.py", "--help").stdout
    assert all(f"{name}: {description}" in text for name, (description, _) in interleave.RECIPES.items())
    assert "--total-episodes" in run_main("ppo.py", "--help").stdout.split("--exp-name")[0]


CONFIGS = {name: (text, rloo.named_config(name)) for name, (text, _) in rloo.RECIPES.items()}


def test_a_misspelt_configuration_is_one_line_naming_the_closest_and_all():
    result = run_main("rloo.py", "--seed", "2", "gpro")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"error: the named configuration 'gpro': did you mean gspo or grpo? name one of {', '.join(rloo.RECIPES)}, "
        "before or after the flags"]
    with pytest.raises(SystemExit, match="error: the named configuration 'GRPO': did you mean grpo\\? name one of"):
        rloo.parse_args(rloo.Args, CONFIGS, ["GRPO"], "")
    with pytest.raises(SystemExit, match="'sft-then-r': did you mean sft-then-rl\\? name one of interleaved, "):
        rloo.parse_args(interleave.Args, interleave.RECIPES, ["sft-then-r"], "")
    with pytest.raises(SystemExit, match="error: the named configuration 'dapo': name one of rloo, "):
        rloo.parse_args(rloo.Args, CONFIGS, ["grpo", "dapo"], "")


def test_a_configuration_stands_anywhere_and_a_name_that_is_a_flag_value_is_not_one():
    args = rloo.parse_args(rloo.Args, CONFIGS, ["--rloo-k", "2", "grpo", "--seed", "3"], "")
    assert args.exp_name == "grpo" and args.rloo.loss_type == "grpo" and args.rloo.rloo_k == 2 and args.seed == 3
    args = rloo.parse_args(rloo.Args, CONFIGS, ["--exp-name", "grpo"], "")
    assert args.exp_name == "grpo" and args.rloo.loss_type == "dapo"  # a value, not the configuration
    args = rloo.parse_args(rloo.Args, CONFIGS, ["--loss-type", "dapo", "--rloo-k", "8", "dapo"], "")
    assert args.exp_name == "dapo" and args.dynamic_sampling and args.rloo.rloo_k == 8
    args = rloo.parse_args(interleave.Args, interleave.RECIPES, ["--schedule", "weighted", "--seed", "3", "weighted"],
                           "")
    assert args.schedule == "weighted" and args.rloo.turn.weight == 2.0 and args.seed == 3
    for argv in (["--reward-fn", "f.py:g", "grpo"], ["--stop-strings", "x", "grpo", "--seed", "2"]):  # list flags
        with pytest.raises(SystemExit, match=f"'grpo': {argv[0]} took it as one of its items; name the configuration "
                                             "before the flags"):
            rloo.parse_args(rloo.Args, CONFIGS, argv, "")
    args = rloo.parse_args(rloo.Args, CONFIGS, ["grpo", "--reward-fn", "f.py:g"], "")
    assert args.exp_name == "grpo" and args.task.reward_fn == ["f.py:g"]
    args = rloo.parse_args(rloo.Args, CONFIGS, ["grpo", "--stop-strings", "x", "grpo"], "")  # named first: an item
    assert args.exp_name == "grpo" and args.gen.stop_strings == ["x", "grpo"]


REWARDS = """
def score_yes(prompts, completions, **kwargs):
    return [1.0 if "yes" in c else 0.0 for c in completions]


def score_length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def score_answer(prompts, completions, answer, **kwargs):
    return [float(a) for a in answer]
"""


def test_the_run_folder_first_and_a_reward_that_never_varies_said_once(tmp_path):
    """The built-in model writes digits and +-*= only: a reward for 'yes' is 0 for every completion. The
    configuration after the flags is the run's. A reward of the prompt alone never varies within a group."""
    (tmp_path / "rewards.py").write_text(REWARDS)
    result = run_main("rloo.py", *SHORT, "--reward-fn", f"{tmp_path / 'rewards.py'}:score_yes", "--output-dir",
                      tmp_path / "run", "grpo", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("warning: the rewards of 3 iterations never varied (the last's all 0): nothing to "
                               "learn from; check that the reward can score what the model writes (the built-in "
                               "model writes digits and +-*= only)") == 1
    assert result.stdout.index(f"run folder: {tmp_path / 'run'}") < result.stdout.index("iteration 0")
    assert json.loads((tmp_path / "run" / "config.json").read_text())["exp_name"] == "grpo"
    result = run_main("ppo.py", *SHORT, "--reward-fn", f"{tmp_path / 'rewards.py'}:score_length", "--output-dir",
                      tmp_path / "varies", cwd=tmp_path)
    assert result.returncode == 0 and "never varied" not in result.stdout
    assert result.stdout.index(f"run folder: {tmp_path / 'varies'}") < result.stdout.index("iteration 0")
    result = run_main("rloo.py", *SHORT, "--reward-fn", f"{tmp_path / 'rewards.py'}:score_answer", "--output-dir",
                      tmp_path / "prompt-only", cwd=tmp_path)  # varies over prompts, never within a group: no signal
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("warning: the rewards of 3 iterations never varied (the last's equal within each "
                               "group): nothing to learn from") == 1


def test_a_reward_with_the_wrong_signature_is_told_the_right_one(tmp_path):
    (tmp_path / "bad.py").write_text("def score(prompts):\n    return [0.0] * len(prompts)\n")
    result = run_main("rloo.py", *SHORT, "--reward-fn", f"{tmp_path / 'bad.py'}:score", "--output-dir", tmp_path)
    assert result.returncode != 0
    assert "(called as fn(prompts=, completions=, completion_ids=, **columns)" in result.stderr.strip().splitlines()[-1]
