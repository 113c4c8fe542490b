"""ppo.py and rloo.py run as a user runs them: subprocesses with tiny settings, and every bad-input case. The two
scripts share their interfaces, so each test runs on both."""

import json
import shutil
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import assert_one_line_error, run_main, run_script

SCRIPTS = ["ppo.py", "rloo.py"]
TINY = ["--total-episodes", "32", "--batch-size", "16", "--num-mini-batches", "2", "--eval-every", "1",
        "--num-ppo-epochs", "2"]

REWARDS = textwrap.dedent('''
    import math

    def uses_answer(prompts, completions, answer, completion_ids, **kwargs):
        """Reads the dataset's 'answer' column; chat prompts arrive as message lists, as in TRL."""
        assert isinstance(prompts[0], list) and prompts[0][0]["role"] == "user", prompts[0]
        assert isinstance(completions[0], list) and completions[0][0]["role"] == "assistant", completions[0]
        assert len(answer) == len(completions) == len(completion_ids)
        return [float(c[0]["content"].startswith(a)) for c, a in zip(completions, answer)]

    def length(prompts, completions, **kwargs):
        return [-0.1 * len(c) for c in completions]

    def stop_check(prompts, completions, **kwargs):
        for c in completions:
            assert "+" not in c or c.endswith("+") and c.count("+") == 1, repr(c)
        return [float(c.endswith("+")) for c in completions]

    def raises(prompts, completions, **kwargs):
        raise KeyError("no such column")

    def wrong_count(prompts, completions, **kwargs):
        return [1.0]

    def nan(prompts, completions, **kwargs):
        return [math.nan] * len(completions)

    def inf(prompts, completions, **kwargs):
        return [math.inf] * len(completions)

    def none(prompts, completions, **kwargs):
        return [None] * len(completions)
''')

PROMPTS = textwrap.dedent('''
    def digits(rng):
        a = rng.randrange(10)
        return {"prompt": f"{a}=", "answer": str(a)}

    def not_a_row(rng):
        return "3+4="

    def too_long(rng):
        return {"prompt": "1+" * 200 + "1="}

    def exact(prompts, completions, answer, **kwargs):
        return [float(c == a) for c, a in zip(completions, answer)]
''')


@pytest.fixture
def user_files(tmp_path: Path) -> Path:
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    (tmp_path / "my_prompts.py").write_text(PROMPTS)
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
            for a in range(5) for b in range(4)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "no_prompt.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": "1+" * 200 + "1="}) + "\n")
    return tmp_path


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("script", SCRIPTS)
def test_default_task_with_tiny_settings(script, tmp_path):
    result = run_script(script, *TINY, "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows[-1]["episode"] == 32 and 0.0 <= rows[-1]["task/accuracy"] <= 1.0
    assert {"objective/kl", "objective/scores", "loss/policy_avg", "lr", "elapsed_s"} <= set(rows[-1])
    assert json.loads((tmp_path / "run" / "config.json").read_text())["batch_size"] == 16
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
    assert model.config.model_type == "llama"
    assert "final task/accuracy" in result.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_evaluation_writes_its_completions_and_prints_three(script, tmp_path, tiny_model_dir, user_files):
    """samples.jsonl holds every evaluation completion (iteration, prompt, completion, score); each evaluation prints
    three of them, without wandb. A chat prompt stays a message list; the scores are the reward's."""
    result = run_main(script, "--model", tiny_model_dir, "--dataset", user_files / "chat.jsonl", "--reward-fn",
                      f"{user_files / 'my_rewards.py'}:length", "--num-eval-prompts", "6", "--max-new-tokens", "4",
                      *TINY, "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [s["iteration"] for s in samples] == [0] * 6 + [1] * 6 + [2] * 6
    assert [s["prompt"] for s in samples[:6]] == [[{"role": "user", "content": f"0+{b}="}] for b in range(4)] + [
        [{"role": "user", "content": f"1+{b}="}] for b in range(2)]
    assert all(s["score"] == pytest.approx(-0.1) for s in samples)  # `length` of a chat completion: one message
    for iteration in (0, 1, 2):
        assert f"iteration {iteration}: 6 evaluation completions in samples.jsonl, first 3:" in result.stdout
    block = result.stdout.split("iteration 2: 6 evaluation completions in samples.jsonl, first 3:\n")[1]
    first = samples[12]
    assert block.splitlines()[0] == f"  score {first['score']:+.3f} | '0+0=' -> {first['completion']!r}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_model_folder_chat_dataset_and_reward_file_reading_a_column(script, tmp_path, tiny_model_dir, user_files):
    rewards = user_files / "my_rewards.py"
    result = run_main(script, "--model", tiny_model_dir, "--dataset", user_files / "chat.jsonl",
                      "--reward-fn", f"{rewards}:uses_answer", f"{rewards}:length",
                      "--reward-weights", "1.0", "0.5", "--max-new-tokens", "4", "--learning-rate", "1e-3", *TINY,
                      "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["episode"] == 32 and "eval/scores" in rows[-1]
    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")


@pytest.mark.parametrize("script", SCRIPTS)
def test_prompt_fn_module_and_stop_strings(script, tmp_path, user_files):
    result = run_main(script, "--prompt-fn", "my_prompts:digits", "--reward-fn", "my_rewards:stop_check",
                      "--stop-strings", "+", "--max-new-tokens", "12", *TINY, "--output-dir", tmp_path / "run",
                      cwd=user_files)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["episode"] == 32
    assert any(r.get("objective/scores", 0) > 0 for r in rows)  # some responses did stop on "+"


@pytest.mark.parametrize("script", SCRIPTS)
def test_wandb_offline(script, tmp_path):
    result = run_script(script, *TINY, "--track", "--output-dir", tmp_path / "run",
                        env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_save_then_resume_gives_the_same_run(script, tmp_path):
    full = tmp_path / "full"
    args = [*TINY, "--total-episodes", "64", "--save-every", "2", "--keep-checkpoints", "0"]
    result = run_main(script, *args, "--output-dir", full)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == ["iter_000002", "iter_000004"]
    # a second run folder holding what the first had after iteration 2: the checkpoint and the metrics rows so far
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "iter_000002", resumed / "checkpoints" / "iter_000002")
    (resumed / "metrics.jsonl").write_text("".join(line + "\n" for line in
                                                   (full / "metrics.jsonl").read_text().splitlines()[:5]))
    # and samples.jsonl as a crash after iteration 3 leaves it: the resumed run cuts the rows after iteration 2
    shutil.copy(full / "samples.jsonl", resumed / "samples.jsonl")
    result = run_script(script, *args, "--output-dir", resumed, "--resume", "latest")
    assert result.returncode == 0, result.stderr[-3000:]
    strip = lambda rows: [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rows]  # noqa: E731
    assert strip(read_metrics(resumed)) == strip(read_metrics(full))
    assert (resumed / "samples.jsonl").read_text() == (full / "samples.jsonl").read_text()
    assert {json.loads(line)["iteration"] for line in (full / "samples.jsonl").read_text().splitlines()} == {
        0, 1, 2, 3, 4}
    a, b = load_file(full / "model" / "model.safetensors"), load_file(resumed / "model" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---- bad input: one line that names the flag, the value and the fix; exit code != 0; no traceback --------------------


@pytest.mark.parametrize("args, flag, words", [
    (["--prompt-fn", "my_prompts:digits", "--reward-fn", "no_such_module:score"], "--reward-fn", ["cannot import"]),
    (["--prompt-fn", "my_prompts:digits", "--reward-fn", "my-rewards:score"], "--reward-fn", ["not a module name"]),
    (["--prompt-fn", "my_prompts:digits", "--reward-fn", "my_rewards:nope"], "--reward-fn", ["has no function nope"]),
    (["--prompt-fn", "my_prompts:digits", "--reward-fn", "missing.py:score"], "--reward-fn", ["no file"]),
    (["--prompt-fn", "my_prompts:digits", "--reward-fn", "my_rewards:raises"], "--reward-fn", ["raised KeyError"]),
    (["--prompt-fn", "my_prompts:digits", "--reward-fn", "my_rewards:wrong_count"], "--reward-fn",
     ["returned 1 scores"]),
    (["--prompt-fn", "my_prompts:digits", "--reward-fn", "my_rewards:nan"], "--reward-fn", ["nan"]),
    (["--prompt-fn", "my_prompts:digits", "--reward-fn", "my_rewards:inf"], "--reward-fn", ["inf"]),
    (["--prompt-fn", "my_prompts:digits", "--reward-fn", "my_rewards:none"], "--reward-fn", ["None"]),
    (["--prompt-fn", "my_prompts:not_a_row", "--reward-fn", "my_prompts:exact"], "--prompt-fn", ["'prompt' key"]),
    (["--dataset", "chat.jsonl", "--prompt-fn", "my_prompts:digits", "--reward-fn", "my_prompts:exact"],
     "--prompt-fn", ["not both"]),
    (["--dataset", "chat.jsonl", "--prompt-fn", "my_prompts:digits", "--reward-fn", "my_prompts:exact",
      "--max-new-tokens", "8"], "--prompt-fn", ["not both"]),  # checked with --max-new-tokens given too
    (["--prompt-fn", "my_prompts:digits"], "--reward-fn", ["need a reward"]),
    (["--dataset", "chat.jsonl"], "--reward-fn", ["need a reward"]),
    (["--dataset", "no_prompt.jsonl", "--reward-fn", "my_prompts:exact"], "--prompt-column",
     ["['question', 'answer']"]),
    (["--model", "no/such-model-folder"], "--model", ["no/such-model-folder"]),
    (["--batch-size", "30", "--num-mini-batches", "4"], "--batch-size", ["divisible"]),
    (["--num-mini-batches", "0"], "--num-mini-batches", ["at least 1"]),  # not a division by zero
    (["--num-ppo-epochs", "0"], "--num-ppo-epochs", ["at least 1"]),  # not a run that trains nothing
    (["--sampler-correction-cap", "0"], "--sampler-correction-cap", ["> 0"]),  # nor a policy loss of 0
    (["--max-grad-norm", "0"], "--max-grad-norm", ["> 0"]),  # nor gradients clipped to 0
    (["--reward-fn", "my_prompts:exact", "--reward-weights", "1", "2", "--prompt-fn", "my_prompts:digits"],
     "--reward-weights", ["one weight per"]),
    (["--dataset", "long.jsonl", "--reward-fn", "my_prompts:exact"], "--dataset", ["context of 256"]),
    (["--dataset", "chat.jsonl", "--eval-split", "test", "--reward-fn", "my_prompts:exact"], "--dataset",
     ["a single file is the split 'train'"]),
    (["--prompt-fn", "my_prompts:too_long", "--reward-fn", "my_prompts:exact"], "--max-new-tokens", ["context of 256"]),
    (["--resume", "no_such_checkpoint"], "--resume", ["not a checkpoint folder"]),
])
@pytest.mark.parametrize("script", SCRIPTS)
def test_bad_input_is_one_line(script, args, flag, words, user_files, tmp_path):
    result = run_main(script, *TINY, *args, "--output-dir", tmp_path / "run", cwd=user_files)
    assert_one_line_error(result, flag, *words)


@pytest.mark.parametrize("script, args", [
    ("ppo.py", ["--prompt-fn", "my_prompts:digits", "--reward-fn", "my_rewards:nope"]),
    ("rloo.py", ["--batch-size", "30", "--num-mini-batches", "4"]),
    ("stepwise_prm.py", ["--resume", "no_such_checkpoint"]),
    ("interleave.py", ["--sft.batch-size", "0"]),
])
def test_bad_input_runs_in_a_process_and_in_this_one_alike(script, args, user_files, tmp_path):
    """The bad-input tests call run_main (the script's __main__ block in the test's process); here the same input
    stops a real `python <script>` process with the same exit code and the same one-line error."""
    alone = run_script(script, *args, "--output-dir", tmp_path / "a", cwd=user_files)
    here = run_main(script, *args, "--output-dir", tmp_path / "b", cwd=user_files)
    assert alone.returncode == here.returncode == 1
    assert alone.stderr.strip().splitlines()[-1] == here.stderr.strip().splitlines()[-1].replace("/b", "/a")
    assert "Traceback" not in alone.stderr + here.stderr


@pytest.mark.parametrize("script", [*SCRIPTS, "stepwise_prm.py", "interleave.py"])
def test_a_new_run_into_a_folder_holding_another_run_is_refused(script, tmp_path):
    """A new run in another run's folder pruned its own checkpoints among the old run's (keeping the old ones, of
    higher iterations), and a later --resume latest took the old run's: refused, with the way to go on. A finished
    run without checkpoints lost its metrics and model to the new one: refused too."""
    (tmp_path / "run" / "checkpoints" / "iter_000004").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "iter_000004" / "state.pt").write_bytes(b"")
    result = run_main(script, "--output-dir", tmp_path / "run")
    assert_one_line_error(result, "--output-dir", "iter_000004", "--resume latest")
    (tmp_path / "done" / "model").mkdir(parents=True)
    (tmp_path / "done" / "metrics.jsonl").write_text('{"iteration": 0}\n')
    result = run_main(script, "--output-dir", tmp_path / "done")
    assert_one_line_error(result, "--output-dir", "metrics.jsonl", "give a new folder")


@pytest.mark.parametrize("script", [*SCRIPTS, "stepwise_prm.py", "interleave.py"])
def test_a_default_run_folder_taken_by_a_run_of_the_same_second_is_not_reused(script, tmp_path):
    """runs/<exp_name>__<seed>__<unix time>: a second run started within the same second took the first's folder (and
    overwrote it); now it takes the next free second's. The runs of the next minute are there: the run goes on past
    the folder (to the model, which fails) and leaves them as they were."""
    now = int(time.time())
    for stamp in range(now, now + 60):
        (tmp_path / "runs" / f"x__1__{stamp}").mkdir(parents=True)
        (tmp_path / "runs" / f"x__1__{stamp}" / "metrics.jsonl").write_text('{"iteration": 0}\n')
    result = run_main(script, "--exp-name", "x", "--seed", "1", "--model", "no/such/model", cwd=tmp_path)
    assert_one_line_error(result, "--model", "no/such/model")
    assert {p.read_text() for p in (tmp_path / "runs").glob("*/metrics.jsonl")} == {'{"iteration": 0}\n'}


@pytest.mark.parametrize("script, flags", [
    (script, ["--total-episodes", "48", "--batch-size", "16"]) for script in SCRIPTS] + [
    ("interleave.py", ["--total-steps", "3", "--sft.batch-size", "8", "--rloo.batch-size", "8"]),
    ("stepwise_prm.py", ["--num-train-rows", "200", "--num-eval-rows", "40", "--best-of-n", "4", "--warmup-steps",
                         "10", "--total-steps", "3", "--batch-size", "16"])])
def test_eval_every_0_evaluates_at_the_start_and_the_end_only(script, flags, tmp_path):
    """--eval-every 0 stopped the run at its first iteration (a division by zero); it reads as --save-every 0 does."""
    result = run_main(script, *flags, "--eval-every", "0", "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r.get("iteration", r.get("step")) for r in rows if any(k.startswith(("eval/", "task/")) for k in r)]
    assert evaluated == [0, 3], evaluated


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_prompt_of_no_tokens_is_one_line(script, user_files):
    """With a tokenizer that adds no BOS (Qwen's), an empty prompt has no tokens, and its responses' first token no
    position to be scored at (the packed row scored it at the group before it): refused, where it comes from."""
    import ppo
    tokenizer = ppo.build_tokenizer()
    tokenizer.backend_tokenizer.post_processor = None  # no BOS
    tokenizer.save_pretrained(user_files / "no_bos")
    ppo.build_tiny_model(tokenizer).save_pretrained(user_files / "no_bos")
    (user_files / "empty.jsonl").write_text('{"prompt": "1+2="}\n{"prompt": ""}\n')
    result = run_main(script, *TINY, "--model", "no_bos", "--dataset", "empty.jsonl", "--reward-fn",
                      "my_prompts:exact", "--output-dir", user_files / "run", cwd=user_files)
    assert_one_line_error(result, "--dataset", "''", "no tokens")


def test_rloo_needs_two_samples_per_prompt(tmp_path):
    result = run_main("rloo.py", *TINY, "--rloo-k", "1", "--output-dir", tmp_path)
    assert_one_line_error(result, "--rloo-k", "at least 2")


@pytest.mark.parametrize("script", SCRIPTS)
def test_process_rewards_from_a_prm(script, tmp_path, tiny_prm_dir):
    result = run_main(script, *TINY, "--prompt-fn", "stepwise_prm:multistep_prompt",
                      "--reward-fn", "stepwise_prm:multistep_reward",
                      "--prm-model", tiny_prm_dir, "--prm-weight", "0.5", "--max-new-tokens", "16",
                      "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["episode"] == 32
    if script == "ppo.py":
        assert 0 <= rows[-1]["objective/prm_min_step_score"] <= 1


def test_a_reward_model_with_another_tokenizer_does_not_start_the_value_model(tiny_model_dir, tmp_path):
    """The value model reads the policy's token ids: a --reward-model whose tokenizer gives a token another id started
    the critic from the wrong embeddings, in silence; now the policy's weights start it, said once. Tokens of its own
    beyond the policy's are fine."""
    shutil.copytree(tiny_model_dir, tmp_path / "swapped")
    tokenizer_json = json.loads((tmp_path / "swapped" / "tokenizer.json").read_text())
    vocab = tokenizer_json["model"]["vocab"]
    vocab["0"], vocab["1"] = vocab["1"], vocab["0"]
    (tmp_path / "swapped" / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    extended = AutoTokenizer.from_pretrained(tiny_model_dir)
    extended.add_tokens(["<extra>"])
    shutil.copytree(tiny_model_dir, tmp_path / "extended", ignore=shutil.ignore_patterns("tokenizer*"))
    extended.save_pretrained(tmp_path / "extended")
    for folder, noted in (("swapped", 1), ("extended", 0)):
        run = tmp_path / folder / "run"
        result = run_main("ppo.py", *TINY, "--reward-model", tmp_path / folder, "--output-dir", run)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.count(f"note: --reward-model {tmp_path / folder}'s tokenizer gives the policy's tokens "
                                   "other ids, so the value model starts from the policy's weights") == noted
