"""rloo.py's pure helpers against hand-computed values, and rloo_step on real tiny models."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

import ppo
import rloo


def test_leave_one_out_baselines_k2_and_k4_hand_computed():
    # k = 2: the baseline of each sample is the other sample's reward
    adv, base = rloo.group_advantages(torch.tensor([1.0, 3.0, 0.5, 0.5]), 2, "leave_one_out", "none")
    torch.testing.assert_close(base, torch.tensor([3.0, 1.0, 0.5, 0.5]))
    torch.testing.assert_close(adv, torch.tensor([-2.0, 2.0, 0.0, 0.0]))
    # k = 4: prompt 0 has rewards 1, 2, 3, 6 (sum 12): baselines 11/3, 10/3, 3, 2; prompt 1 is all equal
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.7, 0.7, 0.7, 0.7])
    adv, base = rloo.group_advantages(rewards, 4, "leave_one_out", "none")
    torch.testing.assert_close(base, torch.tensor([11 / 3, 10 / 3, 3.0, 2.0, 0.7, 0.7, 0.7, 0.7]))
    torch.testing.assert_close(adv, torch.tensor([1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0]))
    assert adv.view(2, 4).sum(1).abs().max() < 1e-6  # leave-one-out advantages sum to zero per prompt


def tiny_gpt2(tokenizer):
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    return rloo.disable_dropout(AutoModelForCausalLM.from_config(config))


def test_sequence_rewards_add_the_aggregated_step_scores():
    scores = torch.tensor([1.0, 0.0, 0.5])
    process = [[(3, 0.5), (7, 0.2)], [], [(4, 0.9)]]  # (token index where the step ends, PRM score)
    for aggregate, expected in [("min", [1.1, 0.0, 0.95]), ("mean", [1.175, 0.0, 0.95]), ("last", [1.1, 0.0, 0.95])]:
        torch.testing.assert_close(rloo.sequence_rewards(scores, process, aggregate, 0.5), torch.tensor(expected))
    assert rloo.sequence_rewards(scores, None, "min", 0.5) is scores


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_each_prompt_once_equals_forwarding_each_prompt_k_times(arch):
    """Each prompt forwarded once, its k responses packed after it: the logprobs and their gradients are those of
    each prompt repeated k times, forwarded with its response (by the model directly, and by ppo.py's k = 1 path)."""
    torch.manual_seed(0)
    tokenizer = rloo.build_tokenizer()
    model = rloo.build_tiny_model(tokenizer) if arch == "llama" else tiny_gpt2(tokenizer)
    pad = tokenizer.pad_token_id
    queries = rloo.left_pad([tokenizer("3+4=").input_ids, tokenizer("12+3=").input_ids], pad)
    responses = torch.randint(4, len(tokenizer), (6, 5))
    responses[0, 3:] = pad
    valid = responses != pad
    query_mask = (queries != pad).cumsum(1) > 0
    once, entropy = rloo.response_logprobs(model, queries, query_mask, responses, valid, 0.7, with_entropy=True)
    (once * valid).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # the plain way: each prompt repeated k = 3 times and forwarded with its response
    repeated = queries.repeat_interleave(3, 0)
    mask = torch.cat([(repeated != pad).cumsum(1) > 0, valid], 1).long()
    logits = model(input_ids=torch.cat([repeated, responses], 1), attention_mask=mask,
                   position_ids=rloo.position_ids_from(mask)).logits[:, queries.shape[1] - 1:-1] / 0.7
    plain = logits.log_softmax(-1).gather(-1, responses[..., None])[..., 0]
    (plain * valid).sum().backward()
    torch.testing.assert_close(once[valid], plain[valid], atol=1e-5, rtol=1e-5)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4)
    assert entropy.shape == (6, 5) and (entropy >= 0).all()
    with torch.no_grad():  # ppo.py's forward of the same rows, each prompt k times
        repeated_logprobs, repeated_entropy = ppo.response_logprobs(model, repeated, query_mask.repeat_interleave(3, 0),
                                                                    responses, valid, 0.7, with_entropy=True)
    torch.testing.assert_close(once, repeated_logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, repeated_entropy, atol=1e-5, rtol=1e-5)


def make_models(seed=0):
    torch.manual_seed(seed)
    tokenizer = rloo.build_tokenizer()
    policy = rloo.build_tiny_model(tokenizer)
    ref = rloo.build_tiny_model(tokenizer).requires_grad_(False)
    return tokenizer, policy, ref, torch.optim.AdamW(policy.parameters(), lr=1e-2)


def batch(tokenizer, prompts=4, k=4):
    queries = rloo.left_pad([tokenizer(f"{i}+{i % 3}=").input_ids for i in range(prompts)], tokenizer.pad_token_id)
    responses = torch.randint(4, len(tokenizer), (prompts * k, 5))
    responses[:, 3] = tokenizer.eos_token_id
    responses[:, 4] = tokenizer.pad_token_id
    return queries.repeat_interleave(k, 0), responses


EXPECTED = {"objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
            "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg", "loss/policy_avg",
            "loss/kl_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens", "val/response_length",
            "policy/clipfrac_low_avg", "policy/clipfrac_high_avg", "val/truncated_frac", "rloo/baseline_avg",
            "rloo/advantage_std", "rloo/frac_equal_groups", "loss/nonfinite_skipped", "policy/loss_token_frac"}


@pytest.mark.parametrize("hp", [rloo.RLOOHParams(), rloo.RLOOHParams(kl_in_reward=False, kl_estimator="k3"),
                                rloo.RLOOHParams(num_ppo_epochs=2, num_mini_batches=2, gradient_accumulation_steps=2,
                                                 scale_rewards="batch")])
def test_rloo_step_changes_parameters_and_returns_finite_metrics(hp):
    tokenizer, policy, ref, optimizer = make_models()
    queries, responses = batch(tokenizer)
    before = [p.detach().clone() for p in policy.parameters()]
    for rewards in (torch.randn(16), torch.randn(16, 5)):
        metrics = rloo.rloo_step(policy, ref, optimizer, queries, responses, rewards, hp=hp,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        assert set(metrics) == EXPECTED and all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["val/num_eos_tokens"] == 16 and metrics["val/response_length"] == 4
    assert all(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def test_all_equal_groups_give_no_update_signal():
    tokenizer, policy, ref, optimizer = make_models()
    queries, responses = batch(tokenizer)
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4 + [0.5] * 4 + [2.0] * 4)
    metrics = rloo.rloo_step(policy, ref, optimizer, queries, responses, rewards,
                             hp=rloo.RLOOHParams(kl_coef=0.0), pad_token_id=tokenizer.pad_token_id)
    assert metrics["rloo/frac_equal_groups"] == 1.0 and metrics["rloo/advantage_std"] == 0.0
    assert metrics["loss/policy_avg"] == 0.0


def test_equal_groups_are_counted_on_scores_with_the_kl_in_the_reward():
    # the KL terms make the sequence rewards differ, but the groups' scores, the task's signal, are still all equal
    tokenizer, policy, ref, optimizer = make_models()
    queries, responses = batch(tokenizer)
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4 + [0.5] * 4 + [2.0] * 4)
    metrics = rloo.rloo_step(policy, ref, optimizer, queries, responses, rewards, hp=rloo.RLOOHParams(),
                             pad_token_id=tokenizer.pad_token_id)
    assert metrics["rloo/frac_equal_groups"] == 1.0 and metrics["rloo/advantage_std"] > 0.0


def test_masked_tokens_get_no_gradient():
    tokenizer, policy, ref, optimizer = make_models()
    queries, responses = batch(tokenizer)
    masks = torch.tensor([[1, 0, 0, 1, 0]] * 16)  # tokens 1-2 are tool output; token 4 is padding
    grads = []

    def keep_grad(module, inputs, out):
        if out.requires_grad:
            out.register_hook(grads.append)

    handle = policy.lm_head.register_forward_hook(keep_grad)
    rloo.rloo_step(policy, ref, optimizer, queries, responses, torch.arange(16.0), masks,
                   hp=rloo.RLOOHParams(kl_coef=0.1, kl_in_reward=False, logits_chunk=0),  # whole logits: hooked
                   pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    handle.remove()
    (grad,) = grads  # [1, N, V]: the logits at the N valid response tokens' scoring positions, row-major
    valid = torch.tensor([[1, 1, 1, 1, 0]] * 16).bool()
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    assert torch.equal(valid, rloo.response_valid_mask(responses, pad, eos, masks))
    assert grad.shape[:2] == (1, int(valid.sum()))
    per_position = torch.zeros(responses.shape)  # [B, T]: gradient reaching the logits of each token
    per_position[valid] = grad[0].abs().sum(-1)
    assert (per_position[:, [1, 2, 4]] == 0).all()
    assert (per_position[:, [0, 3]] > 0).all()


def test_rloo_step_rejects_mixed_groups():
    tokenizer, policy, ref, optimizer = make_models()
    queries, responses = batch(tokenizer)
    with pytest.raises(ValueError, match="contiguous"):
        rloo.rloo_step(policy, ref, optimizer, queries.roll(1, 0), responses, torch.ones(16),
                       hp=rloo.RLOOHParams(), pad_token_id=tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="whole groups"):
        rloo.rloo_step(policy, ref, optimizer, queries[:6], responses[:6], torch.ones(6),
                       hp=rloo.RLOOHParams(), pad_token_id=tokenizer.pad_token_id)


def test_reused_first_forward_equals_accumulated_micro_batches():
    """On-policy in one batch, rloo_step reuses the training forward for the KL reward; the same update split into two
    accumulated micro-batches (old logprobs from a separate pass) must give the same parameters."""
    results = []
    for accumulation in (1, 2):
        tokenizer, policy, ref, _ = make_models()
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
        queries, responses = batch(tokenizer)
        hp = rloo.RLOOHParams(gradient_accumulation_steps=accumulation, kl_coef=0.2)
        metrics = rloo.rloo_step(policy, ref, optimizer, queries, responses, torch.linspace(-1, 1, 16), hp=hp,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        results.append(([p.detach().clone() for p in policy.parameters()], metrics))
    for a, b in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert results[0][1]["objective/rlhf_reward"] == pytest.approx(results[1][1]["objective/rlhf_reward"], abs=1e-5)
