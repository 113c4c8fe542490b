"""The step functions' math: the KL estimator's gradient where rloo_step puts it, no reward lost on padding in
ppo_step and rloo_step, and no dropout in the models a step is given. Exact expectations over a small vocabulary
(no sampling) and real tiny models."""

import copy

import pytest
import torch
import tyro
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, LlamaConfig

import interleave
import ppo
import rloo
from conftest import ROOT


def exact_kl_gradients(logits: torch.Tensor, ref_logits: torch.Tensor, params: list) -> dict[str, torch.Tensor]:
    """Gradients (flattened) of KL(pi || ref) and KL(ref || pi), computed exactly over the vocabulary."""
    logp, ref_logp = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    forward = (logp.exp() * (logp - ref_logp)).sum()
    reverse = (ref_logp.exp() * (ref_logp - logp)).sum()
    return {name: torch.cat([g.flatten() for g in torch.autograd.grad(kl, params, retain_graph=True)])
            for name, kl in (("KL(pi||ref)", forward), ("KL(ref||pi)", reverse))}


def relative_error(x: torch.Tensor, target: torch.Tensor) -> float:
    """|x - target| / |target|."""
    return ((x - target).norm() / target.norm()).item()


# ---- 1. the KL estimator and its placement -------------------------------------------------------------------------


def test_kl_penalty_expected_gradient_over_a_small_vocabulary():
    """E_{x ~ pi}[grad k(x)], summed exactly over 6 tokens: k1 gives 0, k2 the gradient of KL(pi || ref), k3 that of
    KL(ref || pi); the two directions differ here, so each match is a real one."""
    torch.manual_seed(0)
    theta = (2 * torch.randn(6)).requires_grad_()
    ref_logits = 2 * torch.randn(6)
    exact = exact_kl_gradients(theta, ref_logits, [theta])
    assert relative_error(exact["KL(pi||ref)"], exact["KL(ref||pi)"]) > 0.3
    logp, ref_logp = theta.log_softmax(-1), ref_logits.log_softmax(-1)  # [V]: every token as the sampled one
    expected = {}
    for estimator in ("k1", "k2", "k3"):
        surrogate = (logp.exp().detach() * ppo.kl_penalty(logp, ref_logp, estimator)).sum()  # pi(x) x k(x), no
        expected[estimator] = torch.autograd.grad(surrogate, theta, retain_graph=True)[0]  # gradient through pi(x)
    assert expected["k1"].norm() < 1e-6 * exact["KL(pi||ref)"].norm()
    assert relative_error(expected["k2"], exact["KL(pi||ref)"]) < 1e-5
    assert relative_error(expected["k3"], exact["KL(ref||pi)"]) < 1e-5
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        ppo.kl_penalty(logp, ref_logp, "k4")


def test_k2_summed_over_a_response_is_the_per_token_kl_gradient_not_the_responses_kl_gradient():
    """Two-token responses over a 6-token vocabulary, every one of the 36 summed exactly: k2 summed over a response
    has, in expectation under the policy, the gradient of each token's KL(pi || ref) at its sampled prefix, the prefix
    held fixed, and not the gradient of the responses' KL(pi || ref). What it leaves out is exactly how the first
    token's distribution moves the prefixes at which the second token's KL is taken."""
    torch.manual_seed(0)
    V = 6
    theta1, theta2 = (2 * torch.randn(V)).requires_grad_(), (2 * torch.randn(V, V)).requires_grad_()  # the policy:
    ref1, ref2 = 2 * torch.randn(V), 2 * torch.randn(V, V)  # first token's logits [V], second's given the first [V, V]
    logp1, logp2 = theta1.log_softmax(-1), theta2.log_softmax(-1)
    ref_logp1, ref_logp2 = ref1.log_softmax(-1), ref2.log_softmax(-1)
    joint = logp1.exp()[:, None] * logp2.exp()  # [V, V]: pi(y1, y2)

    def grad(x: torch.Tensor) -> torch.Tensor:
        grads = torch.autograd.grad(x, [theta1, theta2], retain_graph=True, materialize_grads=True)
        return torch.cat([g.flatten() for g in grads])

    k2 = ppo.kl_penalty(logp1, ref_logp1, "k2")[:, None] + ppo.kl_penalty(logp2, ref_logp2, "k2")  # [V, V], summed
    expected_k2 = grad((joint.detach() * k2).sum())  # no gradient through the sampling
    kl_first = (logp1.exp() * (logp1 - ref_logp1)).sum()
    kl_second = (logp2.exp() * (logp2 - ref_logp2)).sum(-1)  # [V]: the second token's KL after each first token
    per_token = grad(kl_first + (logp1.exp().detach() * kl_second).sum())  # each at its sampled prefix, held fixed
    responses = grad((joint * (logp1[:, None] + logp2 - ref_logp1[:, None] - ref_logp2)).sum())  # KL of (y1, y2)
    moved_prefixes = grad((logp1.exp() * kl_second.detach()).sum())
    assert relative_error(expected_k2, per_token) < 1e-5
    assert relative_error(per_token + moved_prefixes, responses) < 1e-5
    assert relative_error(expected_k2, responses) > 0.05  # 0.20 here


def test_k2_is_called_the_kl_gradient_only_token_by_token():
    """What the scripts and the pages say of k2 in the loss is the statement tested above: per token, at the sampled
    prefix; never "exactly the gradient of KL", which holds for one-token responses only."""
    for path in [ROOT / "ppo.py", ROOT / "rloo.py", ROOT / "interleave.py", ROOT / "README.md",
                 *(ROOT / "docs").glob("*.md")]:
        assert "exactly the gradient of KL" not in path.read_text(), path.name
    assert "token by token" in ppo.kl_penalty.__doc__ and "T > 1 tokens" in ppo.kl_penalty.__doc__


def scaled_tiny_model(tokenizer, seed: int, scale: float) -> torch.nn.Module:
    """The built-in tiny model with its (tied) embeddings scaled: a larger scale, a more peaked next-token
    distribution."""
    torch.manual_seed(seed)
    model = rloo.build_tiny_model(tokenizer)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(scale)
    return model


@pytest.mark.parametrize("estimator, direction", [("auto", "KL(pi||ref)"), ("k2", "KL(pi||ref)"),
                                                  ("k3", "KL(ref||pi)")])
def test_rloo_step_kl_loss_has_the_exact_kl_gradient(estimator, direction):
    """rloo_step with the KL in the loss, on every token of the vocabulary as a one-token response, each with equal
    rewards (advantage 0): the update is minus kl_coef x the gradient of the KL term, and its expectation under the
    policy is the exact gradient of KL(pi || ref) (auto, k2) or of KL(ref || pi) (k3)."""
    tokenizer = rloo.build_tokenizer()
    policy = scaled_tiny_model(tokenizer, 0, 3.0)
    ref = scaled_tiny_model(tokenizer, 1, 1.0).requires_grad_(False)  # KL(pi || ref) 0.73, KL(ref || pi) 0.60
    eos = tokenizer.eos_token_id
    query = torch.tensor([tokenizer("3+5=").input_ids] * 2)  # [2, Lq]: one prompt, k = 2 samples
    hp = rloo.RLOOHParams(rloo_k=2, kl_coef=1.0, kl_in_reward=False, kl_estimator=estimator, max_grad_norm=1e12)
    lr = 100.0
    logits = policy(input_ids=query[:1]).logits[0, -1].float()  # [V]: the first response token's distribution
    ref_logits = ref(input_ids=query[:1]).logits[0, -1].float()
    exact = exact_kl_gradients(logits, ref_logits, list(policy.parameters()))
    assert relative_error(exact["KL(pi||ref)"], exact["KL(ref||pi)"]) > 0.2  # 0.22: the test tells them apart
    probs = logits.softmax(-1).detach()
    expected = torch.zeros_like(exact[direction])
    for x in range(len(tokenizer)):
        model = copy.deepcopy(policy)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        rloo.rloo_step(model, ref, optimizer, query, torch.full((2, 1), x), torch.zeros(2), hp=hp,
                       pad_token_id=eos, eos_token_id=eos)  # pad = EOS: no token of the vocabulary is padding
        step = torch.cat([(p0 - p1).flatten() for p0, p1 in zip(policy.parameters(), model.parameters())]) / lr
        expected += probs[x] * step
    assert relative_error(expected, exact[direction]) < 1e-4  # 3e-7 to 4e-7 measured


def test_k1_in_the_loss_and_k2_in_the_reward_are_refused():
    """rloo_step raises; rloo.py and interleave.py stop with one line naming the flag, before loading anything."""
    tokenizer = rloo.build_tokenizer()
    policy = rloo.build_tiny_model(tokenizer)
    query, responses = torch.tensor([tokenizer("1+1=").input_ids] * 2), torch.tensor([[6, 2], [7, 2]])
    for hp in (rloo.RLOOHParams(rloo_k=2, kl_in_reward=False, kl_estimator="k1"),
               rloo.RLOOHParams(rloo_k=2, kl_in_reward=True, kl_estimator="k2")):
        with pytest.raises(ValueError, match="k1|k2"):
            rloo.rloo_step(policy, policy, torch.optim.SGD(policy.parameters()), query, responses, torch.zeros(2),
                           hp=hp, pad_token_id=0, eos_token_id=2)
    assert rloo.kl_estimator_for(rloo.RLOOHParams()) == "k1"
    assert rloo.kl_estimator_for(rloo.RLOOHParams(kl_in_reward=False)) == "k2"
    with pytest.raises(SystemExit, match=r"^error: --kl-estimator 'k1': in the loss"):
        rloo.main(tyro.cli(rloo.Args, args=["--no-kl-in-reward", "--kl-estimator", "k1"]))
    with pytest.raises(SystemExit, match=r"^error: --rloo.kl-estimator 'k1': in the loss"):
        interleave.check_args(tyro.cli(interleave.Args, args=["--rloo.no-kl-in-reward", "--rloo.kl-estimator", "k1"]))
    interleave.check_args(tyro.cli(interleave.Args, args=["--rloo.no-kl-in-reward"]))  # auto: k2 in the loss


# ---- 2. no reward on padding is lost -------------------------------------------------------------------------------


def padded_episodes(tokenizer):
    """Four episodes as rollout returns them (pad != EOS): the first ends in sampled pad tokens and no EOS, so its
    rollout mask covers tokens that the steps treat as padding."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    queries = ppo.left_pad([tokenizer(p).input_ids for p in ("1+2=", "1+2=", "3+4=", "3+4=")], pad)
    responses = torch.tensor([[7, 8, pad, pad], [7, eos, pad, pad], [9, 10, 11, 12], [6, eos, pad, pad]])
    masks = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    return queries, responses, masks


def models_for(tokenizer):
    """Policy, value model and reference: real tiny models, dropout off."""
    torch.manual_seed(0)
    policy = ppo.build_tiny_model(tokenizer)
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    value = ppo.disable_dropout(AutoModelForTokenClassification.from_config(config))
    return policy, value, copy.deepcopy(policy).requires_grad_(False)


def test_ppo_step_keeps_a_score_placed_on_padding():
    """The PRM path's [B, T] rewards (token_rewards puts the score on the rollout mask's last token, a sampled pad)
    and the [B] scores give the same objective/scores and the same update; with step rewards, the mass is kept."""
    tokenizer = ppo.build_tokenizer()
    queries, responses, masks = padded_episodes(tokenizer)
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25])
    dense = ppo.token_rewards(scores, masks, [[], [], [], []], 1.0)  # [B, T]
    assert dense[0, 3] == 1.0  # on a token the step treats as padding
    hp = ppo.PPOHParams(num_ppo_epochs=2, num_mini_batches=2)
    runs = []
    for rewards in (scores, dense):
        policy, value, ref = models_for(tokenizer)
        optimizer = torch.optim.AdamW([*policy.parameters(), *value.parameters()], lr=1e-2)
        torch.manual_seed(1)
        metrics = ppo.ppo_step(policy, value, ref, optimizer, queries, responses, rewards, masks, hp=hp,
                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        runs.append((metrics, [p.detach().clone() for p in [*policy.parameters(), *value.parameters()]]))
    (m_scores, p_scores), (m_dense, p_dense) = runs
    assert m_dense["objective/scores"] == pytest.approx(m_scores["objective/scores"]) == pytest.approx(0.4375)
    assert m_dense["objective/rlhf_reward"] == pytest.approx(m_scores["objective/rlhf_reward"])
    for a, b in zip(p_scores, p_dense):
        torch.testing.assert_close(a, b)
    # process rewards: a step on token 0, the -potential on the padding; the total is the score
    shaped = ppo.token_rewards(scores, masks, [[(0, 0.8)], [], [(1, 0.5)], []], 1.0)
    policy, value, ref = models_for(tokenizer)
    optimizer = torch.optim.AdamW([*policy.parameters(), *value.parameters()], lr=1e-2)
    metrics = ppo.ppo_step(policy, value, ref, optimizer, queries, responses, shaped, masks, hp=hp,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    assert metrics["objective/scores"] == pytest.approx(shaped.sum(1).mean().item()) == pytest.approx(0.4375)


def test_rloo_step_keeps_a_score_placed_on_padding():
    """rloo_step sums a [B, T] reward whole: the same objective/scores and the same update as the [B] scores."""
    tokenizer = rloo.build_tokenizer()
    queries, responses, masks = padded_episodes(tokenizer)
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25])
    dense = ppo.token_rewards(scores, masks, [[], [], [], []], 1.0)  # [B, T]
    runs = []
    for rewards in (scores, dense):
        policy, _, ref = models_for(tokenizer)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        metrics = rloo.rloo_step(policy, ref, optimizer, queries, responses, rewards, masks,
                                 hp=rloo.RLOOHParams(rloo_k=2), pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
        runs.append((metrics, [p.detach().clone() for p in policy.parameters()]))
    (m_scores, p_scores), (m_dense, p_dense) = runs
    assert m_dense["objective/scores"] == pytest.approx(m_scores["objective/scores"]) == pytest.approx(0.4375)
    assert m_dense["rloo/advantage_std"] == pytest.approx(m_scores["rloo/advantage_std"])
    for a, b in zip(p_scores, p_dense):
        torch.testing.assert_close(a, b)


# ---- 3. no dropout in the models a step is given -------------------------------------------------------------------


def dropout_models(tokenizer):
    """A policy whose config has attention dropout 0.1 (applied as a function in Llama's attention), a value model
    from the same config (its classifier dropout is 0.1), and a frozen reference; all in training mode."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, attention_dropout=0.1,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    value_config = copy.deepcopy(config)
    value_config.num_labels = 1
    value = AutoModelForTokenClassification.from_config(value_config, attn_implementation="eager")
    return policy, value, copy.deepcopy(policy).requires_grad_(False)


def test_steps_refuse_active_dropout_and_disable_dropout_turns_it_off():
    tokenizer = ppo.build_tokenizer()
    queries, responses, masks = padded_episodes(tokenizer)
    common = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    policy, value, ref = dropout_models(tokenizer)
    optimizer = torch.optim.AdamW([*policy.parameters(), *value.parameters()], lr=1e-3)
    hp = ppo.PPOHParams(num_ppo_epochs=1, num_mini_batches=1)
    with pytest.raises(ValueError, match=r"^policy applies dropout .*disable_dropout\(policy\)"):
        ppo.ppo_step(policy, value, ref, optimizer, queries, responses, torch.ones(4), masks, hp=hp, **common)
    with pytest.raises(ValueError, match=r"^policy applies dropout"):
        rloo.rloo_step(policy, ref, optimizer, queries, responses, torch.ones(4), masks,
                       hp=rloo.RLOOHParams(rloo_k=2), **common)
    ppo.disable_dropout(policy)
    ppo.disable_dropout(ref)
    with pytest.raises(ValueError, match=r"^value_model applies dropout .*disable_dropout\(value_model\)"):
        ppo.ppo_step(policy, value, ref, optimizer, queries, responses, torch.ones(4), masks, hp=hp, **common)
    # disable_dropout reaches the functional attention dropout too: two passes in training mode agree
    assert policy.training
    first, second = (policy(input_ids=queries).logits for _ in range(2))
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    ppo.ppo_step(policy, value.eval(), ref, optimizer, queries, responses, torch.ones(4), masks, hp=hp, **common)
    rloo.rloo_step(policy, ref, optimizer, queries, responses, torch.ones(4), masks, hp=rloo.RLOOHParams(rloo_k=2),
                   **common)
