"""The KL under sampling filters (--top-k, --top-p, --min-p): both models on the support that the policy's sampler keeps
at each position, the reference renormalised there (logprobs_on_support). Exact expectations over small vocabularies:
k1 and k3 on the policy's samples estimate KL(policy sampler || reference on that support) without bias, and both
update steps log that KL; at identical weights every estimator is 0."""

import copy
import math

import pytest
import torch

import ppo
import rloo

TEMPERATURE = 0.3  # the random tiny model's next-token distribution is nearly flat: sharpened, each filter drops tokens
FILTERS = {"top-k 3": (3, 1.0, 0.0), "top-p 0.9": (0, 0.9, 0.0), "min-p 0.1": (0, 1.0, 0.1),
           "all three": (3, 0.9, 0.1)}


def kept(probs: list[float], top_k: int, top_p: float, min_p: float) -> list[int]:
    """The tokens a sampler with these filters can emit, from the definitions (top-k, then top-p over what is left,
    then min-p over what is left), written out for a small vocabulary."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = order[:top_k] if top_k else order
    mass = sum(probs[i] for i in keep)
    if top_p < 1.0:  # the smallest head of the order whose share of what is left reaches top_p
        total, head = 0.0, []
        for i in keep:
            head.append(i)
            total += probs[i] / mass
            if total >= top_p:
                break
        keep = head
    if min_p:
        top = max(probs[i] for i in keep)
        keep = [i for i in keep if probs[i] >= min_p * top]
    return sorted(keep)


def restricted(probs: list[float], support: list[int]) -> dict[int, float]:
    """probs renormalised over the support."""
    mass = sum(probs[i] for i in support)
    return {i: probs[i] / mass for i in support}


# (name, policy probabilities, reference probabilities, (top_k, top_p, min_p)): each filter with the policy sharper
# and broader than the reference, and the review's two cases
CASES = [
    ("top-k, policy sharper", [0.70, 0.15, 0.08, 0.05, 0.02], [0.30, 0.25, 0.20, 0.15, 0.10], (2, 1.0, 0.0)),
    ("top-k, policy broader", [0.30, 0.25, 0.20, 0.15, 0.10], [0.05, 0.60, 0.20, 0.10, 0.05], (3, 1.0, 0.0)),
    ("top-p, policy sharper", [0.55, 0.30, 0.08, 0.05, 0.02], [0.25, 0.25, 0.25, 0.15, 0.10], (0, 0.8, 0.0)),
    ("top-p, policy broader", [0.25, 0.24, 0.21, 0.17, 0.13], [0.60, 0.05, 0.05, 0.20, 0.10], (0, 0.68, 0.0)),
    ("min-p, policy sharper", [0.60, 0.25, 0.10, 0.04, 0.01], [0.20, 0.20, 0.20, 0.20, 0.20], (0, 1.0, 0.3)),
    ("min-p, policy broader", [0.24, 0.22, 0.20, 0.19, 0.15], [0.05, 0.05, 0.80, 0.05, 0.05], (0, 1.0, 0.5)),
    ("all three", [0.40, 0.30, 0.15, 0.10, 0.05], [0.10, 0.20, 0.30, 0.25, 0.15], (4, 0.9, 0.3)),
    # a nucleus of one token against a reference sampler [0.5625, 0.4375, 0] (the blind spot: both samplers emit that
    # token, KL 0; the reference on its own support gave E[k1] 0.575 and E[k3] 0.138) ...
    ("top-p, one token", [0.70, 0.20, 0.10], [0.45, 0.35, 0.20], (0, 0.5, 0.0)),
    # ... and a broad policy against a reference whose own min-p support is one token (on its own support: E[k1]
    # -0.25, a penalty that paid the policy to spread)
    ("min-p, reference sharp", [0.40, 0.35, 0.25], [0.60, 0.20, 0.20], (0, 1.0, 0.5)),
]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name, policy, reference, support", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("chunk", [0, 1], ids=["whole", "chunked"])
def test_k1_and_k3_estimate_the_kl_on_the_policy_samplers_support_without_bias(name, policy, reference, support,
                                                                                temperature, chunk):
    V = len(policy)
    # logits whose softmax at this temperature is the given distribution; one position per token of the vocabulary
    logits = [torch.tensor(p).log() * temperature for p in (policy, reference)]
    head = torch.nn.Linear(V, V, bias=False)
    torch.nn.init.eye_(head.weight)  # h are the logits themselves, through a real output layer (chunked path)
    tokens = torch.arange(V)[None]  # [1, V]: every token, each at its own position
    hs = [x.expand(V, V)[None] for x in logits]  # [1, V, V]
    with torch.no_grad():
        lp, rp = ppo.logprobs_on_support([(hs[0], head), (hs[1], head)], tokens, temperature, support, chunk * V)
        assert torch.equal(lp, rloo.logprobs_on_support([(hs[0], head), (hs[1], head)], tokens, temperature, support,
                                                        chunk * V)[0])
        # the decode loop's sampler: next_token's filtered distribution over this vocabulary
        sampler = ppo.filter_logits(logits[0] / temperature, *support).log_softmax(-1)
    support_set = kept(policy, *support)
    p_s, r_s = restricted(policy, support_set), restricted(reference, support_set)
    kl = sum(p * math.log(p / r_s[i]) for i, p in p_s.items())
    # the policy's logprobs are its sampler's, and the sampler emits exactly the support of the definitions
    assert [i for i in range(V) if sampler[i] > -math.inf] == support_set
    for i in support_set:
        assert lp[0, i].item() == pytest.approx(math.log(p_s[i]), abs=1e-5)
        assert rp[0, i].item() == pytest.approx(math.log(r_s[i]), abs=1e-5)
    k1 = {i: ppo.kl_penalty(lp[0, i], rp[0, i], "k1").item() for i in support_set}
    k3 = {i: ppo.kl_penalty(lp[0, i], rp[0, i], "k3").item() for i in support_set}
    assert sum(p_s[i] * k1[i] for i in support_set) == pytest.approx(kl, abs=1e-5)
    assert sum(p_s[i] * k3[i] for i in support_set) == pytest.approx(kl, abs=1e-5)
    assert kl >= 0 and math.isfinite(kl)
    if name == "top-p, one token":
        assert kl == 0.0
    with torch.no_grad():  # identical weights: 0 for every token the sampler can emit
        lp, rp = ppo.logprobs_on_support([(hs[0], head), (hs[0], head)], tokens, temperature, support, chunk * V)
    assert (lp - rp)[0, support_set].abs().max() == 0


def sampled_batch(support: tuple, k: int = 4):
    """A tiny model, its tokenizer, and k responses to each of 4 prompts sampled by the decode loop with the filters
    of `support`, as the scripts' rollout draws them."""
    tokenizer = ppo.build_tokenizer()
    torch.manual_seed(0)
    model = ppo.build_tiny_model(tokenizer)
    queries = ppo.left_pad([tokenizer(p).input_ids for p in ("3+4=", "12+30=", "7*8=", "1-9=")],
                           tokenizer.pad_token_id).repeat_interleave(k, 0)
    sample, _ = ppo.generation_configs(ppo.GenArgs(max_new_tokens=8), tokenizer, TEMPERATURE, *support)
    responses, _, _, sampler_logprobs, _ = ppo.generate(model, tokenizer, queries, sample, [])
    return tokenizer, model, queries, responses, sampler_logprobs


def value_model_of(model) -> torch.nn.Module:
    config = copy.deepcopy(model.config)
    config.num_labels = 1
    return ppo.disable_dropout(ppo.AutoModelForTokenClassification.from_config(config))


@pytest.mark.parametrize("support", FILTERS.values(), ids=FILTERS)
@pytest.mark.parametrize("script, estimator, in_reward", [
    ("ppo", "k1", True), ("ppo", "k3", True),
    ("rloo", "k1", True), ("rloo", "k3", True), ("rloo", "k2", False), ("rloo", "k3", False)])
def test_the_kl_is_zero_at_identical_weights_with_every_filter(support, script, estimator, in_reward):
    """The policy is its reference: every per-token KL, in the reward or in the loss, is 0."""
    tokenizer, model, queries, responses, sampler_logprobs = sampled_batch(support)
    ref = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    top_k, top_p, min_p = support
    common = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                  sampler_logprobs=sampler_logprobs)
    if script == "ppo":
        hp = ppo.PPOHParams(kl_estimator=estimator, temperature=TEMPERATURE, top_k=top_k, top_p=top_p, min_p=min_p,
                            num_ppo_epochs=1)
        metrics = ppo.ppo_step(model, value_model_of(ref), ref, optimizer, queries, responses,
                               torch.zeros(len(responses)), hp=hp, **common)
    else:
        hp = rloo.RLOOHParams(kl_estimator=estimator, kl_in_reward=in_reward, temperature=TEMPERATURE, top_k=top_k,
                              top_p=top_p, min_p=min_p)
        metrics = rloo.rloo_step(model, ref, optimizer, queries, responses, torch.zeros(len(responses)), hp=hp,
                                 **common)
        assert abs(metrics["loss/kl_avg"]) < 1e-6
    assert abs(metrics["objective/kl"]) < 1e-6, metrics["objective/kl"]
    assert abs(metrics["objective/non_score_reward"]) < 1e-6
    # the ratios still use the sampler's distribution (on-policy): its logprobs, not the full softmax's
    assert metrics["sampling/sampling_logp_difference/max"] < 1e-4


@pytest.mark.parametrize("fused", [True, False], ids=["one-batch", "mini-batches"])
@pytest.mark.parametrize("script", ["ppo", "rloo"])
def test_both_steps_log_the_kl_of_the_reference_on_the_policy_samplers_support(script, fused):
    """Away from identical weights, objective/kl is the summed k1 of the policy's filtered logprobs and the reference's
    logprobs on the policy sampler's support at each position (whole logits, computed here), whether the update's
    first pass is the rollout's (one mini-batch) or not; it is neither the reference on its own filtered support nor
    on its full softmax."""
    support = (3, 1.0, 0.0)
    tokenizer, model, queries, responses, _ = sampled_batch(support)
    ref = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    valid = ppo.response_valid_mask(responses, pad, eos)
    T = responses.shape[1]
    with torch.no_grad():
        ids = torch.cat([queries, responses], 1)
        mask = torch.cat([(queries != pad).cumsum(1) > 0, valid], 1).long()

        def logits(m):  # [B, T, V] at the response positions, divided by the temperature
            return m(input_ids=ids, attention_mask=mask, position_ids=ppo.position_ids_from(mask)).logits[
                :, -T - 1:-1] / TEMPERATURE

        policy_logits, ref_logits = logits(model), logits(ref)
        outside = ppo.filter_logits(policy_logits, *support, keep=responses).isneginf()  # the policy sampler's
        gather = lambda x: x.log_softmax(-1).gather(-1, responses[..., None])[..., 0]
        policy_lp = gather(policy_logits.masked_fill(outside, -math.inf))
        on_support = gather(ref_logits.masked_fill(outside, -math.inf))
        own_support = gather(ppo.filter_logits(ref_logits, *support, keep=responses))
    expected = ((policy_lp - on_support) * valid).sum(1).mean().item()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    split = dict(num_mini_batches=1 if fused else 2)
    common = dict(pad_token_id=pad, eos_token_id=eos)
    if script == "ppo":
        hp = ppo.PPOHParams(top_k=3, temperature=TEMPERATURE, num_ppo_epochs=1, **split)
        metrics = ppo.ppo_step(model, value_model_of(ref), ref, optimizer, queries, responses,
                               torch.zeros(len(responses)), hp=hp, **common)
    else:
        hp = rloo.RLOOHParams(top_k=3, temperature=TEMPERATURE, **split)
        metrics = rloo.rloo_step(model, ref, optimizer, queries, responses, torch.zeros(len(responses)), hp=hp,
                                 **common)
    assert metrics["objective/kl"] == pytest.approx(expected, abs=1e-5)
    for other in (own_support, gather(ref_logits)):
        assert abs(((policy_lp - other) * valid).sum(1).mean().item() - expected) > 0.05
