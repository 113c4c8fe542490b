"""A run, not a step: ppo.py and rloo.py (and interleave.py's RL phases) for 12 iterations over prompts of 3-120 tokens
whose responses end at varied points, in the combinations users run. One process with LoRA, killed at a checkpoint and
resumed (equal to the run left alone; other adapter settings refused); torchrun with DDP and with FSDP2, where one
process's batch holds short prompts and much padding and the other's long prompts of one length; --compile under
dynamo's eager backend (inductor's guards and recompile limit, a limit hit a failure, without inductor's minutes of
compiling); bf16 model folders. Every cell must finish. (One step on 1 and 2 processes: tests/test_distributed.py.)"""

import json
import random
import sys

import pytest
import torch
from safetensors.torch import load_file

import ppo
from conftest import assert_one_line_error, run_killed_at, run_main, run_script

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
EAGER_COMPILE = [sys.executable, "-c", "import runpy, sys, torch; torch.compiler.set_default_backend('eager'); "
                 "torch.compiler.config.fail_on_recompile_limit_hit = True; sys.argv = sys.argv[1:]; "
                 "runpy.run_path(sys.argv[0], run_name='__main__')"]  # python -c ... script.py flags
REWARD = '''
def digits(prompts, completions, **kwargs):
    """The share of digits in each completion: a score that varies."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]
'''
ROWS = 400


def task(folder, script: str, split_at=()) -> list[str]:
    """Flags of a 12-iteration run on prompts.jsonl, 400 prompts of 3-120 characters (a token each, with the built-in
    tokenizer), scored by the share of digits. At the iterations `split_at`, the first of two processes draws prompts
    of 3-6 characters and the second prompts of 110 (draw_rows' order recomputed)."""
    per_iteration = 16 if script == "ppo.py" else 4  # prompts drawn an iteration (rloo.py: 4 x k = 4 responses)
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(1)).tolist()  # seed 1, epoch 0
    rng = random.Random(0)
    lengths = [rng.randint(3, 120) for _ in range(ROWS)]
    for place, row in enumerate(order):
        iteration, within = divmod(place, per_iteration)
        if iteration + 1 in split_at:
            lengths[row] = rng.randint(3, 6) if within < per_iteration // 2 else 110
    chars = "0123456789+-*= "
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": "".join(rng.choice(chars) for _ in range(n))})
                                                  + "\n" for n in lengths))
    (folder / "rewards.py").write_text(REWARD)
    return ["--dataset", folder / "prompts.jsonl", "--reward-fn", f"{folder / 'rewards.py'}:digits",
            "--max-new-tokens", "24", "--batch-size", "16", "--total-episodes", "192", "--eval-every", "6",
            "--num-eval-prompts", "16", "--num-mini-batches", "2" if script == "ppo.py" else "1"]


def rows_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_time(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rows]


def finished(result, run_dir) -> list[dict]:
    """The run ended well after 12 iterations whose responses had different lengths; its rows."""
    assert result.returncode == 0, result.stderr[-4000:]
    rows = rows_of(run_dir)
    assert rows[-1]["iteration"] == 12
    return rows


@pytest.mark.parametrize("script", ["ppo.py", "rloo.py"])
def test_a_lora_run_killed_at_a_checkpoint_resumes_as_left_alone_and_refuses_other_adapters(script, tmp_path):
    args = [*task(tmp_path, script), "--lora-r", "4", "--save-every", "4", "--keep-checkpoints", "3"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    rows = finished(run_main(script, *args, "--output-dir", full), full)
    assert len({round(r["val/response_length"], 3) for r in rows[1:]}) > 6  # responses ended at varied points
    run_killed_at(script, *args, "--output-dir", killed, checkpoint=killed / "checkpoints" / "iter_000004")
    resumed = run_script(script, *args, "--output-dir", killed, "--resume", "latest")
    assert without_time(finished(resumed, killed)) == without_time(rows)
    a, b = load_file(full / "adapter" / "adapter_model.safetensors"), load_file(killed / "adapter" /
                                                                                 "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # other adapters on the checkpoint's weights would train another model: refused, the flag named
    for flag, value, saved in (("--lora-alpha", "16", "8"), ("--lora-r", "8", "4"),
                               ("--lora-target-modules", "q_proj", "down_proj")):
        result = run_main(script, *args, "--output-dir", killed, "--resume", "latest", flag, value)
        assert_one_line_error(result, flag, saved, "resume with it")


@pytest.mark.parametrize("script", ["ppo.py", "rloo.py"])
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_under_torchrun_processes_whose_batches_differ_in_padding_finish(script, fsdp, tmp_path):
    """At iterations 1, 5 and 9 the first process's batch is short prompts and padded responses, the second's long
    prompts of one length: rloo.py chose its forward route per process (the first packed its rows, the second shared
    each prompt's cache), so the processes' collectives paired up wrong: DDP broke with a NaN, FSDP2 hung."""
    args = [*task(tmp_path, script, split_at=(1, 5, 9)), *(["--fsdp"] if fsdp else [])]
    finished(run_script(script, *args, "--output-dir", tmp_path / "run", launcher=TORCHRUN, timeout=300),
             tmp_path / "run")


@pytest.mark.parametrize("script", ["ppo.py", "rloo.py"])
def test_a_compiled_run_over_prompts_of_many_lengths_keeps_its_decode_shapes_bounded(script, tmp_path):
    """Each (rows, cache length) was a graph of the compiled decode step: the run stopped at iteration 4 with
    FailOnRecompileLimitHit. Now one graph takes them all, and the static caches kept, one a shape, are counted."""
    result = run_script(script, *task(tmp_path, script), "--compile", "--output-dir", tmp_path / "run",
                        launcher=EAGER_COMPILE)
    rows = finished(result, tmp_path / "run")
    shapes = [r["sampling/decode_shapes"] for r in rows[1:]]
    assert shapes == sorted(shapes) and 3 <= shapes[-1] <= 12  # rollout and evaluation rows, halves, quarters
    # x the ladder's cache lengths met (here at most 4 of 32, 48, 64, 96, 128, 192)


def test_bf16_model_folders_train_in_fp32(tmp_path):
    """A policy and a reward model saved in bf16: ppo.py's value model, read from the reward model's folder, trains
    on fp32 weights as the policy does (it trained in bf16: most of AdamW's small steps rounded away); the reward
    model scores in its own dtype. rloo.py takes the same folders."""
    tokenizer = ppo.build_tokenizer()
    torch.manual_seed(0)
    policy = ppo.build_tiny_model(tokenizer)
    config = policy.config
    config.num_labels = 1
    reward = ppo.AutoModelForSequenceClassification.from_config(config)
    for name, model in (("policy", policy), ("reward", reward)):
        model.to(torch.bfloat16).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    for script in ("ppo.py", "rloo.py"):
        args = [*task(tmp_path, script), "--model", tmp_path / "policy", "--reward-model", tmp_path / "reward",
                "--learning-rate", "1e-3", "--save-every", "12", "--output-dir", tmp_path / script]
        finished(run_main(script, *args), tmp_path / script)
        saved = tmp_path / script / "checkpoints" / "iter_000012"
        weights = [load_file(f) for part in ("policy", "value") for f in (saved / part).glob("*.safetensors")]
        assert {t.dtype for w in weights for t in w.values()} == {torch.float32}


def test_interleaved_rl_phases_under_fsdp_finish(tmp_path):
    """interleave.py's PPO and RLOO phases share the scripts' rollout and steps: 12 steps on the uneven prompts under
    FSDP2, the RLOO phase's first draw split as above (it hung there)."""
    flags = task(tmp_path, "rloo.py", split_at=(1,))
    data = {"dataset": flags[1], "reward-fn": flags[3], "batch-size": 16, "num-eval-prompts": 16}
    args = ["interleaved", "--phases", "ppo", "rloo", "--total-steps", "12", "--eval-every", "6", "--max-new-tokens",
            "24", *[x for phase in ("ppo", "rloo") for k, v in data.items() for x in (f"--{phase}.{k}", v)],
            "--fsdp", "--output-dir", tmp_path / "run"]
    result = run_script("interleave.py", *args, launcher=TORCHRUN, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert rows_of(tmp_path / "run")[-1]["iteration"] == 12
