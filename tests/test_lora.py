"""LoRA adapters (peft) in ppo.py and rloo.py: the reference is the policy with its adapters off, only the adapters
(and a value model's head) train, and runs save the merged model, the adapter beside it, and resume exactly."""

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import ppo
import rloo
from conftest import assert_merged_is_base_plus_adapter, assert_one_line_error, run_main, run_script
from test_ppo import batch

TINY = ["--total-episodes", "32", "--batch-size", "16", "--num-mini-batches", "2", "--eval-every", "1",
        "--num-ppo-epochs", "2"]


def lora_models(seed: int = 0):
    """Tokenizer, a policy with LoRA adapters (B initialised at random, so that they change the outputs), a frozen
    copy of its base weights, and a value model with adapters on its own base and a whole head."""
    tokenizer = ppo.build_tokenizer()
    torch.manual_seed(seed)
    base = ppo.build_tiny_model(tokenizer)
    frozen_base = copy.deepcopy(base).eval().requires_grad_(False)
    value = ppo.token_classifier_from(base, 1, "--model", "test")
    value.config.pad_token_id = tokenizer.pad_token_id
    policy = ppo.disable_dropout(ppo.with_lora(base, ppo.MemoryArgs(lora_r=4)))
    value = ppo.disable_dropout(ppo.with_lora(value, ppo.MemoryArgs(lora_r=4)))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    return tokenizer, policy, frozen_base, value


def logprobs(model, tokenizer, queries, responses):
    query_mask = (queries != tokenizer.pad_token_id).cumsum(1) > 0
    return ppo.response_logprobs(model, queries, query_mask, responses, torch.ones_like(responses).bool(), 1.0)[0]


def test_reference_logprobs_are_the_base_models_with_the_adapters_off():
    tokenizer, policy, frozen_base, _ = lora_models()
    queries, responses = batch(tokenizer)
    with torch.no_grad():
        base = logprobs(frozen_base, tokenizer, queries, responses)
        adapted = logprobs(policy, tokenizer, queries, responses)
        model, context = ppo.reference(policy, None)
        with context:
            reference = logprobs(model, tokenizer, queries, responses)
    assert (adapted - base).abs().max() > 1e-3  # the adapters change the policy
    assert (reference - base).abs().max() <= 1e-6
    with pytest.raises(ValueError, match="adapters off"):  # no adapters to switch off: a copy is needed
        ppo.reference(frozen_base, None)


def test_the_reference_under_compile_is_the_base_model():
    """--compile wraps the models' forward in torch.compile (compile_models). The reference the steps take with LoRA,
    the policy with its adapters off (a context that flips a flag in every adapter layer, which the compiled graph
    must see), still gives the base model's logprobs, and the policy, after it, its adapters' logprobs again."""
    tokenizer, policy, frozen_base, _ = lora_models()
    queries, responses = batch(tokenizer, n=8)
    with torch.no_grad():
        base = logprobs(frozen_base, tokenizer, queries, responses)
        adapted = logprobs(policy, tokenizer, queries, responses)
    torch._dynamo.reset()
    ppo.compile_models(True, [policy], [], torch.device("cpu"))
    with torch.no_grad():
        model, context = ppo.reference(policy, None)
        with context:
            reference = logprobs(model, tokenizer, queries, responses)
        after = logprobs(policy, tokenizer, queries, responses)
    assert (adapted - base).abs().max() > 1e-2  # the adapters change the policy
    torch.testing.assert_close(reference, base, rtol=0, atol=1e-5)
    torch.testing.assert_close(after, adapted, rtol=0, atol=1e-5)


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
def test_a_step_with_no_reference_copy_trains_only_the_adapters_and_the_head(algo):
    tokenizer, policy, _, value = lora_models()
    queries, responses = batch(tokenizer, n=8)
    models = [policy, value] if algo == "ppo" else [policy]
    trained = [p for m in models for p in m.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-2, eps=1e-5)
    before = {(i, n): p.detach().clone() for i, m in enumerate(models) for n, p in m.named_parameters()}
    if algo == "ppo":
        metrics = ppo.ppo_step(policy, value, None, optimizer, queries, responses, torch.randn(8),
                               hp=ppo.PPOHParams(num_ppo_epochs=1, num_mini_batches=1, kl_coef=0.1),
                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    else:
        grouped = queries[:2].repeat_interleave(4, 0)  # 2 prompts x k = 4 samples, contiguous
        metrics = rloo.rloo_step(policy, None, optimizer, grouped, responses, torch.randn(8),
                                 hp=rloo.RLOOHParams(rloo_k=4, num_ppo_epochs=1, num_mini_batches=1, kl_coef=0.1),
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert metrics["objective/kl"] != 0  # the reference (adapters off) differs from the policy (adapters on)
    changed = {key: not torch.equal(p, before[key]) for key, p in
               (((i, n), p) for i, m in enumerate(models) for n, p in m.named_parameters())}
    adapters = [k for k in changed if "lora_" in k[1] or "modules_to_save" in k[1]]
    frozen = [k for k in changed if k not in adapters]
    assert frozen and all(not changed[k] for k in frozen), [k for k in frozen if changed[k]][:3]  # bit-identical
    assert adapters and all(changed[k] for k in adapters if "lora_A" in k[1] or "modules_to_save" in k[1])
    if algo == "ppo":
        assert any(changed[k] for k in adapters if k[0] == 1 and "score" in k[1])  # the value head trains whole


@pytest.mark.parametrize("script", ["ppo.py", "rloo.py"])
def test_a_lora_run_saves_the_merged_model_and_the_adapter_which_give_the_same_logits(script, tmp_path,
                                                                                      tiny_model_dir):
    out = tmp_path / "run"
    result = run_main(script, *TINY, "--model", tiny_model_dir, "--learning-rate", "1e-2", "--lora-r", "4",
                      "--output-dir", out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_merged_is_base_plus_adapter(out / "model", tiny_model_dir, out / "adapter")


@pytest.mark.parametrize("script", ["ppo.py", "rloo.py"])
def test_a_lora_run_resumes_exactly(script, tmp_path):
    full = tmp_path / "full"
    args = [*TINY, "--total-episodes", "64", "--save-every", "2", "--keep-checkpoints", "0", "--lora-r", "4"]
    result = run_main(script, *args, "--output-dir", full)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "iter_000002", resumed / "checkpoints" / "iter_000002")
    rows = (full / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("".join(line + "\n" for line in rows[:3]))
    result = run_script(script, *args, "--output-dir", resumed, "--resume", "latest")
    assert result.returncode == 0, result.stderr[-3000:]

    def strip(path):  # the rows without their wall-clock times
        return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
                for line in (path / "metrics.jsonl").read_text().splitlines()]

    assert strip(resumed) == strip(full)
    for folder in ("model", "adapter"):
        name = "model.safetensors" if folder == "model" else "adapter_model.safetensors"
        a, b = load_file(full / folder / name), load_file(resumed / folder / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("args, flag, words", [
    (["--lora-r", "-1"], "--lora-r", ["rank"]),
    (["--lora-r", "4", "--lora-target-modules", "no_such_proj"], "--lora-target-modules", ["no_such_proj"]),
    (["--lora-r", "4", "--lora-dropout", "0.1"], "--lora-dropout", ["leave it at 0"]),
])
def test_bad_lora_flags_stop_with_one_line(args, flag, words):
    result = run_main("ppo.py", *TINY, *args, "--output-dir", "/tmp/never_written_lora")
    assert_one_line_error(result, flag, *words)


def test_resuming_with_the_other_lora_setting_stops_with_one_line(tmp_path):
    """load_weights, as every script's resume calls it, on a checkpoint written with the other --lora-r setting."""
    tokenizer, policy, frozen_base, _ = lora_models()
    policy.save_pretrained(tmp_path / "lora" / "policy")  # the adapters alone, as a LoRA run's checkpoint holds them
    frozen_base.save_pretrained(tmp_path / "full" / "policy")
    for model, folder, words in ((frozen_base, "lora", "with LoRA"), (policy, "full", "without")):
        with pytest.raises(SystemExit, match=rf"^error: --lora-r \d+: .*{words}.*the run's own --lora-r$"):
            ppo.load_weights(model, tmp_path / folder / "policy")


@pytest.mark.parametrize("lora_r", [0, 4])
def test_gradient_checkpointing_recomputes_the_layers_and_gives_the_same_step(lora_r, monkeypatch):
    results = []
    calls = []
    mlp_class = type(ppo.build_tiny_model(ppo.build_tokenizer()).model.layers[0].mlp)
    forward = mlp_class.forward

    def counted_forward(self, *args, **kwargs):  # counts every run of an MLP, the backward's recomputations too
        calls.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(mlp_class, "forward", counted_forward)
    for checkpointing in (False, True):
        tokenizer = ppo.build_tokenizer()
        torch.manual_seed(0)
        base = ppo.build_tiny_model(tokenizer)
        ref = None if lora_r else copy.deepcopy(base).eval().requires_grad_(False)
        value = ppo.token_classifier_from(base, 1, "--model", "test")
        value.config.pad_token_id = tokenizer.pad_token_id
        memory = ppo.MemoryArgs(lora_r=lora_r, gradient_checkpointing=checkpointing)
        policy = ppo.disable_dropout(ppo.with_lora(base, memory))
        value = ppo.disable_dropout(ppo.with_lora(value, memory))
        calls.clear()
        trained = [p for m in (policy, value) for p in m.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=1e-2, eps=1e-5)
        queries, responses = batch(tokenizer)
        ppo.ppo_step(policy, value, ref, optimizer, queries, responses, torch.linspace(-1, 1, 8),
                     hp=ppo.PPOHParams(num_ppo_epochs=2, num_mini_batches=2, kl_coef=0.1),
                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        results.append(([p.detach().clone() for p in trained], len(calls)))
    (plain, plain_calls), (checkpointed, checkpointed_calls) = results
    assert checkpointed_calls > plain_calls  # the layer ran again in the backward passes
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)


def test_gradient_checkpointing_is_on_for_a_model_loaded_in_eval_mode(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # from_pretrained leaves it in eval mode
    model = ppo.with_lora(model, ppo.MemoryArgs(gradient_checkpointing=True))
    assert model.training and all(layer.gradient_checkpointing for layer in model.model.layers)


@pytest.mark.parametrize("script", ["ppo.py", "rloo.py"])
def test_a_run_with_lora_and_gradient_checkpointing(script, tmp_path, tiny_model_dir):
    result = run_main(script, *TINY, "--model", tiny_model_dir, "--lora-r", "4", "--gradient-checkpointing",
                      "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").exists()


def test_rloo_logprobs_with_checkpointed_layers_equal_the_plain_ones():
    """Each prompt once, its k responses packed after it: with gradient checkpointing as without."""
    tokenizer = ppo.build_tokenizer()
    torch.manual_seed(0)
    model = ppo.build_tiny_model(tokenizer)
    queries, responses = batch(tokenizer, n=8)
    queries = queries[:2]  # 2 prompts x k = 4 responses
    valid = ppo.response_valid_mask(responses, tokenizer.pad_token_id, tokenizer.eos_token_id)
    query_mask = (queries != tokenizer.pad_token_id).cumsum(1) > 0
    plain = rloo.response_logprobs(model, queries, query_mask, responses, valid, 1.0)[0]
    rloo.with_lora(model, rloo.MemoryArgs(gradient_checkpointing=True))
    checkpointed = rloo.response_logprobs(model, queries, query_mask, responses, valid, 1.0)[0]
    plain.sum().backward()  # both differentiable
    checkpointed.sum().backward()
    torch.testing.assert_close(checkpointed[valid], plain[valid], atol=1e-5, rtol=0)
