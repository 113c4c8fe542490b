"""ppo.py's pure helpers against hand-computed values, and ppo_step on real tiny models."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, GPT2Config

import ppo

# ---- GAE, whitening, KL estimators ---------------------------------------------------------------------------------


def test_gae_matches_hand_computed_values():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = ppo.gae(rewards, values, gamma=1.0, lam=0.95)
    # t=2: 1 - 0.7 = 0.3; t=1: (0 + 0.7 - 0.6) + 0.95 * 0.3 = 0.385; t=0: (0.6 - 0.5) + 0.95 * 0.385 = 0.46575
    torch.testing.assert_close(adv, torch.tensor([[0.46575, 0.385, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.96575, 0.985, 1.0]]))
    adv, _ = ppo.gae(rewards, values, gamma=0.9, lam=0.5)
    # t=2: 0.3; t=1: 0.9 * 0.7 - 0.6 + 0.45 * 0.3 = 0.165; t=0: 0.9 * 0.6 - 0.5 + 0.45 * 0.165 = 0.11425
    torch.testing.assert_close(adv, torch.tensor([[0.11425, 0.165, 0.3]]))


def test_gae_stops_at_padding():
    # the second response has two tokens then padding (reward and value 0 there): the padding adds nothing
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 1.5, 0.0]])
    adv, _ = ppo.gae(rewards, values, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv[1], torch.tensor([1.0, 0.5, 0.0]))


def test_masked_whiten_hand_computed():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # mean 2, unbiased variance 1 over the masked entries; the unmasked one does not count
    torch.testing.assert_close(ppo.masked_whiten(x, mask)[:3], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ppo.masked_whiten(x, mask, shift_mean=False)[:3], torch.tensor([1.0, 2.0, 3.0]),
                               atol=1e-6, rtol=0)


def test_kl_estimators_hand_computed_and_unbiased():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    torch.testing.assert_close(ppo.kl_penalty(logp, ref, "k1"), torch.tensor([math.log(2)]))
    torch.testing.assert_close(ppo.kl_penalty(logp, ref, "k3"), torch.tensor([0.5 - 1 + math.log(2)]))
    # over a whole categorical, the expectation of either estimator under the policy is the exact KL
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.2, 0.5, 0.3])
    exact = (p * (p / q).log()).sum()
    for estimator in ("k1", "k3"):
        torch.testing.assert_close((p * ppo.kl_penalty(p.log(), q.log(), estimator)).sum(), exact)
    assert (ppo.kl_penalty(torch.randn(100), torch.randn(100), "k3") >= 0).all()


# ---- masks ---------------------------------------------------------------------------------------------------------


def test_response_valid_mask_cases():
    pad, eos = 0, 2
    responses = torch.tensor([[5, 6, 2, 0, 0],   # ends with EOS, then padding
                              [5, 6, 7, 8, 9],   # fills the length
                              [5, 0, 0, 0, 0],   # cut by a stop string, then padding
                              [2, 0, 0, 0, 0]])  # EOS at once
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]).bool()
    assert torch.equal(ppo.response_valid_mask(responses, pad, eos), expected)
    # pad == EOS: the first EOS ends the response and is kept; trailing zeros of masks mark the padding
    responses = torch.tensor([[5, 6, 2, 2, 2], [5, 2, 2, 2, 2]])
    masks = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])  # second row: cut by a stop string after one token
    assert ppo.response_valid_mask(responses, 2, 2)[0].tolist() == [True, True, True, False, False]
    assert ppo.response_valid_mask(responses, 2, 2, masks)[1].tolist() == [True, False, False, False, False]
    # tool tokens masked in the middle stay part of the response
    masks = torch.tensor([[1, 0, 1, 0, 0]])
    assert ppo.response_valid_mask(torch.tensor([[5, 6, 2, 0, 0]]), pad, eos, masks).tolist() == [[1, 1, 1, 0, 0]]


def test_cut_responses_keeps_first_eos_or_stop_string():
    tokenizer = ppo.build_tokenizer()
    ids = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = torch.tensor([ids("12") + [eos] + ids("34"), ids("1+2+3"), ids("12345")])
    out, lengths, ended = ppo.cut_responses(tokenizer, rows, ["+"])
    assert lengths.tolist() == [3, 2, 5]
    assert ended.tolist() == [True, True, False]
    assert out[0].tolist() == ids("12") + [eos, pad, pad]
    assert tokenizer.decode(out[1, :2]) == "1+"


def test_addition_reward_exact_needs_eos():
    tokenizer = ppo.build_tokenizer()
    ids = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    eos = tokenizer.eos_token_id
    completion_ids = [ids("12") + [eos], ids("12"), ids("13") + [eos], ids("5") + [eos],
                      ids("1") + [tokenizer.bos_token_id, eos]]
    scores = ppo.addition_reward(None, ["12", "12", "13", "5", "1"], completion_ids, ["12", "12", "12", "7", "1"],
                                 tokenizer=tokenizer)
    assert scores == [1.0, 0.5, 0.25, 0.0, 0.5]


# ---- forward passes ------------------------------------------------------------------------------------------------


def gpt2_model(tokenizer):
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_response_logprobs_ignore_left_padding_and_match_log_softmax(arch):
    torch.manual_seed(0)
    tokenizer = ppo.build_tokenizer()
    model = (ppo.build_tiny_model(tokenizer) if arch == "llama" else gpt2_model(tokenizer)).eval()
    short, long = tokenizer("3+4=").input_ids, tokenizer("12+34=").input_ids
    queries = ppo.left_pad([short, long], tokenizer.pad_token_id)
    responses = torch.tensor([[7, 8, 2], [9, 10, 2]])
    query_mask = (queries != tokenizer.pad_token_id).cumsum(1) > 0
    logprobs, entropy = ppo.response_logprobs(model, queries, query_mask.long(), responses,
                                              torch.ones_like(responses).bool(), 0.7, with_entropy=True)
    alone = torch.cat([torch.tensor([short]), responses[:1]], 1)
    full = model(alone).logits[:, len(short) - 1:-1].float() / 0.7
    expected = full.log_softmax(-1).gather(-1, responses[:1, :, None])[..., 0]
    torch.testing.assert_close(logprobs[:1], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[:1], -(full.softmax(-1) * full.log_softmax(-1)).sum(-1), atol=1e-5, rtol=1e-5)


# ---- ppo_step ------------------------------------------------------------------------------------------------------


def make_models(seed=0):
    torch.manual_seed(seed)
    tokenizer = ppo.build_tokenizer()
    policy = ppo.build_tiny_model(tokenizer)
    ref = ppo.build_tiny_model(tokenizer).requires_grad_(False)
    config = policy.config
    config.num_labels = 1
    value = ppo.disable_dropout(AutoModelForTokenClassification.from_config(config))
    optimizer = torch.optim.AdamW([*policy.parameters(), *value.parameters()], lr=1e-2)
    return tokenizer, policy, ref, value, optimizer


def batch(tokenizer, n=8):
    queries = ppo.left_pad([tokenizer(f"{i}+{i % 3}=").input_ids for i in range(n)], tokenizer.pad_token_id)
    responses = torch.randint(4, len(tokenizer), (n, 5))
    responses[:, 3] = tokenizer.eos_token_id
    responses[:, 4] = tokenizer.pad_token_id
    return queries, responses


def test_ppo_step_changes_parameters_and_returns_finite_metrics():
    tokenizer, policy, ref, value, optimizer = make_models()
    queries, responses = batch(tokenizer)
    before = [p.detach().clone() for p in [*policy.parameters(), *value.parameters()]]
    hp = ppo.PPOHParams(num_ppo_epochs=2, num_mini_batches=2, gradient_accumulation_steps=2)
    for rewards in (torch.randn(8), torch.randn(8, 5)):  # one score per response, or per-token rewards
        metrics = ppo.ppo_step(policy, value, ref, optimizer, queries, responses, rewards, hp=hp,
                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        assert all(math.isfinite(v) for v in metrics.values()), metrics
    expected = {"objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
                "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg",
                "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg", "val/ratio", "val/ratio_var",
                "val/num_eos_tokens", "val/response_length", "loss/nonfinite_skipped"}
    assert set(metrics) == expected
    assert metrics["val/num_eos_tokens"] == 8 and metrics["val/response_length"] == 4
    after = [*policy.parameters(), *value.parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(before, after) if a.requires_grad)


def test_masked_tokens_get_no_gradient_and_no_kl():
    tokenizer, policy, ref, value, optimizer = make_models()
    queries, responses = batch(tokenizer)
    masks = torch.tensor([[1, 0, 0, 1, 0]] * 8)  # tokens 1-2 are tool output; token 4 is padding
    grads = []

    def keep_grad(module, inputs, out):
        if out.requires_grad:
            out.register_hook(grads.append)

    handle = policy.lm_head.register_forward_hook(keep_grad)
    hp = ppo.PPOHParams(num_ppo_epochs=1, num_mini_batches=1, kl_coef=0.1, logits_chunk=0)  # whole logits: hooked
    metrics = ppo.ppo_step(policy, value, ref, optimizer, queries, responses, torch.ones(8), masks, hp=hp,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    handle.remove()
    (grad,) = grads  # [1, N, V]: the logits at the N valid response tokens' scoring positions, row-major
    query_mask = (queries != tokenizer.pad_token_id).cumsum(1) > 0
    valid = torch.tensor([[1, 1, 1, 1, 0]] * 8).bool()
    assert torch.equal(valid, ppo.response_valid_mask(responses, tokenizer.pad_token_id, tokenizer.eos_token_id, masks))
    assert grad.shape[:2] == (1, int(valid.sum()))
    per_position = torch.zeros(responses.shape)  # [B, T]: gradient reaching the logits of each token
    per_position[valid] = grad[0].abs().sum(-1)
    assert (per_position[:, [1, 2, 4]] == 0).all()
    assert (per_position[:, [0, 3]] > 0).all()
    # the KL in the metrics counts only the trained tokens (0 and 3)
    with torch.no_grad():
        policy_before = make_models()[1]
        lp, _ = ppo.response_logprobs(policy_before, queries, query_mask, responses, valid, 1.0)
        rp, _ = ppo.response_logprobs(ref, queries, query_mask, responses, valid, 1.0)
    expected_kl = (lp - rp)[:, [0, 3]].sum(1).mean().item()
    assert metrics["objective/kl"] == pytest.approx(expected_kl, rel=1e-4, abs=1e-5)


def test_ppo_step_rejects_a_batch_that_does_not_split_rewards_of_another_shape_and_a_biased_kl():
    tokenizer, policy, ref, value, optimizer = make_models()
    queries, responses = batch(tokenizer, n=6)
    with pytest.raises(ValueError, match="does not split"):
        ppo.ppo_step(policy, value, ref, optimizer, queries, responses, torch.ones(6),
                     hp=ppo.PPOHParams(num_mini_batches=4), pad_token_id=tokenizer.pad_token_id)
    with pytest.raises(ValueError, match=r"rewards of shape \(6, 1\): give \[B\] = \[6\] or \[B, T\]"):  # not broadcast
        ppo.ppo_step(policy, value, ref, optimizer, queries, responses, torch.ones(6, 1),
                     hp=ppo.PPOHParams(num_mini_batches=2), pad_token_id=tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="kl_estimator 'k2': the reward takes the KL's value"):  # custom loops' only
        ppo.ppo_step(policy, value, ref, optimizer, queries, responses, torch.ones(6),
                     hp=ppo.PPOHParams(num_mini_batches=2, kl_estimator="k2"), pad_token_id=tokenizer.pad_token_id)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_reused_first_forward_equals_accumulated_micro_batches(dtype):
    """With one mini-batch and no accumulation, the first epoch reuses the rollout's forward pass; the same update
    split into two accumulated micro-batches (no reuse) must give the same parameters."""
    results = []
    for accumulation in (1, 2):
        tokenizer, policy, ref, value, _ = make_models()
        optimizer = torch.optim.SGD([*policy.parameters(), *value.parameters()], lr=0.1)  # the same gradients
        queries, responses = batch(tokenizer)
        torch.manual_seed(1)
        hp = ppo.PPOHParams(num_ppo_epochs=2, num_mini_batches=1, gradient_accumulation_steps=accumulation,
                            dtype=dtype)
        metrics = ppo.ppo_step(policy, value, ref, optimizer, queries, responses, torch.linspace(-1, 1, 8), hp=hp,
                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        results.append(([p.detach().clone() for p in [*policy.parameters(), *value.parameters()]], metrics))
    for a, b in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(a, b, atol=1e-5 if dtype == "fp32" else 1e-3, rtol=0)
    assert results[0][1]["objective/kl"] == pytest.approx(results[1][1]["objective/kl"], abs=1e-5)


# ---- process rewards from a PRM ------------------------------------------------------------------------------------


def test_step_rewards_shape_with_the_running_minimum():
    steps = [(5, 0.9), (11, 0.5), (20, 0.7)]
    out = ppo.step_rewards(steps, weight=2.0)
    # potential 2 x min(p_1..p_k): 1.8, 1.0, 1.0; then back to 0 at the end of the response
    assert [j for j, _ in out] == [5, 11, 20, -1]
    assert [r for _, r in out] == pytest.approx([1.8, -0.8, 0.0, -1.0])
    assert sum(r for _, r in out) == pytest.approx(0.0)  # shaping: no optimal policy changes
    assert ppo.step_rewards([], 1.0) == []


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_shaped_step_rewards_leave_the_discounted_return_at_the_score(gamma):
    """Shaping is gamma Phi(s') - Phi(s) at every token: from the start, the discounted return is the score's alone, so
    a confident first step buys nothing (at gamma 0.9 the undiscounted step changes alone gave it +0.61)."""
    masks = torch.ones(2, 10, dtype=torch.long)
    masks[1, 7:] = 0  # row 1 ends at token 6
    steps = [[(0, 1.0)], [(2, 0.8), (4, 0.4), (6, 0.9)]]
    rewards = ppo.token_rewards(torch.tensor([0.0, 0.5]), masks, steps, 2.0, gamma)
    _, returns = ppo.gae(rewards, torch.zeros(2, 10), gamma, 1.0)
    assert returns[:, 0].tolist() == pytest.approx([0.0, 0.5 * gamma ** 6])


def test_process_rewards_land_on_the_last_token_of_each_step():
    torch.manual_seed(0)
    tokenizer = ppo.build_tokenizer()
    config = ppo.build_tiny_model(tokenizer).config
    config.num_labels = 2
    prm = ppo.AutoModelForTokenClassification.from_config(config).eval()
    with torch.no_grad():  # a PRM that says 0.8 for every step
        prm.score.weight.zero_()
        prm.score.bias.copy_(torch.tensor([0.0, math.log(4.0)]))
    ids = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    completion = ids("1+2=3\n3+4=7\n") + [tokenizer.eos_token_id]
    other = ids("12+1=13") + [tokenizer.eos_token_id]  # one step, no separator after it
    steps = ppo.process_rewards(prm, tokenizer, tokenizer, ["1+2+4=", "12+1="], [completion, other], "\n")
    assert [j for j, _ in steps[0]] == [5, 11]  # the two newline tokens
    assert [j for j, _ in steps[1]] == [6]  # the last character of the step
    assert all(p == pytest.approx(0.8) for s in steps for _, p in s)
    masks = torch.zeros(2, len(completion), dtype=torch.long)
    masks[0, :len(completion)], masks[1, :len(other)] = 1, 1
    rewards = ppo.token_rewards(torch.tensor([1.0, 0.0]), masks, steps, weight=1.0)
    # row 0: 0.8 on step 1's newline, 0 on step 2's (the minimum stays 0.8), then score 1 - 0.8 on EOS
    assert [row.nonzero().flatten().tolist() for row in rewards] == [[5, 12], [6, 7]]
    assert rewards[0, 5] == pytest.approx(0.8) and rewards[0, 12] == pytest.approx(1.0 - 0.8)
    assert rewards[1, 6] == pytest.approx(0.8) and rewards[1, 7] == pytest.approx(-0.8)  # its step, then EOS
