"""bf16 where it is cheap, fp32 where precision counts: under bf16 autocast the policy's output layer still computes
its logits in fp32, and a bf16 checkpoint trains on fp32 weights; on a CPU, a placed model's attention computes in
fp32, at least as precise as SDPA's bf16 kernels."""

import copy

import pytest
import torch

import ppo
import rloo


def peaked_policy(script):
    """The built-in policy as the script loads it, its (tied) embeddings scaled up so that its logits reach about
    +-10, as a trained policy's do: where bf16's rounding of the logits shows."""
    torch.manual_seed(0)
    tokenizer, policy = script.load_policy("builtin", False)
    with torch.no_grad():
        policy.get_input_embeddings().weight.mul_(8)
    return tokenizer, ppo.disable_dropout(policy)


def batch(tokenizer, k: int = 1):
    """Left-padded queries [P, Lq] (one per prompt), right-padded responses [P * k, 4], all valid."""
    prompts = ["1+2=", "7+8=", "3+3=", "9+0="]
    queries = ppo.left_pad([tokenizer(p).input_ids for p in prompts], tokenizer.pad_token_id)
    responses = torch.randint(4, len(tokenizer), (len(prompts) * k, 4), generator=torch.Generator().manual_seed(0))
    return queries, responses


def fp32_logprobs_of_bf16_hidden(policy, input_ids, attention_mask, responses):
    """The reference: the model's own final hidden states under bf16 autocast, then the output layer and the
    log-softmax in fp32."""
    T = responses.shape[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = policy.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                      position_ids=ppo.position_ids_from(attention_mask)).last_hidden_state
    logits = hidden[:, -T - 1:-1].float() @ policy.get_output_embeddings().weight.T  # [B, T, V] in fp32
    return logits.log_softmax(-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def test_logits_stay_fp32_under_bf16_autocast():
    """Whatever calls the policy under bf16 autocast (rollout, evaluation, the update) gets fp32 logits."""
    tokenizer, policy = peaked_policy(ppo)
    queries, _ = batch(tokenizer)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert policy(input_ids=queries).logits.dtype == torch.float32


@pytest.mark.parametrize("script", [ppo, rloo])
def test_bf16_logprobs_are_the_fp32_softmax_of_the_hidden_states(script):
    """Under bf16 autocast, the update's logprobs equal the fp32 log-softmax of the fp32 projection of the model's
    final hidden states: no bf16 rounding after the last layer. Rounded to bf16 (3 significant digits), logits of
    +-10 are off by up to 0.03, and so are the logprobs whose differences make the ratio and the KL."""
    tokenizer, policy = peaked_policy(script)
    k = 1 if script is ppo else 2
    queries, responses = batch(tokenizer, k)
    query_mask = ((queries != tokenizer.pad_token_id).cumsum(1) > 0).long()
    input_ids = torch.cat([queries.repeat_interleave(k, 0), responses], 1)
    attention_mask = torch.cat([query_mask.repeat_interleave(k, 0), torch.ones_like(responses)], 1)
    expected = fp32_logprobs_of_bf16_hidden(policy, input_ids, attention_mask, responses)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        if script is ppo:
            logprobs, _ = ppo.response_logprobs(policy, input_ids, attention_mask, responses, 1.0)
        else:
            logprobs, _ = rloo.shared_prefix_logprobs(policy, queries, responses, torch.ones_like(responses).bool(),
                                                      tokenizer.pad_token_id, 1.0)
    assert expected.abs().max() > 1  # peaked enough for bf16 logits to be visibly rounded
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)


def test_fp32_logits_are_unchanged():
    """In fp32 the output layer computes exactly what the model's own forward computes."""
    tokenizer, policy = peaked_policy(ppo)
    torch.manual_seed(0)
    plain = ppo.build_tiny_model(tokenizer)
    with torch.no_grad():
        plain.get_input_embeddings().weight.mul_(8)
    queries, _ = batch(tokenizer)
    with torch.no_grad():
        assert torch.equal(policy(input_ids=queries).logits, plain(input_ids=queries).logits)


def test_a_copy_of_the_policy_projects_with_its_own_weights():
    """The reference policy is a deepcopy of the policy: its output layer uses its own weights, not the policy's."""
    tokenizer, policy = peaked_policy(ppo)
    ref = copy.deepcopy(policy)
    queries, _ = batch(tokenizer)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = ref(input_ids=queries).logits
        policy.get_output_embeddings().weight.add_(1.0)
        assert torch.equal(ref(input_ids=queries).logits, before)
        assert not torch.equal(policy(input_ids=queries).logits, before)


def test_a_bf16_checkpoint_trains_on_fp32_weights(tmp_path):
    """A policy saved in bf16 (as most hub checkpoints are) loads with fp32 weights, so AdamW's small steps are not
    rounded away: at lr 3e-6, bf16 weights of 0.01-1 keep most updates below their resolution."""
    tokenizer = ppo.build_tokenizer()
    ppo.build_tiny_model(tokenizer).to(torch.bfloat16).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    for script in (ppo, rloo):
        _, policy = script.load_policy(str(tmp_path), False)
        assert {p.dtype for p in policy.parameters()} == {torch.float32}


def attention_dtypes_and_grads(dtype: str, placed: bool) -> tuple[set, list]:
    """The dtypes that attention hands each layer's output projection in one forward and backward pass of the
    peaked built-in policy under ppo.autocast(dtype, cpu) (placed by ppo.place, or not), and the gradients of the
    policy's weights."""
    tokenizer, policy = peaked_policy(ppo)
    if placed:
        ppo.place([policy], torch.device("cpu"), False, 1)
    queries, responses = batch(tokenizer)
    seen = set()
    for layer in policy.model.layers:
        layer.self_attn.o_proj.register_forward_pre_hook(lambda module, args: seen.add(args[0].dtype))
    with ppo.autocast(dtype, torch.device("cpu")):
        logprobs, _ = ppo.response_logprobs(policy, torch.cat([queries, responses], 1),
                                            torch.ones(4, queries.shape[1] + 4, dtype=torch.long), responses, 1.0)
    logprobs.sum().backward()
    return seen, [p.grad.clone() for p in policy.parameters()]


@pytest.mark.parametrize("dtype, placed, attention", [
    ("bf16", True, torch.float32),  # placed on a CPU: fp32_sdpa
    ("bf16", False, torch.bfloat16),  # a model nobody placed keeps SDPA as autocast runs it
    ("fp32", True, torch.float32),
])
def test_placed_models_compute_attention_in_fp32_under_bf16_on_cpu(dtype, placed, attention):
    """On a CPU under bf16 autocast, a model placed by ppo.place (and rloo.place: the same code) computes attention
    in fp32 (fp32_sdpa; faster there than SDPA's bf16 kernels, benchmarks/attention_kernels.py), its passes with
    and without gradients alike, so that every logprob the update compares comes from one kernel."""
    seen, _ = attention_dtypes_and_grads(dtype, placed)
    assert seen == {attention}


def test_fp32_attention_is_at_least_as_precise():
    """The gradients of a bf16 update pass are at least as close to fp32's with attention in fp32 as with SDPA in
    bf16 (about 0.7% of each weight's gradient norm here: bf16's rounding elsewhere in the model)."""
    _, fp32_grads = attention_dtypes_and_grads("fp32", True)
    distances = {}
    for name, placed in (("fp32 attention", True), ("bf16 attention", False)):
        _, grads = attention_dtypes_and_grads("bf16", placed)
        distances[name] = max(((a - b).norm() / b.norm()).item() for a, b in zip(grads, fp32_grads) if b.norm() > 0)
    assert distances["fp32 attention"] <= 1.05 * distances["bf16 attention"] < 0.02


def test_fp32_sdpa_leaves_long_passes_and_other_implementations_alone():
    """Over more than 512 keys fp32_sdpa is SDPA as autocast runs it (bf16's flash kernel is the faster there), but
    for one query per row (a decode step) it stays in fp32 at any length; a model with eager attention keeps it."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = ppo.fp32_attention(LlamaForCausalLM(config).eval())
    seen = []
    model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    with torch.no_grad(), ppo.autocast("bf16", torch.device("cpu")):
        for length in (512, 513):
            cache = DynamicCache(config=config)
            model(input_ids=torch.ones(1, length, dtype=torch.long), past_key_values=cache, use_cache=True)
            model(input_ids=torch.ones(1, 1, dtype=torch.long), past_key_values=cache, use_cache=True)
    assert seen == [torch.float32, torch.float32, torch.bfloat16, torch.float32]
    config._attn_implementation = "eager"
    assert ppo.fp32_attention(LlamaForCausalLM(config)).config._attn_implementation == "eager"
