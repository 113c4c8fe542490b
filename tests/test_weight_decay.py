"""AdamW's weight decay as transformers' Trainer applies it: --weight-decay (default 0.0, Trainer's and so TRL's) on
every weight but biases and normalisation weights, in every script that builds an optimizer; the learning-rate
schedule sets every parameter group; a run with decay resumes exactly."""

import copy
import shutil

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer

import ppo
import stepwise_prm
from conftest import assert_one_line_error, run_main, run_script


def decayed(optimizer) -> set[int]:
    return {id(p) for g in optimizer.param_groups for p in g["params"] if g["weight_decay"] > 0}


@pytest.mark.parametrize("module", [ppo, stepwise_prm])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "llama-lora"])
def test_adamw_decays_what_transformers_trainer_decays(module, arch):
    tokenizer = ppo.build_tokenizer()
    if arch == "gpt2":  # biases and LayerNorm modules
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=2, n_head=2))
    else:  # RMSNorm weights
        model = ppo.build_tiny_model(tokenizer)
    if arch == "llama-lora":
        model = ppo.with_lora(model, ppo.MemoryArgs(lora_r=2))
    value = ppo.token_classifier_from(copy.deepcopy(model) if arch != "llama-lora" else ppo.build_tiny_model(
        tokenizer), 1, "--model", "test")
    optimizer = module.adamw([model, value], 1e-3, 0.1)
    expected = set()
    for m in (model, value):  # Trainer's own rule (the method reads nothing of the Trainer)
        names = set(Trainer.get_decay_parameter_names(None, m))
        expected |= {id(p) for n, p in m.named_parameters() if n in names and p.requires_grad}
    assert decayed(optimizer) == expected
    trained = {id(p) for m in (model, value) for p in m.parameters() if p.requires_grad}
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == trained
    names = {id(p): n for m in (model, value) for n, p in m.named_parameters()}
    assert not any("bias" in names[i] or "norm" in names[i] or "ln_" in names[i] for i in decayed(optimizer))
    assert any("bias" in names[i] or "norm" in names[i] or "ln_" in names[i] for i in trained - decayed(optimizer))
    assert not decayed(module.adamw([model, value], 1e-3, 0.0))


RUNS = {
    "ppo.py": ["--total-episodes", "32", "--batch-size", "16", "--num-mini-batches", "2", "--num-ppo-epochs", "1"],
    "rloo.py": ["--total-episodes", "32", "--batch-size", "16"],
    "stepwise_prm.py": ["--num-train-rows", "200", "--num-eval-rows", "40", "--best-of-n", "0", "--warmup-steps", "2",
                        "--total-steps", "2", "--batch-size", "16"],
    "interleave.py": ["--total-steps", "2", "--sft.batch-size", "8", "--rloo.batch-size", "8"],
}


@pytest.mark.parametrize("script", RUNS)
def test_every_script_takes_weight_decay_and_anneals_every_group(script, tmp_path):
    """The checkpoint's optimizer: no decay by default (torch's AdamW alone would decay every weight at 0.01); with
    --weight-decay 0.1 a decayed group and one of biases and normalisation weights, both at the annealed rate."""
    for flags, out in (([], tmp_path / "default"), (["--weight-decay", "0.1"], tmp_path / "decay")):
        result = run_main(script, *RUNS[script], *flags, "--save-every", "2", "--eval-every", "2",
                          "--output-dir", out)
        assert result.returncode == 0, result.stderr[-3000:]
        state = torch.load(out / "checkpoints" / "iter_000002" / "state.pt", weights_only=True)
        groups = state["optimizers"]["sft"] if script == "interleave.py" else state["optimizer"]
        groups = groups["param_groups"]
        if not flags:
            assert [g["weight_decay"] for g in groups] == [0.0]
        else:
            assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
            assert len(groups[1]["params"]) > 0
            assert groups[0]["lr"] == groups[1]["lr"] > 0


@pytest.mark.parametrize("script", ["ppo.py", "rloo.py"])
def test_a_run_with_weight_decay_resumes_exactly(script, tmp_path):
    args = ["--total-episodes", "48", "--batch-size", "16", "--num-mini-batches", "2", "--weight-decay", "0.1",
            "--save-every", "1", "--keep-checkpoints", "0", "--eval-every", "3"]
    full = run_main(script, *args, "--output-dir", tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "iter_000001",
                    tmp_path / "resumed" / "checkpoints" / "iter_000001")
    resumed = run_script(script, *args, "--output-dir", tmp_path / "resumed", "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / run / "model" / "model.safetensors") for run in ("full", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("script", ["ppo.py", "stepwise_prm.py"])
def test_a_resume_takes_the_new_weight_decay_and_refuses_turning_it_on_or_off(script, tmp_path):
    """optimizer.load_state_dict brings the checkpoint's weight decay back: resumed with another --weight-decay, a run
    went on with the old one, silently; resumed with it turned off (one parameter group for two), it stopped with a
    traceback. Now the new value trains, and turning decay on or off is refused in one line."""
    args = [*RUNS[script], "--save-every", "1", "--eval-every", "100", "--output-dir", tmp_path / "run"]
    longer = lambda n: ["--total-steps", str(n)] if "prm" in script else ["--total-episodes", str(16 * n)]  # noqa: E731
    assert run_main(script, *args, "--weight-decay", "0.1").returncode == 0
    resumed = run_script(script, *args, "--weight-decay", "0.3", *longer(3), "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    state = torch.load(tmp_path / "run" / "checkpoints" / "iter_000003" / "state.pt", weights_only=True)
    assert [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [0.3, 0.0]
    result = run_main(script, *args, "--weight-decay", "0", *longer(4), "--resume", "latest")
    assert_one_line_error(result, "--weight-decay", "2 parameter group(s), weight decay on", "resume with one > 0")
