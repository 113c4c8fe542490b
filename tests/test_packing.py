"""Each prompt once, its responses packed after it: the update's forwards pack each group's real tokens into one
segment (packed_inputs, pack_segments), and the result equals the padded forward's within float noise: logprobs,
entropies and values of several architectures (sliding windows, Gemma 2's soft-capped logits and eager attention),
at every row width, with a group whose responses are all empty and one whose prompt fills its row; and whole
ppo_step and rloo_step updates (every loss type, LoRA, gradient checkpointing) in their losses and in the weights
they leave. (FSDP2 with 2 processes: tests/test_distributed.py's one-step test runs the packed path against 1
process.)"""

import contextlib
import copy

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    BloomForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    Lfm2Config,
    Lfm2ForCausalLM,
    LlamaConfig,
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
def padded(*models):
    """The models' forwards padded (in ppo.py and rloo.py alike), as for a model that fails the packing check: their
    "packs" check set to False for the while."""
    checks = [vars(m).setdefault("checks", {}) for m in dict.fromkeys(models) if m is not None]
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
    longest, two of one token), so that rows hold several groups."""
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
    "gemma2, a window of 4 every other layer": lambda v: Gemma2ForCausalLM(Gemma2Config(
        vocab_size=v, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=4)),  # soft-capped logits, eager attention
}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_packed_logprobs_equal_the_padded_forward_at_every_width(arch, k):
    """Groups of k responses, the first group's all empty; at the narrowest width the longest group fills its row."""
    torch.manual_seed(0)
    model = ppo.fp32_output_layer(ARCHITECTURES[arch](20).eval())
    queries, responses = uneven_batch(20, k, prompts=5, width=10)
    queries, responses[:k] = queries[::k], 0  # [P, 10]; the first group: no response tokens at all
    query_mask, valid = (queries != 0).cumsum(1) > 0, responses != 0
    value = ppo.token_classifier_from(model, 1, "--model", "test").eval()  # its config asks for a cache by default
    with torch.no_grad(), padded(model, value):
        plain = ppo.response_logprobs(model, queries, query_mask, responses, valid, 0.7, (0, 1.0, 0.0), True,
                                      chunk=2 ** 20)
        plain += (ppo.response_values(value, queries, query_mask, responses, valid),)
    with torch.no_grad():
        chosen = ppo.response_logprobs(model, queries, query_mask, responses, valid, 0.7, (0, 1.0, 0.0), True,
                                       chunk=2 ** 20)
        chosen += (ppo.response_values(value, queries, query_mask, responses, valid),)
        assert vars(model)["checks"]["packs"] and vars(value)["checks"]["packs"]
        inputs, _ = ppo.packed_inputs(model, queries, query_mask, responses, valid)
        real = int(query_mask.sum() + valid.sum())  # each group's prompt once
        assert inputs["input_ids"].numel() < 1.5 * real < torch.cat([queries.repeat_interleave(k, 0), responses],
                                                                    1).numel()
        longest = int((query_mask.sum(1) + valid.sum(1).view(-1, k).sum(1)).max())
        for width in (longest, 2 * longest, 3 * longest):
            inputs, index = ppo.pack_segments(model, queries, query_mask, responses, valid, width=width)
            assert inputs["input_ids"].shape[1] == width
            h, head = ppo.forward_to_head(model, index[valid], 2 ** 20, **inputs)
            at_width = ppo.over_logits([head], [h], responses, lambda x, t: ppo.token_logprobs(
                x, t, 0.7, (0, 1.0, 0.0), True), 2 ** 20, valid)
            inputs, index = ppo.pack_segments(value, queries, query_mask, responses, valid, width=width)
            values = value(**inputs).logits.flatten(0, 1)[index, 0]
            for a, b in zip((*at_width, values), plain):
                assert (a - b)[valid].abs().max() < 1e-5
    for a, b in zip(chosen, plain):
        assert (a - b)[valid].abs().max() < 1e-5
    assert all((a[~valid] == 0).all() for a in chosen[:-1])  # no logprob computed where nothing is scored


def test_long_responses_stay_in_one_segment_after_their_prompt():
    """8 responses of 56-64 tokens (the tiny model's hidden size of 64, where the attention's square over a group's
    row outweighs its layers) still go in one segment after one copy of their prompt, equal to the padded forward."""
    torch.manual_seed(0)
    model = ppo.build_tiny_model(ppo.build_tokenizer()).eval()
    queries, responses = torch.randint(5, 20, (2, 5)), torch.randint(5, 20, (16, 64))
    valid = torch.arange(64)[None] < torch.randint(56, 65, (16, 1))
    responses, query_mask = responses * valid, torch.ones_like(queries, dtype=torch.bool)
    inputs, _ = ppo.pack_segments(model, queries, query_mask, responses, valid)
    assert int(((inputs["position_ids"] == 0) & (inputs["input_ids"] != 0)).sum()) == 2  # each prompt once
    with torch.no_grad():
        packed = ppo.response_logprobs(model, queries, query_mask, responses, valid, 1.0)[0]
        with padded(model):
            plain = ppo.response_logprobs(model, queries, query_mask, responses, valid, 1.0)[0]
    assert (packed - plain).abs().max() < 1e-5


def test_at_a_reasoning_shape_of_smollm2_each_prompt_is_packed_once():
    """At SmolLM2's hidden size (576), 4 prompts of 150-250 tokens with 8 responses of 150-256 each: one segment per
    group, each prompt once (docs/benchmarks.md: segments of fewer responses, each after its own copy of the prompt,
    measured slower at this shape)."""
    config = LlamaConfig(vocab_size=64, hidden_size=576, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        n_q, n_r = torch.randint(150, 251, (4,), generator=g), torch.randint(150, 257, (32,), generator=g)
        query_mask = torch.arange(int(n_q.max()))[None] >= (n_q.max() - n_q)[:, None]  # left padding
        valid = torch.arange(256)[None] < n_r[:, None]
        inputs, _ = ppo.pack_segments(model, query_mask * 5, query_mask, valid * 7, valid)
        assert int(((inputs["position_ids"] == 0) & (inputs["input_ids"] == 5)).sum()) == 4
        assert inputs["input_ids"].numel() < 1.1 * int(query_mask.sum() + valid.sum())


def test_a_batch_with_no_response_token_gives_zeros():
    """A micro-batch whose responses are all empty (pad first, pad != EOS) scores nothing: no positions, no crash."""
    model = ppo.build_tiny_model(ppo.build_tokenizer()).eval()
    queries, responses = torch.randint(5, 20, (2, 4)), torch.zeros(4, 3, dtype=torch.long)
    for chunk in (0, 2 ** 20):
        logprobs, entropy = ppo.response_logprobs(model, queries, queries != 0, responses, responses != 0, 1.0,
                                                  with_entropy=True, chunk=chunk)
        assert logprobs.shape == entropy.shape == (4, 3) and not logprobs.any() and not entropy.any()
    assert "head" not in vars(model)["checks"]  # nothing to check the output layer on: checked at the next batch


def test_the_layout_holds_each_prompt_once_and_its_responses_see_it_and_themselves_only():
    """pack_segments on a hand-made batch: two groups of k = 2, the rows and the mask written out."""
    queries = torch.tensor([[0, 7, 8], [9, 10, 11]])  # prompts of 2 and 3 tokens
    responses = torch.tensor([[12, 13], [14, 0], [15, 0], [0, 0]])  # group 0: 2 and 1 tokens; group 1: 1 and 0
    model = ppo.build_tiny_model(ppo.build_tokenizer())
    inputs, index = ppo.pack_segments(model, queries, queries != 0, responses, responses != 0, width=9)
    assert inputs["input_ids"].tolist() == [[7, 8, 12, 13, 14, 9, 10, 11, 15]]  # 5 + 4 tokens: one row of 9
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 2, 0, 1, 2, 3]]  # a response goes on from its prompt
    assert index.tolist() == [[1, 2], [1, 4], [7, 8], [7, 8]]  # response 1: scored after the prompt, then itself
    mask = inputs["attention_mask"][0, 0].int()  # [9, 9]: query along rows, key along columns
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0, 0, 0, 0],
                             [1, 1, 1, 0, 0, 0, 0, 0, 0],
                             [1, 1, 1, 1, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 1, 0, 0, 0, 0],  # a sibling response's tokens: not seen
                             [0, 0, 0, 0, 0, 1, 0, 0, 0],  # another group: not seen
                             [0, 0, 0, 0, 0, 1, 1, 0, 0],
                             [0, 0, 0, 0, 0, 1, 1, 1, 0],
                             [0, 0, 0, 0, 0, 1, 1, 1, 1]]


PACK = ARCHITECTURES
REFUSED = {  # a forward that fails with a 4D mask, or whose attention depends on places in the row (ALiBi in MPT)
    "falcon, ALiBi": lambda v: FalconForCausalLM(FalconConfig(
        vocab_size=v, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True, multi_query=True)),
    "bloom, ALiBi": lambda v: BloomForCausalLM(BloomConfig(vocab_size=v, hidden_size=32, n_layer=2, n_head=4)),
    "lfm2, short convolutions": lambda v: Lfm2ForCausalLM(Lfm2Config(
        vocab_size=v, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, layer_types=["conv", "full_attention"] * 2)),
    "mpt": lambda v: MptForCausalLM(MptConfig(vocab_size=v, d_model=32, n_layers=2, n_heads=4))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", [*PACK, *REFUSED])
def test_the_packing_check_packs_only_models_that_keep_segments_apart(arch, dtype):
    """The check packs a sequence of the batch after another group and after a sibling response, and compares every
    position that scores its response with its forward alone. Where it refuses, packing would fail or leak; where
    it packs, the packed forward equals the padded one."""
    torch.manual_seed(0)
    model = (PACK | REFUSED)[arch](20).eval().to(dtype)
    queries, responses = uneven_batch(20, 2, prompts=3, width=2)  # within a convolution's reach of the row's end
    queries, query_mask, valid = queries[::2], (queries[::2] != 0).cumsum(1) > 0, responses != 0
    logprobs = lambda: ppo.response_logprobs(model, queries, query_mask, responses, valid, 1.0, chunk=0)[0]
    with torch.no_grad():
        packed = logprobs()
        assert vars(model)["checks"]["packs"] is (arch in PACK)
        vars(model)["checks"]["packs"] = True  # what packing would give
        try:
            forced = logprobs()
        except Exception:  # the forward takes no 4D mask (or no dict of them)
            forced = None
        with padded(model):
            plain = logprobs()
    tol = 1e-5 if dtype == torch.float32 else 1e-3  # packed forwards here round as padded ones do
    assert (forced is None or bool((forced - plain).abs().max() > tol)) == (arch in REFUSED)
    assert (packed - plain).abs().max() < tol


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
    with padded(*models) if pad else contextlib.nullcontext():
        metrics = step()
        assert vars(policy)["checks"]["packs"] is not pad  # packed or not
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


def test_a_query_with_no_tokens_is_refused():
    """A response's first token is scored at its prompt's last: a query of no tokens has none, and the packed row
    scored it at the last token of the group packed before it (its logprobs moved with that group's tokens)."""
    model = ppo.build_tiny_model(ppo.build_tokenizer())
    queries, responses = torch.tensor([[5, 6, 7], [0, 0, 0]]), torch.tensor([[8, 9], [10, 11], [12, 13], [14, 15]])
    for module in (ppo, rloo):
        with pytest.raises(ValueError, match="no tokens"):
            module.response_logprobs(model, queries, queries != 0, responses, responses != 0, 1.0)


def test_a_width_narrower_than_the_longest_segment_is_refused():
    """A segment never spills into the next row: without the check, a width of 4 for a group of 5 tokens wrote its
    last token over the next group's prompt ([[7, 8, 12, 13], [14, 15, 16, 0]]), with no error."""
    model = ppo.build_tiny_model(ppo.build_tokenizer())
    queries, responses = torch.tensor([[7, 8], [0, 9]]), torch.tensor([[12, 13], [14, 0], [15, 0], [16, 0]])
    with pytest.raises(ValueError):
        ppo.pack_segments(model, queries, queries != 0, responses, responses != 0, width=4)
    inputs, _ = ppo.pack_segments(model, queries, queries != 0, responses, responses != 0, width=5)
    assert inputs["input_ids"].tolist() == [[7, 8, 12, 13, 14], [9, 15, 16, 0, 0]]
