"""bf16 where it is cheap, fp32 where precision counts: under bf16 autocast the policy's output layer still computes
its logits in fp32, and a bf16 checkpoint trains on fp32 weights; nothing else about a model changes."""

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


def test_logits_stay_fp32_under_bf16_autocast():
    """Whatever calls the policy under bf16 autocast (rollout, evaluation, the update) gets fp32 logits."""
    tokenizer, policy = peaked_policy(ppo)
    queries, _ = batch(tokenizer)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert policy(input_ids=queries).logits.dtype == torch.float32


@pytest.mark.parametrize("chunk", [0, 64])
@pytest.mark.parametrize("script", [ppo, rloo])
def test_bf16_logprobs_are_the_fp32_softmax_of_the_hidden_states(script, chunk):
    """Under bf16 autocast, the update's logprobs (all logits at once, or --logits-chunk at a time) equal the fp32
    log-softmax of the fp32 projection of the final hidden states the script's own forward computes: no bf16 rounding
    after the last layer. Rounded to bf16 (3 significant digits), logits of +-10 are off by up to 0.03, and so are the
    logprobs whose differences make the ratio and the KL. (The hidden states come from the script's packed forward:
    a padded one's differ by bf16 rounding on some CPUs, and this test is about what comes after them.)"""
    tokenizer, policy = peaked_policy(script)
    k = 1 if script is ppo else 2
    queries, responses = batch(tokenizer, k)
    query_mask = ((queries != tokenizer.pad_token_id).cumsum(1) > 0).long()
    valid = torch.ones_like(responses, dtype=torch.bool)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden, head = script.response_hidden(policy, queries, query_mask, responses, valid, chunk=1)  # [B * T, H]
        logprobs, _ = script.response_logprobs(policy, queries, query_mask, responses, valid, 1.0, chunk=chunk)
    assert head is policy.get_output_embeddings()
    logits = hidden.reshape(*responses.shape, -1).float() @ head.weight.T  # [B, T, V] in fp32
    expected = logits.log_softmax(-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
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


def test_placing_a_model_keeps_its_attention_and_its_forward():
    """ppo.place moves a model and turns dropout off; its attention implementation stays the one from_pretrained
    gave it, and no module's forward is replaced (the output layer's fp32 wrapper, from loading, aside)."""
    _, policy = ppo.load_policy("builtin", False)
    own = {name: m.__dict__.get("forward") for name, m in policy.named_modules()}
    before = policy.config._attn_implementation
    ppo.place([policy], torch.device("cpu"), False, 1)
    with ppo.autocast("bf16", torch.device("cpu")):
        policy(input_ids=torch.tensor([[1, 5, 6]]))
    assert policy.config._attn_implementation == before == "sdpa"
    assert {name: m.__dict__.get("forward") for name, m in policy.named_modules()} == own
    assert [name for name, forward in own.items() if forward is not None] == ["lm_head"]
