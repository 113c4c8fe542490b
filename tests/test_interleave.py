"""interleave.py: the schedule against hand-written expectations, config validation, sft_step, every recipe run as
a subprocess, and resume in the middle of a schedule."""

import json
import math
import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

import interleave
import ppo
import rloo
import stepwise_prm
from conftest import assert_one_line_error, run_main, run_script
from interleave import Args, SFTPhase, Turn


def phases_of(args, steps, recent_by_step=None):
    state, out = {"index": 0, "steps": 0}, []
    for step in range(1, steps + 1):
        phase, state = interleave.schedule(args, step, state, (recent_by_step or {}).get(step, {}))
        out.append(phase)
    return out


def test_round_robin_with_per_phase_step_counts():
    args = Args(phases=("sft", "rloo", "prm"), sft=SFTPhase(turn=Turn(steps=2)))
    assert phases_of(args, 8) == ["sft", "sft", "rloo", "prm", "sft", "sft", "rloo", "prm"]


def test_weighted_is_seeded_and_follows_the_weights():
    args = Args(schedule="weighted", sft=SFTPhase(turn=Turn(weight=1.0)),
                rloo=interleave.RLOOPhase(turn=Turn(weight=3.0)))
    first = phases_of(args, 4000)
    assert first == phases_of(args, 4000)  # a pure function of (config, step)
    assert phases_of(Args(schedule="weighted", seed=2), 50) != phases_of(Args(schedule="weighted", seed=1), 50)
    assert abs(Counter(first)["sft"] / 4000 - 0.25) < 0.03


def test_transitions_on_a_metric_and_on_a_budget():
    args = Args(phases=("sft", "rloo", "prm"), schedule="transitions",
                sft=SFTPhase(turn=Turn(until="sft/loss<0.1", max_steps=100)),
                rloo=interleave.RLOOPhase(turn=Turn(max_steps=2)))
    # SFT until its loss is below 0.1 (seen after step 3), then RLOO for its budget of 2 steps, then PRM to the end
    recent = {2: {"sft/loss": 0.5}, 3: {"sft/loss": 0.5}, 4: {"sft/loss": 0.05}}
    assert phases_of(args, 8, recent) == ["sft", "sft", "sft", "rloo", "rloo", "prm", "prm", "prm"]
    # without the metric, the budget ends the phase
    args.sft.turn.max_steps = 3
    assert phases_of(args, 6) == ["sft", "sft", "sft", "rloo", "rloo", "prm"]


def test_every_phase_logs_what_the_schedule_may_wait_for(tiny_model_dir):
    torch.manual_seed(0)
    tokenizer = ppo.build_tokenizer()
    policy, ref = ppo.build_tiny_model(tokenizer), ppo.build_tiny_model(tokenizer)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    batch = interleave.sft_batch(tokenizer, ["3+4=", "12+3="], ["7", "15"])
    seven = tokenizer("7", add_special_tokens=False).input_ids
    assert batch["labels"].tolist()[0] == [-100] * 5 + seven + [tokenizer.eos_token_id, -100, -100]
    assert sorted(interleave.sft_step(policy, optimizer, **batch)) == sorted(interleave.LOGGED["sft"])
    queries = ppo.left_pad([tokenizer("3+4=").input_ids] * 4, tokenizer.pad_token_id)
    responses = torch.tensor([[7, 2, 0]] * 4)
    out = rloo.rloo_step(policy, ref, optimizer, queries, responses, torch.arange(4.0),
                         hp=rloo.RLOOHParams(), pad_token_id=0, eos_token_id=2)
    assert sorted(out) == sorted(interleave.LOGGED["rloo"])
    config = policy.config
    config.num_labels = 1
    value = ppo.disable_dropout(ppo.AutoModelForTokenClassification.from_config(config))
    out = ppo.ppo_step(policy, value, ref, torch.optim.AdamW([*policy.parameters(), *value.parameters()]), queries,
                       responses, torch.arange(4.0), hp=ppo.PPOHParams(), pad_token_id=0, eos_token_id=2)
    assert sorted(out) == sorted(interleave.LOGGED["ppo"])
    config.num_labels = 2
    prm = ppo.AutoModelForTokenClassification.from_config(config)
    rows = [stepwise_prm.tokenize_example(tokenizer, "1+2+3=", ["1+2=3", "3+3=6"], [True, False])]
    out = stepwise_prm.prm_step(prm, torch.optim.AdamW(prm.parameters()), rows, pad_token_id=0)
    assert sorted(out) == sorted(interleave.LOGGED["prm"])


def test_sft_step_learns_and_ignores_the_prompt():
    torch.manual_seed(0)
    tokenizer = ppo.build_tokenizer()
    policy = ppo.build_tiny_model(tokenizer)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    batch = interleave.sft_batch(tokenizer, ["3+4=", "1+1="], ["7", "2"])
    grads = []
    handle = policy.lm_head.register_forward_hook(lambda m, i, o: o.register_hook(grads.append) and None)
    first = interleave.sft_step(policy, optimizer, **batch, logits_chunk=0)["loss"]  # whole logits: hooked
    handle.remove()
    # grads[0] [1, N, V]: the logits at the N positions with a label next, row-major; mapped back to [B, L - 1]
    labelled = batch["labels"][:, 1:] != -100
    assert grads[0].shape[:2] == (1, int(labelled.sum()))
    per_position = torch.zeros(labelled.shape)
    per_position[labelled] = grads[0][0].abs().sum(-1)
    # logits at positions 0..3 predict prompt tokens: no gradient; position 4 predicts the answer, 5 the EOS
    assert (per_position[:, :4] == 0).all() and (per_position[:, 4:6] > 0).all()
    for _ in range(30):
        last = interleave.sft_step(policy, optimizer, **batch)["loss"]
    assert math.isfinite(first) and last < first / 4


TINY = ["--total-steps", "6", "--eval-every", "3", "--sft.batch-size", "8", "--rloo.batch-size", "8",
        "--ppo.batch-size", "8", "--prm.batch-size", "8"]


@pytest.mark.parametrize("recipe", list(interleave.RECIPES))
def test_each_recipe_runs(recipe, tmp_path):
    result = run_main("interleave.py", recipe, *TINY, "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(7))
    args = interleave.RECIPES[recipe][1]
    assert {r["phase"] for r in rows[1:]} <= set(args.phases)
    assert all(k in ("iteration", "phase", "elapsed_s", "lr") or k.split("/")[0] in (r["phase"], "task", "eval")
               for r in rows for k in r)  # metrics are namespaced by the phase that logged them
    assert (tmp_path / "run" / "model" / "config.json").exists()
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    evaluated = [r["iteration"] for r in rows if "task/accuracy" in r]
    assert sorted({s["iteration"] for s in samples}) == evaluated and len(samples) == 100 * len(evaluated)
    assert f"iteration {evaluated[-1]}: 100 evaluation completions in samples.jsonl" in result.stdout


def test_ppo_phase_and_no_recipe_name(tmp_path):
    """A phase's flags when it is not in --phases do nothing (TINY sets every phase's batch size, and a reward here
    for rloo would be ignored): said once."""
    result = run_main("interleave.py", "--phases", "sft", "ppo", *TINY, "--rloo.reward-fn", "my.py:score",
                      "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("note: --rloo.*, --prm.* set for phases not in --phases ['sft', 'ppo']: they do "
                               "nothing") == 1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "ppo/objective/scores" in rows[2] and "sft/loss" in rows[1]


def test_resume_in_the_middle_of_a_schedule(tmp_path):
    args = ["rl-with-sft-on-failures", *TINY, "--total-steps", "8", "--save-every", "4", "--keep-checkpoints", "0"]
    full = tmp_path / "full"
    assert run_main("interleave.py", *args, "--output-dir", full).returncode == 0
    resumed = tmp_path / "resumed"
    shutil.copytree(full / "checkpoints" / "iter_000004", resumed / "checkpoints" / "iter_000004")
    lines = (full / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("".join(line + "\n" for line in lines[:5]))
    result = run_script("interleave.py", *args, "--output-dir", resumed, "--resume", "latest")
    assert result.returncode == 0, result.stderr[-3000:]
    strip = lambda path: [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}  # noqa: E731
                          for line in path.read_text().splitlines()]
    assert strip(resumed / "metrics.jsonl") == strip(full / "metrics.jsonl")
    a, b = load_file(full / "model" / "model.safetensors"), load_file(resumed / "model" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


NUMPY_ROWS = """
import datetime

import numpy as np


def sums(rng):
    a, b = rng.randrange(10), rng.randrange(10)
    return {"prompt": f"{a}+{b}=", "answer": np.int64(a + b), "asked": datetime.date(2026, 12, 2)}


def exact(prompts, completions, answer, **kwargs):
    return [float(c == str(a)) for c, a in zip(completions, answer)]
"""


def test_failures_holding_numpy_numbers_and_dates_are_checkpointed_and_resumed(tmp_path):
    """A prompt function's rows may hold numpy numbers and dates (a dataset's columns too); the prompts that RLOO failed
    go into the failure buffer, which checkpoints keep: as plain data, what SFT reads of them, so that --resume reads
    back what the checkpoint wrote (torch.load's weights_only refuses numpy and datetime objects)."""
    (tmp_path / "my_rows.py").write_text(NUMPY_ROWS)
    args = ["rl-with-sft-on-failures", *TINY, "--rloo.prompt-fn", "my_rows:sums", "--rloo.reward-fn", "my_rows:exact",
            "--save-every", "2", "--output-dir", tmp_path / "run"]
    first = run_main("interleave.py", *args, "--total-steps", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    state = torch.load(tmp_path / "run" / "checkpoints" / "iter_000002" / "state.pt", weights_only=True)
    failures = state["failures"][0]  # one buffer per process
    assert failures and all(set(row) == {"prompt", "answer"} for row in failures)
    assert all(row["answer"] == str(eval(row["prompt"][:-1])) for row in failures)  # the sum, as SFT reads it
    resumed = run_script("interleave.py", *args, "--total-steps", "4", "--resume", "latest", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["iteration"] == 4


def test_learning_rates_default_by_model_and_are_logged(tmp_path, tiny_model_dir):
    for model, expected in [("builtin", {"sft": 1e-3, "rloo": 1e-3}), (tiny_model_dir, {"sft": 1e-5, "rloo": 3e-6})]:
        out = tmp_path / ("builtin" if model == "builtin" else "folder")
        result = run_main("interleave.py", "--model", model, "--phases", "sft", "rloo", *TINY, "--no-anneal-lr",
                          "--output-dir", out)
        assert result.returncode == 0, result.stderr[-3000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert {r["phase"]: r["lr"] for r in rows if "lr" in r} == expected


def test_rl_phases_with_a_prm_as_their_only_reward_train_on_its_step_scores(tmp_path, tiny_prm_dir, monkeypatch):
    placed, place = [], ppo.place  # what goes to the device (and is sharded under --fsdp): the PRM too
    monkeypatch.setattr(ppo, "place", lambda models, *args: placed.extend(models) or place(models, *args))

    def run(phase, weight):
        out = tmp_path / f"{phase}-{weight}"
        result = run_main("interleave.py", "--phases", phase, *TINY, f"--{phase}.prompt-fn",
                          "stepwise_prm:multistep_prompt",
                          f"--{phase}.prm-model", tiny_prm_dir, f"--{phase}.prm-weight", weight,
                          "--max-new-tokens", "16", "--output-dir", out)
        assert result.returncode == 0, result.stderr[-3000:]
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], out
    rows, _ = run("rloo", "1.0")  # rloo: each response's aggregated step score is its reward
    assert any(type(m).__name__.endswith("ForTokenClassification") for m in placed if m is not None)
    scores = [r["rloo/objective/scores"] for r in rows if "rloo/objective/scores" in r]
    assert scores and all(s > 0 for s in scores), scores  # a random PRM scores steps about 0.5, never exactly 0
    _, with_prm = run("ppo", "1.0")  # ppo: shaped per-token rewards that add up to 0 per response
    _, without = run("ppo", "0.0")
    a, b = (load_file(d / "model" / "model.safetensors") for d in (with_prm, without))
    assert any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("args, flag, words", [
    (["--phases", "sft", "dpo"], "--phases", ["from ['sft', 'ppo', 'rloo', 'prm']"]),
    (["--phases", "sft", "sft"], "--phases", ["once"]),
    (["--sft.steps", "0"], "--sft.steps", ["positive"]),
    (["--schedule", "weighted", "--rloo.weight", "0"], "--rloo.weight", ["never runs"]),
    (["--sft.until", "rloo/loss<0.1"], "--sft.until", ["does not log rloo/loss"]),
    (["--sft.until", "sft/loss=0.1"], "--sft.until", ["metric<value"]),
    (["--schedule", "transitions"], "--sft.until", ["['rloo'] can never run"]),
    (["--phases", "sft", "--sft.on-failures"], "--sft.on-failures", ["needs an RL phase"]),
    (["--rloo.batch-size", "10"], "--rloo.batch-size", ["--rloo.rloo-k (4: whole groups) x 1 process(es)"]),
    (["--rloo.num-mini-batches", "3"], "--rloo.batch-size", ["--rloo.num-mini-batches (3)"]),  # not rloo_step's
    (["--phases", "ppo", "--ppo.batch-size", "6"], "--ppo.batch-size", ["by 1 process(es) x --ppo.num-mini-batches"]),
    (["--rloo.num-ppo-epochs", "0"], "--rloo.num-ppo-epochs", ["at least 1"]),  # its steps trained nothing
    (["--rloo.max-grad-norm", "0"], "--rloo.max-grad-norm", ["> 0"]),  # before any step, named as here
    (["--rloo.rloo-k", "1", "--rloo.batch-size", "4"], "--rloo.rloo-k", ["at least 2"]),  # rloo.py's own checks
    (["--rloo.loss-type", "cispo"], "--rloo.epsilon-high", ["--rloo.loss-type cispo caps"]),
    (["--rloo.top-entropy-quantile", "2"], "--rloo.top-entropy-quantile", ["from 0 to 1"]),
    (["--rloo.kl-estimator", "k2", "--rloo.kl-in-reward"], "--rloo.kl-estimator", ["k2's is biased"]),
    (["--sft.max-grad-norm", "0"], "--sft.max-grad-norm", ["> 0"]),
    (["--phases", "ppo", "--ppo.sampler-correction-cap", "0"], "--ppo.sampler-correction-cap", ["> 0"]),
    (["--rloo.prompt-fn", "ppo:addition_prompt"], "--rloo.reward-fn", ["need a reward", "give --rloo.reward-fn"]),
])
def test_bad_config_is_one_line(args, flag, words, tmp_path):
    assert_one_line_error(run_main("interleave.py", *args, "--output-dir", tmp_path), flag, *words)
