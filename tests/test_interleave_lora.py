"""LoRA in interleave.py: the shared policy carries one set of adapters that the SFT, PPO and RLOO steps all train (the
reference being the policy with them off), the value model and the PRM their own; runs save each model merged and
its adapter beside it, and resume exactly."""

import json
import shutil

import torch
from safetensors.torch import load_file
from transformers import AutoModelForTokenClassification

import interleave
import ppo
import rloo
from conftest import assert_merged_is_base_plus_adapter, run_main, run_script
from test_ppo import batch

PHASES = ["--phases", "sft", "ppo", "rloo", "prm", "--eval-every", "4", "--sft.batch-size", "8", "--rloo.batch-size",
          "8", "--ppo.batch-size", "8", "--prm.batch-size", "8", "--lora-r", "4"]


def test_sft_ppo_and_rloo_steps_train_the_same_adapters_and_only_them():
    tokenizer = ppo.build_tokenizer()
    torch.manual_seed(0)
    policy = ppo.build_tiny_model(tokenizer)
    value = ppo.token_classifier_from(policy, 1, "--model", "test")
    value.config.pad_token_id = tokenizer.pad_token_id
    policy = ppo.disable_dropout(ppo.with_lora(policy, ppo.MemoryArgs(lora_r=4)))
    value = ppo.disable_dropout(ppo.with_lora(value, ppo.MemoryArgs(lora_r=4)))
    optimizer = ppo.adamw([policy, value], 1e-2, 0.1)  # two groups: decayed weights, and biases and norms
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in [*policy.named_parameters(), *value.named_parameters()]
        if "lora_" in n or "modules_to_save" in n}
    queries, responses = batch(tokenizer, n=8)
    common = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}

    def snapshot():
        return {n: p.detach().clone() for n, p in policy.named_parameters()}

    steps = {
        "sft": lambda: interleave.sft_step(policy, optimizer, **interleave.sft_batch(tokenizer, ["3+4=", "1+1="],
                                                                                      ["7", "2"])),
        "ppo": lambda: ppo.ppo_step(policy, value, None, optimizer, queries, responses, torch.randn(8),
                                    hp=ppo.PPOHParams(num_ppo_epochs=1, num_mini_batches=1), **common),
        "rloo": lambda: rloo.rloo_step(policy, None, optimizer, queries[:2].repeat_interleave(4, 0), responses,
                                       torch.randn(8), hp=rloo.RLOOHParams(rloo_k=4, num_ppo_epochs=1,
                                                                           num_mini_batches=1), **common),
    }
    for phase, step in steps.items():
        before = snapshot()
        step()
        after = snapshot()
        changed = {n for n in after if not torch.equal(after[n], before[n])}
        assert changed and all("lora_" in n for n in changed), (phase, sorted(changed)[:3])  # base bit-identical
        assert any("lora_A" in n for n in changed), phase  # the one set of adapters moved in every phase


def test_a_lora_run_saves_merged_models_and_adapters_and_resumes_exactly(tmp_path, tiny_model_dir):
    """With --gradient-checkpointing too: every phase's training passes recompute their layers."""
    args = [*PHASES, "--gradient-checkpointing", "--model", tiny_model_dir, "--sft.learning-rate", "1e-2",
            "--rloo.learning-rate", "1e-2", "--ppo.learning-rate", "1e-2", "--total-steps", "8", "--save-every", "4",
            "--keep-checkpoints", "0"]
    full = tmp_path / "full"
    result = run_main("interleave.py", *args, "--output-dir", full)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows[1:]] == ["sft", "ppo", "rloo", "prm"] * 2

    assert_merged_is_base_plus_adapter(full / "model", tiny_model_dir, full / "adapter")
    for name in ("value", "prm"):
        assert AutoModelForTokenClassification.from_pretrained(full / name).config.num_labels == (1 if name == "value"
                                                                                                 else 2)
        assert (full / f"{name}_adapter" / "adapter_model.safetensors").exists()

    resumed = tmp_path / "resumed"
    shutil.copytree(full / "checkpoints" / "iter_000004", resumed / "checkpoints" / "iter_000004")
    assert not (resumed / "checkpoints" / "iter_000004" / "policy" / "model.safetensors").exists()  # adapters only
    lines = (full / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("".join(line + "\n" for line in lines[:5]))
    result = run_script("interleave.py", *args, "--output-dir", resumed, "--resume", "latest")
    assert result.returncode == 0, result.stderr[-3000:]

    def strip(path):  # the rows without their wall-clock times
        return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
                for line in (path / "metrics.jsonl").read_text().splitlines()]

    assert strip(resumed) == strip(full)
    for folder, name in [("model", "model.safetensors"), ("adapter", "adapter_model.safetensors"),
                         ("prm_adapter", "adapter_model.safetensors")]:
        a, b = load_file(full / folder / name), load_file(resumed / folder / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
