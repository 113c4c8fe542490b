"""No pass over padding: the update's forwards pack each row's real tokens (packed_inputs), and the result equals the
padded forward's within float noise: logprobs of several architectures (a sliding window too), and whole ppo_step and
rloo_step updates (every loss type, LoRA, gradient checkpointing) in their losses and in the weights they leave.
(FSDP2 with 2 processes: tests/test_distributed.py's one-step test runs the packed path against 1 process.)"""

import contextlib
import copy

import pytest
import torch
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    Lfm2Config,
    Lfm2ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MptConfig,
    MptForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import ppo
import rloo


@contextlib.contextmanager
def padded(script, *models):
    """The models' forwards in `script` (the module ppo or rloo) as before packing: their "packs" check set to False
    for the while."""
    checks = [script.CHECKED.setdefault(m, {}) for m in dict.fromkeys(models) if m is not None]
    saved = [checked.get("packs") for checked in checks]
    for checked in checks:
        checked["packs"] = False
    try:
        yield
    finally:
        for checked, value in zip(checks, saved):
            checked.pop("packs")
            if value is not None:
                checked["packs"] = value


def uneven_batch(vocab: int, k: int = 1, prompts: int = 6, width: int = 6, seed: int = 0) -> tuple:
    """Left-padded queries [P * k, width] and right-padded responses [P * k, 8] of different lengths (one the
    longest, two of one token): padded enough that packing computes fewer positions (rloo.py: than the shared prefix
    too), and rows share a packed row."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 8, (prompts * k,), generator=generator)
    lengths[0], lengths[1:3] = 8, 1
    queries = torch.randint(5, vocab, (prompts, width), generator=generator)
    queries[: prompts // 2, :1] = 0  # pad 0
    responses = torch.randint(5, vocab, (prompts * k, 8), generator=generator)
    responses[torch.arange(8)[None] >= lengths[:, None]] = 0
    return queries.repeat_interleave(k, 0), responses


ARCHITECTURES = {
    "llama": lambda v: ppo.build_tiny_model(ppo.build_tokenizer()),
    "gpt2": lambda v: GPT2LMHeadModel(GPT2Config(vocab_size=v, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                                                 eos_token_id=2)),
    "qwen2": lambda v: Qwen2ForCausalLM(Qwen2Config(vocab_size=v, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)),
    "mistral, a window of 4": lambda v: MistralForCausalLM(MistralConfig(
        vocab_size=v, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, sliding_window=4)),
}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_packed_logprobs_equal_the_padded_forward(arch):
    torch.manual_seed(0)
    model = ppo.fp32_output_layer(ARCHITECTURES[arch](20).eval())
    queries, responses = uneven_batch(20)
    ids = torch.cat([queries, responses], 1)
    mask = torch.cat([(queries != 0).cumsum(1) > 0, responses != 0], 1).long()
    value = ppo.token_classifier_from(model, 1, "--model", "test").eval()  # its config asks for a cache by default
    with torch.no_grad():
        packed = ppo.response_logprobs(model, ids, mask, responses, 0.7, (0, 1.0, 0.0), True, chunk=2 ** 20)
        packed += (ppo.response_values(value, ids, mask, responses.shape[1]),)
        inputs, _ = ppo.packed_inputs(model, ids, mask, responses.shape[1])
        assert "attention_mask" not in inputs and inputs["input_ids"].numel() < ids.numel()  # it did pack
        starts = (inputs["position_ids"] == 0) & (inputs["input_ids"] != 0)  # sequences' first tokens
        assert (starts.sum(1) >= 2).any()  # some row holds two sequences: they must not see each other
        with padded(ppo, model, value):
            plain = ppo.response_logprobs(model, ids, mask, responses, 0.7, (0, 1.0, 0.0), True, chunk=2 ** 20)
            plain += (ppo.response_values(value, ids, mask, responses.shape[1]),)
    valid = responses != 0
    for a, b in zip(packed, plain):
        assert (a - b)[valid].abs().max() < 1e-5
    assert all((a[~valid] == 0).all() for a in packed[:-1])  # no logprob computed where nothing is scored


PACK = {**ARCHITECTURES, "falcon, ALiBi": lambda v: FalconForCausalLM(FalconConfig(
    vocab_size=v, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True, multi_query=True))}
LEAK = {  # at transformers' default initialisation: their states carry little position information
    "bloom, ALiBi": lambda v: BloomForCausalLM(BloomConfig(vocab_size=v, hidden_size=32, n_layer=2, n_head=4)),
    "lfm2, short convolutions": lambda v: Lfm2ForCausalLM(Lfm2Config(
        vocab_size=v, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, layer_types=["conv", "full_attention"] * 2)),
    "mpt": lambda v: MptForCausalLM(MptConfig(vocab_size=v, d_model=32, n_layers=2, n_heads=4))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", [*PACK, *LEAK])
def test_the_packing_check_packs_only_models_that_keep_packed_sequences_apart(arch, dtype):
    """The check puts another sequence before one of the batch and compares every position of it with its forward
    alone. A sequence twice, compared at its last logits, let BLOOM and LFM2 pack (logprobs off by up to 3e-3 against
    the padded forward); its 1e-4 left bf16 weights padded (Falcon's ALiBi rounds otherwise). In bf16 the tolerance
    is 2 units of rounding: leaks below that pass (bf16 BLOOM and LFM2), and so they are left out there."""
    if dtype == torch.bfloat16 and arch in LEAK and arch != "mpt":
        pytest.skip("a leak under bf16's rounding")
    torch.manual_seed(0)
    model = (PACK | LEAK)[arch](20).eval().to(dtype)
    queries, responses = uneven_batch(20, width=2)  # responses within a convolution's reach of the row's last sequence
    ids = torch.cat([queries, responses], 1)
    mask = torch.cat([(queries != 0).cumsum(1) > 0, responses != 0], 1).long()
    with torch.no_grad():
        packed = ppo.response_logprobs(model, ids, mask, responses, 1.0, chunk=0)[0]
        assert ppo.CHECKED[model]["packs"] is (arch in PACK)
        ppo.CHECKED[model]["packs"] = True  # what packing would give
        forced = ppo.response_logprobs(model, ids, mask, responses, 1.0, chunk=0)[0]
        with padded(ppo, model):
            plain = ppo.response_logprobs(model, ids, mask, responses, 1.0, chunk=0)[0]
    if dtype == torch.float32:  # the check is right: packing leaks exactly where it refused
        assert bool((forced - plain).abs().max() > 1e-5) == (arch in LEAK)
        assert (packed - plain).abs().max() < 1e-5


def run_step(script: str, settings: dict, lora: bool, checkpointing: bool, pad: bool) -> tuple:
    """One update on a fixed uneven batch: (its metrics, the weights it leaves)."""
    tokenizer = ppo.build_tokenizer()
    torch.manual_seed(0)
    memory = ppo.MemoryArgs(lora_r=4 if lora else 0, gradient_checkpointing=checkpointing)
    base = ppo.build_tiny_model(tokenizer)
    ref = None if lora else copy.deepcopy(base).eval().requires_grad_(False)
    with torch.no_grad():  # a policy away from its reference: a KL that is not 0
        for p in base.parameters():
            p.add_(0.02 * torch.randn_like(p))
    value = ppo.token_classifier_from(base, 1, "--model", "test")  # before LoRA wraps base's layers
    policy = ppo.disable_dropout(ppo.with_lora(ppo.fp32_output_layer(base), memory))
    k = 1 if script == "ppo" else 4
    queries, responses = uneven_batch(len(tokenizer), k, prompts=4 if k > 1 else 8, width=3 if k > 1 else 6)
    rewards = torch.randn(len(responses), generator=torch.Generator().manual_seed(1))
    models = [policy, ref]
    if script == "ppo":
        value = ppo.disable_dropout(ppo.with_lora(value, memory))
        models.append(value)
        optimizer = ppo.adamw([policy, value], 1e-2, 0.0)
        step = lambda: ppo.ppo_step(policy, value, ref, optimizer, queries, responses, rewards, pad_token_id=0,
                                    eos_token_id=2, hp=ppo.PPOHParams(**settings))
    else:
        optimizer = ppo.adamw([policy], 1e-2, 0.0)
        step = lambda: rloo.rloo_step(policy, ref, optimizer, queries, responses, rewards, pad_token_id=0,
                                      eos_token_id=2, hp=rloo.RLOOHParams(**settings))
    module = ppo if script == "ppo" else rloo
    with padded(module, *models) if pad else contextlib.nullcontext():
        metrics = step()
        assert module.CHECKED[policy]["packs"] is not pad  # packed or not
    return metrics, [p.detach().clone() for m in models if m is not None for p in m.parameters() if p.requires_grad]


CASES = [("ppo", {"num_ppo_epochs": 2, "num_mini_batches": 2}), ("ppo", {"num_ppo_epochs": 1, "num_mini_batches": 1}),
         *[("rloo", {"loss_type": loss, "kl_in_reward": False, "kl_estimator": "k3", "num_mini_batches": 2,
                     "num_ppo_epochs": 2}) for loss in ("dapo", "grpo", "bnpo", "dr_grpo")],
         ("rloo", {}), ("rloo", {"top_k": 5, "importance_sampling_level": "sequence", "loss_type": "grpo"})]


@pytest.mark.parametrize("variant", ["full", "lora", "checkpointing"])
@pytest.mark.parametrize("script, settings", CASES, ids=[f"{s}-{i}" for i, (s, _) in enumerate(CASES)])
def test_an_update_on_packed_sequences_equals_the_padded_update(script, settings, variant):
    lora, checkpointing = variant == "lora", variant == "checkpointing"
    packed_metrics, packed_weights = run_step(script, settings, lora, checkpointing, pad=False)
    padded_metrics, padded_weights = run_step(script, settings, lora, checkpointing, pad=True)
    for key, value in padded_metrics.items():  # a clip fraction counts ties (a value at its old one) broken by noise
        assert packed_metrics[key] == pytest.approx(value, rel=1e-4, abs=0.05 if "clipfrac" in key else 1e-5), key
    assert max((a - b).abs().max().item() for a, b in zip(packed_weights, padded_weights)) < 1e-5
