"""LoRA adapters and activation checkpointing in stepwise_prm.py: only the adapters and the 2-label head train, a run
saves the merged PRM and the adapter (which give the same logits), resumes exactly, and checkpointing changes no
step."""

import copy
import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForTokenClassification

import stepwise_prm as prm
from conftest import assert_merged_is_base_plus_adapter, assert_one_line_error, run_main, run_script

TINY = ["--num-train-rows", "200", "--num-eval-rows", "40", "--best-of-n", "4", "--warmup-steps", "10",
        "--total-steps", "4", "--batch-size", "16", "--eval-every", "2"]
LORA = [*TINY, "--lora-r", "4", "--gradient-checkpointing", "--save-every", "2", "--keep-checkpoints", "0"]


def classifier(lora_r: int = 0, gradient_checkpointing: bool = False):
    """The built-in tokenizer and a tiny 2-label token classifier (seed 0), through with_lora as main() builds it."""
    tokenizer = prm.build_tokenizer()
    torch.manual_seed(0)
    config = prm.build_tiny_model(tokenizer).config
    config.num_labels = 2
    model = AutoModelForTokenClassification.from_config(config)
    memory = prm.MemoryArgs(lora_r=lora_r, gradient_checkpointing=gradient_checkpointing)
    return tokenizer, prm.with_lora(model, memory)


def rows(tokenizer, n: int = 12) -> list[dict]:
    rng = random.Random(0)
    return [prm.tokenize_example(tokenizer, **prm.multistep_row(rng)) for _ in range(n)]


def test_a_lora_step_trains_only_the_adapters_and_the_head_and_frozen_weights_are_harmless():
    tokenizer, model = classifier(lora_r=4)
    optimizer = prm.adamw([model], 1e-2, 0.0, eps=1e-8)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in held}
    assert names and all("lora_" in n or "modules_to_save" in n for n in names), sorted(names)[:3]
    assert any("score" in n for n in names)  # the head trains whole
    everything = copy.deepcopy(model)  # the same step with the frozen weights in the optimizer too: they get no grad
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(1)
    metrics = prm.prm_step(model, optimizer, rows(tokenizer), pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(1)
    prm.prm_step(everything, torch.optim.AdamW(everything.parameters(), lr=1e-2, weight_decay=0.0), rows(tokenizer),
                 pad_token_id=tokenizer.pad_token_id)
    assert metrics["train/nonfinite_skipped"] == 0.0
    for n, p in model.named_parameters():
        if n in names and "lora_A" not in n:  # lora_B starts at 0, so lora_A's first gradient is 0
            assert not torch.equal(p, before[n]), n
        elif n not in names:
            assert torch.equal(p, before[n]), n  # base weights bit-identical
    for (n, a), b in zip(model.named_parameters(), everything.parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("lora_r", [0, 4])
def test_gradient_checkpointing_keeps_fewer_activations_and_gives_the_same_step(lora_r):
    results = []
    for checkpointing in (False, True):
        tokenizer, model = classifier(lora_r, checkpointing)
        params, kept = [p for p in model.parameters() if p.requires_grad], []

        def keep(t: torch.Tensor, kept=kept) -> torch.Tensor:  # every tensor autograd keeps outside checkpointed layers
            kept.append(t.numel())
            return t

        torch.manual_seed(1)  # the head's dropout draws the same masks
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            metrics = prm.prm_step(model, torch.optim.SGD(params, lr=1.0), rows(tokenizer),
                                   pad_token_id=tokenizer.pad_token_id, gradient_accumulation_steps=2,
                                   max_grad_norm=1e9)
        results.append((metrics["train/loss"], [p.detach().clone() for p in params], sum(kept)))
    (loss, plain, plain_kept), (checkpointed_loss, checkpointed, checkpointed_kept) = results
    assert checkpointed_kept < plain_kept / 4  # the layers keep only their inputs (measured: about a tenth)
    assert abs(checkpointed_loss - loss) <= 1e-6
    for a, b in zip(plain, checkpointed):  # SGD with lr 1: the weights moved by the gradient itself
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)


def test_gradient_checkpointing_changes_no_run_of_a_pretrained_model(tmp_path, tiny_model_dir):
    """from_pretrained leaves a model in eval mode; checkpointing needs training mode, which also turns the head's
    dropout on: the run trains in training mode either way, so the flag changes the memory and nothing else."""
    losses = []
    for flags in ([], ["--gradient-checkpointing"]):
        out = tmp_path / f"run{len(flags)}"
        result = run_main("stepwise_prm.py", "--model", tiny_model_dir, "--num-train-rows", "200", "--num-eval-rows",
                          "40", "--best-of-n", "0", "--total-steps", "3", "--batch-size", "16", "--learning-rate",
                          "1e-2", *flags, "--output-dir", out)
        assert result.returncode == 0, result.stderr[-3000:]
        rows = (out / "metrics.jsonl").read_text().splitlines()
        losses.append([json.loads(row).get("train/loss", 0.0) for row in rows])
    assert losses[1] == pytest.approx(losses[0], abs=1e-6, rel=0)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A built-in run with LoRA and checkpointing: 4 steps, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("prm_lora") / "full"
    result = run_main("stepwise_prm.py", *LORA, "--output-dir", out)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_a_lora_run_saves_the_merged_prm_and_the_adapter_which_give_the_same_logits(lora_run):
    for folder in (lora_run / "adapter", lora_run / "checkpoints" / "iter_000002" / "model"):
        saved = load_file(folder / "adapter_model.safetensors")  # the adapters and the head, no base weight
        assert saved and all("lora_" in k or ".score." in k for k in saved), sorted(saved)[:3]
    ids = prm.build_tokenizer()("2+3+4=2+3=5\n5+4=9\n", return_tensors="pt").input_ids  # [1, L], <bos> first
    # the adapters' base is the warm start's LM under a fresh 2-label head, which the adapter's trained head replaces
    merged = assert_merged_is_base_plus_adapter(lora_run / "model", lora_run / "warmup_lm", lora_run / "adapter",
                                                AutoModelForTokenClassification, ids, 1e-5, num_labels=2)
    assert merged.config.id2label == {0: "wrong", 1: "correct"}


def test_a_lora_run_resumes_exactly(lora_run, tmp_path):
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(lora_run / "checkpoints" / "iter_000002", resumed / "checkpoints" / "iter_000002")
    lines = (lora_run / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("".join(line + "\n" for line in lines[:3]))
    # the checkpoint holds adapters and head; their base is the warm start's LM, which resuming reads back
    result = run_script("stepwise_prm.py", *LORA, "--output-dir", resumed, "--resume", "latest")
    assert_one_line_error(result, "--resume", "warmup_lm")
    shutil.copytree(lora_run / "warmup_lm", resumed / "warmup_lm")
    result = run_script("stepwise_prm.py", *LORA, "--output-dir", resumed, "--resume", "latest")
    assert result.returncode == 0, result.stderr[-3000:]

    def strip(path):  # the rows without their wall-clock times
        return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
                for line in (path / "metrics.jsonl").read_text().splitlines()]

    assert strip(resumed) == strip(lora_run)
    for name in ("model/model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(lora_run / name), load_file(resumed / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.parametrize("args, flag, words", [
    (["--lora-r", "-1"], "--lora-r", ["rank"]),
    (["--lora-r", "4", "--lora-target-modules", "nosuchmodule"], "--lora-target-modules", ["nosuchmodule"]),
])
def test_bad_lora_flags_stop_with_one_line(args, flag, words, tmp_path):
    """Before the built-in model's warm start (1,500 steps by default), not after it."""
    result = run_main("stepwise_prm.py", *TINY, *args, "--output-dir", tmp_path / "run")
    assert_one_line_error(result, flag, *words)
    assert not (tmp_path / "run" / "warmup_lm").exists()
