"""Scale out and never lose a run: each script under torchrun (gloo, 2 processes), one optimisation step equal with
1 and 2 processes (plain data parallel and FSDP2, with and without LoRA), a run killed with SIGKILL and resumed equal
to one left alone, and the NaN/inf guard."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

import ppo
from conftest import (
    ROOT,
    assert_merged_is_base_plus_adapter,
    assert_one_line_error,
    run_killed_at,
    run_main,
    run_script,
)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
TINY = {
    "ppo.py": ["--total-episodes", "64", "--batch-size", "16", "--num-mini-batches", "2", "--eval-every", "2"],
    "rloo.py": ["--total-episodes", "64", "--batch-size", "16", "--eval-every", "2"],
    "interleave.py": ["--total-steps", "4", "--eval-every", "2", "--sft.batch-size", "8", "--rloo.batch-size", "8"],
    "stepwise_prm.py": ["--num-train-rows", "200", "--num-eval-rows", "40", "--best-of-n", "4", "--warmup-steps", "10",
                        "--total-steps", "4", "--batch-size", "16", "--eval-every", "2"],
}


def rows_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("script, extra", [("ppo.py", []), ("ppo.py", ["--fsdp"]), ("ppo.py", ["--lora-r", "4"]),
                                           ("ppo.py", ["--fsdp", "--lora-r", "4"]),
                                           ("rloo.py", []),
                                           ("rloo.py", ["--fsdp"]), ("interleave.py", ["--phases", "sft", "ppo"]),
                                           ("interleave.py", ["rl-with-sft-on-failures", "--fsdp"]),
                                           ("stepwise_prm.py", [])])
def test_script_under_torchrun(script, extra, tmp_path):
    result = run_script(script, *TINY[script], *extra, "--save-every", "2", "--output-dir", tmp_path / "run",
                        launcher=TORCHRUN)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = rows_of(tmp_path / "run")
    assert rows[-1]["iteration"] == 4 and any(k.startswith("eval/") for k in rows[-1])
    assert result.stdout.count("final ") == 1  # only rank 0 prints
    if script in ("ppo.py", "rloo.py"):  # the evaluation's completions in the rows' order, not rank by rank
        first = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()][:100]
        assert [s["prompt"] for s in first] == [r["prompt"] for r in ppo.addition_eval_rows()]
    state = torch.load(tmp_path / "run" / "checkpoints" / "iter_000004" / "state.pt", weights_only=False)
    assert len(state["rng"]) == 2  # every process's random state, for an exact resume
    if "rl-with-sft-on-failures" in extra:  # and each process's own failures (rank 0's alone were kept)
        assert [type(f) for f in state["failures"]] == [list, list] and all(state["failures"])
        assert state["failures"][0] != state["failures"][1]
        # resumed in one process, it keeps both processes' failures (step 5 is RLOO's: it adds some, takes none)
        result = run_script(script, *TINY[script][2:], "--total-steps", "5", "rl-with-sft-on-failures", "--save-every",
                            "5", "--output-dir", tmp_path / "run", "--resume", "latest")
        assert result.returncode == 0, result.stderr[-4000:]
        resumed = torch.load(tmp_path / "run" / "checkpoints" / "iter_000005" / "state.pt", weights_only=False)
        both = [*state["failures"][0], *state["failures"][1]]
        assert resumed["failures"][0][:len(both)] == both
    auto = ppo.AutoModelForTokenClassification if script == "stepwise_prm.py" else ppo.AutoModelForCausalLM
    model = auto.from_pretrained(tmp_path / "run" / "model")  # gathered whole on rank 0
    assert model.config.architectures[0].startswith("Llama")


def test_lora_under_fsdp_saves_the_merged_model_and_the_adapter_which_agree(tmp_path, tiny_model_dir):
    """The adapters merge into weights sharded over 2 processes, gathered whole on rank 0."""
    out = tmp_path / "run"
    result = run_script("ppo.py", *TINY["ppo.py"], "--model", tiny_model_dir, "--learning-rate", "1e-2", "--fsdp",
                        "--lora-r", "4", "--output-dir", out, launcher=TORCHRUN)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_merged_is_base_plus_adapter(out / "model", tiny_model_dir, out / "adapter")


@pytest.mark.parametrize("algo", ["ppo", "rloo", "rloo-masks"])
def test_one_step_equal_with_one_and_two_processes(algo, tmp_path):
    """Same global batch, one SGD step: 2 processes (data parallel or FSDP2) give the 1-process parameters within
    1e-6 (float32 sums in another order). rloo-masks: the token masks decide on all processes' tokens alike."""
    modes = {1: ["plain", "lora"], 2: ["plain", "fsdp", "lora"] + (["fsdp+lora"] if algo == "ppo" else [])}
    out = {}  # the sharding is the scripts' shared machinery: FSDP2 with LoRA once
    for n, launcher in [(1, []), (2, ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"])]:
        folder = tmp_path / str(n)
        folder.mkdir()
        cmd = [sys.executable, *launcher, str(ROOT / "tests" / "dist_one_step.py"), algo, str(folder), *modes[n]]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr[-4000:]
        out.update({(n, mode): torch.load(folder / f"{mode}.pt") for mode in modes[n]})
    torch.manual_seed(0)
    initial = ppo.build_tiny_model(ppo.build_tokenizer()).state_dict()
    assert any(not torch.equal(out[(1, "plain")][f"0.{k}"], v) for k, v in initial.items())  # the step did move
    assert all(result["packed"] for result in out.values())  # on packed rows, FSDP2 and LoRA included
    assert 0.2 < out[(1, "plain")]["loss_token_frac"] < 0.8 or algo != "rloo-masks"  # the masks dropped some tokens
    for result in out.values():
        result.pop("loss_token_frac")  # a process's own share
    for key in [(2, "plain"), (2, "fsdp")]:
        for name, value in out[(1, "plain")].items():
            torch.testing.assert_close(torch.as_tensor(out[key][name]), torch.as_tensor(value), atol=1e-6, rtol=0)
    # LoRA under data parallelism and under FSDP2: the adapters' gradients are averaged like any others, and the
    # reference, the policy with its (perturbed) adapters off, is the same model sharded or not: the same KL
    assert abs(out[(1, "lora")]["kl"]) > 1e-3
    for mode in [mode for mode in modes[2] if "lora" in mode]:
        assert out[(2, mode)].keys() == out[(1, "lora")].keys()
        for name, value in out[(1, "lora")].items():
            torch.testing.assert_close(torch.as_tensor(out[(2, mode)][name]), torch.as_tensor(value), atol=1e-6,
                                       rtol=0)


@pytest.mark.parametrize("script", ["ppo.py", "rloo.py"])
def test_sigkill_then_resume_equals_a_run_left_alone(script, tmp_path):
    args = [*TINY[script], "--total-episodes", "640", "--save-every", "2", "--keep-checkpoints", "3"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert run_main(script, *args, "--output-dir", full).returncode == 0
    run_killed_at(script, *args, "--output-dir", killed, checkpoint=killed / "checkpoints" / "iter_000006")
    assert not (killed / "model").exists()
    result = run_script(script, *args, "--output-dir", killed, "--resume", "latest")
    assert result.returncode == 0, result.stderr[-3000:]
    strip = lambda rows: [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rows]  # noqa: E731
    assert strip(rows_of(killed)) == strip(rows_of(full))
    a, b = load_file(full / "model" / "model.safetensors"), load_file(killed / "model" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_latest_skips_half_written_checkpoints(tmp_path):
    run = tmp_path / "run"
    assert run_main("ppo.py", *TINY["ppo.py"], "--save-every", "2", "--output-dir", run).returncode == 0
    shutil.copytree(run / "checkpoints" / "iter_000004", run / "checkpoints" / "iter_000006.tmp")  # a crash mid-write
    (run / "checkpoints" / "iter_000008").mkdir()  # a folder without state.pt
    assert ppo.find_checkpoint("latest", run).name == "iter_000004"


NAN_REWARD = textwrap.dedent('''
    calls = 0

    def blows_up(prompts, completions, **kwargs):
        """Fine for the first evaluation and 3 iterations, then a score that overflows float32."""
        global calls
        calls += 1
        return [1e200 if calls > 4 else float(len(c) % 2) for c in completions]
''')


@pytest.mark.parametrize("script", ["ppo.py", "rloo.py"])
def test_nonfinite_loss_stops_with_the_last_checkpoint_kept(script, tmp_path):
    (tmp_path / "nan_reward.py").write_text(NAN_REWARD)
    reward = f"{tmp_path / 'nan_reward.py'}:blows_up"
    args = [*TINY[script], "--prompt-fn", "ppo:addition_prompt", "--reward-fn", reward, "--eval-every", "100",
            "--save-every", "2", "--output-dir", tmp_path / "run"]
    line = assert_one_line_error(run_main(script, *args), "--skip-nonfinite", "NaN/inf at iteration 4")
    assert "last good checkpoint" in line
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["iter_000002"]
    assert [r["iteration"] for r in rows_of(tmp_path / "run")] == [0, 1, 2, 3]
    # asked to skip such batches, a new run goes on and counts them
    result = run_main(script, *args, "--skip-nonfinite", "--output-dir", tmp_path / "skip")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = rows_of(tmp_path / "skip")
    assert rows[-1]["iteration"] == 4 and rows[-1]["loss/nonfinite_skipped"] > 0


def test_a_reward_that_varies_only_between_processes_is_said_to_never_vary_within_a_group(tmp_path):
    """One group per process, and a reward of the process alone: the batch varies over processes, yet no group does,
    so every advantage is 0 (the check took a process's one group for ppo.py's batch and said nothing)."""
    (tmp_path / "by_rank.py").write_text("import os\n\ndef score(prompts, completions, **kwargs):\n"
                                          "    return [float(os.environ['RANK'])] * len(completions)\n")
    result = run_script("rloo.py", "--total-episodes", "24", "--batch-size", "8", "--eval-every", "100", "--reward-fn",
                        f"{tmp_path / 'by_rank.py'}:score", "--output-dir", tmp_path / "run", launcher=TORCHRUN)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("warning: the rewards of 3 iterations never varied (the last's equal within each "
                               "group)") == 1


def test_step_or_skip():
    layer = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    before = [p.detach().clone() for p in layer.parameters()]
    layer(torch.tensor([[float("inf"), 1.0]])).sum().backward()  # an inf gradient: the norm check must catch it
    params = list(layer.parameters())
    assert ppo.step_or_skip(optimizer, params, False, 1.0, skip_nonfinite=True) is False
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters())) and layer.weight.grad is None
    with pytest.raises(FloatingPointError):
        ppo.step_or_skip(optimizer, params, True, 1.0, skip_nonfinite=False)
    for norm in (0.0, -1.0):  # transformers' Trainer reads 0 as no clipping; here it zeroed every gradient
        with pytest.raises(SystemExit, match=f"error: --max-grad-norm {norm}: give the gradient norm to clip to, > 0"):
            ppo.step_or_skip(optimizer, params, False, norm, skip_nonfinite=False)
