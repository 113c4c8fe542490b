"""rloo.py's GRPO-family switches against TRL GRPOTrainer's formulas, the named configurations, and on-policy sampling
filters.

Each switch test runs one rloo_step with plain SGD (lr 1, no gradient clipping), so the parameter change is minus
the step's gradient, and compares it with the gradient of TRL's loss for that setting, written out here from TRL's
`_compute_loss` and `_generate_and_score_completions` (GRPOTrainer, TRL 1.x): the full prompt + completion forward
(each prompt repeated per completion, nothing packed), the completion mask up to the first EOS, the advantages of the
whole batch, and the loss types as TRL aggregates them. Nothing of rloo.py's math is called for the expected side."""

import copy
import json
import shlex

import pytest
import torch
import tyro

import rloo
from conftest import ROOT, run_main

P, K, T = 2, 4, 6  # prompts, samples per prompt, response width
LENGTHS = [2, 6, 4, 6, 1, 3, 6, 5]  # response lengths; 6 without EOS (rows 1, 3, 6) are truncated


def setup(seed: int = 0):
    """A tiny Llama-shaped model, its tokenizer, a reference (the model, perturbed), and a batch of P prompts x K
    responses of mixed lengths (some ending with EOS, some truncated), with rewards."""
    tokenizer = rloo.build_tokenizer()
    torch.manual_seed(seed)
    model = rloo.build_tiny_model(tokenizer)
    ref = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompts = [tokenizer("3+5=").input_ids, tokenizer("12+7=").input_ids]
    width = max(map(len, prompts))
    queries = torch.tensor([[pad] * (width - len(p)) + p for p in prompts]).repeat_interleave(K, 0)  # [B, Lq]
    responses = torch.randint(4, 14, (P * K, T))  # digits only: no EOS, no pad
    for row, n in enumerate(LENGTHS):
        if n < T:
            responses[row, n - 1] = eos
            responses[row, n:] = pad
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 0.0, 1.0, 0.75])
    return tokenizer, model, ref, queries, responses, rewards


def trl_logps(model, queries: torch.Tensor, responses: torch.Tensor, completion_mask: torch.Tensor,
              temperature: float = 1.0) -> torch.Tensor:
    """TRL's _get_per_token_logps: one forward of prompt + completion, logits of the completion positions divided by
    the temperature, log-softmax, gathered. Positions skip the left padding."""
    prompt_mask = (queries != 0).cumsum(1) > 0
    mask = torch.cat([prompt_mask, completion_mask.bool()], 1).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=torch.cat([queries, responses], 1), attention_mask=mask, position_ids=positions).logits
    logits = logits[:, queries.shape[1] - 1:-1] / temperature
    return logits.log_softmax(-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def trl_completion_mask(responses: torch.Tensor, eos: int) -> torch.Tensor:
    """TRL: 1 up to and including the first EOS; the whole row when there is none."""
    is_eos = responses == eos
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((len(responses),), responses.shape[1]))
    return (torch.arange(responses.shape[1])[None] <= first[:, None]).float()


def trl_advantages(rewards: torch.Tensor, baseline: str, scale: str) -> torch.Tensor:
    """GRPOTrainer: rewards minus the group mean, over the group's or the batch's std (unbiased) + 1e-4; RLOO's
    baseline, the mean of the other k - 1 rewards, for leave_one_out."""
    grouped = rewards.view(-1, K)
    if baseline == "group_mean":
        advantages = rewards - grouped.mean(1).repeat_interleave(K)
    else:
        advantages = rewards - ((grouped.sum(1, keepdim=True) - grouped) / (K - 1)).flatten()
    if scale == "group":
        advantages = advantages / (grouped.std(1).repeat_interleave(K) + 1e-4)
    elif scale == "batch":
        advantages = advantages / (rewards.std() + 1e-4)
    return advantages


def trl_loss(logps: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
             loss_type: str = "dapo", level: str = "token", eps_low: float = 0.2, eps_high: float = 0.2,
             beta: float = 0.0, ref: torch.Tensor | None = None, is_ratio: torch.Tensor | None = None,
             num_items: float | None = None, max_completion_length: int = T,
             bias_correction: bool = False) -> torch.Tensor:
    """GRPOTrainer._compute_loss for one micro-batch (bias_correction: its use_bias_correction_kl)."""
    log_ratio = logps - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * advantages.unsqueeze(1), coef_2 * advantages.unsqueeze(1))
    if is_ratio is not None:
        per_token_loss = per_token_loss * is_ratio
    if beta != 0.0:
        per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
        per_token_loss = per_token_loss + beta * (per_token_kl * coef_1 if bias_correction else per_token_kl)
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    return (per_token_loss * mask).sum() / (num_items if num_items is not None else mask.sum())  # dapo


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def ours_change(hp: rloo.RLOOHParams, seed: int = 0, **step_kwargs) -> tuple[torch.Tensor, dict]:
    """rloo_step's parameter change with SGD at lr 1: minus its gradient (one on-policy update)."""
    tokenizer, model, ref, queries, responses, rewards = setup(seed)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    torch.manual_seed(7)  # the mini-batch order
    metrics = rloo.rloo_step(model, ref, torch.optim.SGD(model.parameters(), lr=1.0), queries, responses, rewards,
                             hp=hp, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                             **step_kwargs)
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before, metrics


def assert_same_direction_and_size(ours: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-4):
    assert expected.abs().max() > 1e-4, "the expected update is empty: the test would not see a difference"
    error = (ours - expected).abs().max() / expected.abs().max()
    assert error < tolerance, f"relative error {error:.2e}"


SWITCHES = {  # RLOOHParams for each switch, and TRL's setting of the same
    "group_mean baseline": (dict(baseline="group_mean"), dict(baseline="group_mean", scale="none")),
    "leave_one_out baseline": (dict(), dict(baseline="leave_one_out", scale="none")),
    "scale_rewards group": (dict(baseline="group_mean", scale_rewards="group"),
                            dict(baseline="group_mean", scale="group")),
    "scale_rewards batch": (dict(baseline="group_mean", scale_rewards="batch"),
                            dict(baseline="group_mean", scale="batch")),
    "loss_type grpo": (dict(baseline="group_mean", loss_type="grpo"), dict(loss_type="grpo")),
    "loss_type bnpo": (dict(baseline="group_mean", loss_type="bnpo", gradient_accumulation_steps=2),
                       dict(loss_type="bnpo", accumulation=2)),  # per micro-batch (one prompt each), then / 2
    "loss_type dapo": (dict(baseline="group_mean", gradient_accumulation_steps=2),
                       dict(loss_type="dapo", accumulation=2)),  # over the tokens of both micro-batches
    "loss_type dr_grpo": (dict(baseline="group_mean", loss_type="dr_grpo", max_completion_length=16),
                          dict(loss_type="dr_grpo", max_completion_length=16)),
    "importance_sampling_level sequence": (dict(baseline="group_mean", importance_sampling_level="sequence",
                                                loss_type="grpo"), dict(level="sequence", loss_type="grpo")),
    "mask_truncated_completions": (dict(baseline="group_mean", mask_truncated_completions=True),
                                   dict(mask_truncated=True)),
    "k3 KL in the loss (GRPO's beta)": (dict(baseline="group_mean", kl_in_reward=False, kl_estimator="k3",
                                             kl_coef=0.04, loss_type="grpo"), dict(beta=0.04, loss_type="grpo")),
    # TRL 1.12's default use_bias_correction_kl multiplies the k3 term by the ratio, 1 on-policy but not its gradient:
    # (1 - r) + k3 = log(pi / ref) times grad log pi, which is k2's gradient
    "k2 KL in the loss (TRL's bias-corrected k3)": (dict(baseline="group_mean", kl_in_reward=False,
                                                         kl_estimator="k2", kl_coef=0.04, loss_type="grpo"),
                                                    dict(beta=0.04, loss_type="grpo", bias_correction=True)),
}


@pytest.mark.parametrize("name", SWITCHES)
def test_each_switch_gives_the_gradient_of_trls_formula(name):
    ours_hp, trl = SWITCHES[name]
    hp = rloo.RLOOHParams(**{"kl_coef": 0.0, "max_grad_norm": 1e9, **ours_hp})
    ours, _ = ours_change(hp)

    tokenizer, model, ref, queries, responses, rewards = setup()
    mask = trl_completion_mask(responses, tokenizer.eos_token_id)
    if trl.get("mask_truncated"):  # TRL: completion_mask * (~is_truncated)
        mask = mask * (responses == tokenizer.eos_token_id).any(1, keepdim=True).float()
    advantages = trl_advantages(rewards, trl.get("baseline", "group_mean"), trl.get("scale", "none"))
    accumulation = trl.get("accumulation", 1)
    for prompts in torch.arange(P).chunk(accumulation):  # TRL's micro-batches, gradients accumulated
        rows = (prompts[:, None] * K + torch.arange(K)).flatten()
        logps = trl_logps(model, queries[rows], responses[rows], mask[rows])
        ref_logps = trl_logps(ref, queries[rows], responses[rows], mask[rows]).detach()
        loss = trl_loss(logps, logps.detach(), advantages[rows], mask[rows], loss_type=trl.get("loss_type", "dapo"),
                        level=trl.get("level", "token"), beta=trl.get("beta", 0.0), ref=ref_logps,
                        num_items=mask.sum(), max_completion_length=trl.get("max_completion_length", T),
                        bias_correction=trl.get("bias_correction", False))
        (loss if trl.get("loss_type", "dapo") == "dapo" else loss / accumulation).backward()
    assert_same_direction_and_size(ours, -flat_grad(model))


def test_the_switches_change_the_update():
    """The expected updates differ from each other, so each test above pins its own switch."""
    changes = {name: ours_change(rloo.RLOOHParams(kl_coef=0.0, max_grad_norm=1e9, **SWITCHES[name][0]))[0]
               for name in ("group_mean baseline", "leave_one_out baseline", "loss_type grpo", "loss_type bnpo",
                            "mask_truncated_completions")}
    names = list(changes)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert (changes[a] - changes[b]).abs().max() > 1e-3 * changes[a].abs().max(), (a, b)


def trl_two_mini_batches(lr: float, **loss_kwargs) -> torch.Tensor:
    """TRL's loss over two mini-batches of one prompt each (steps_per_generation = 2), the old logprobs those of the
    policy that sampled, SGD at lr; the mini-batch order is rloo_step's (seed 7). Returns the parameter change."""
    tokenizer, model, ref, queries, responses, rewards = setup()
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    mask = trl_completion_mask(responses, tokenizer.eos_token_id)
    advantages = trl_advantages(rewards, "group_mean", "group")
    with torch.no_grad():
        old = trl_logps(model, queries, responses, mask)
    torch.manual_seed(7)
    for prompt in torch.randperm(P).tolist():
        rows = slice(prompt * K, (prompt + 1) * K)
        model.zero_grad()
        logps = trl_logps(model, queries[rows], responses[rows], mask[rows])
        trl_loss(logps, old[rows], advantages[rows], mask[rows], **loss_kwargs).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(lr * p.grad)
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before


@pytest.mark.parametrize("ours_hp, trl, symmetric", [
    (dict(epsilon_high=0.28, loss_type="dapo"), dict(eps_low=0.2, eps_high=0.28, loss_type="dapo"),
     dict(eps_low=0.2, eps_high=0.2, loss_type="dapo")),
    (dict(importance_sampling_level="sequence", cliprange=3e-4, epsilon_high=4e-4, loss_type="grpo"),
     dict(level="sequence", eps_low=3e-4, eps_high=4e-4, loss_type="grpo"),
     dict(level="token", eps_low=3e-4, eps_high=4e-4, loss_type="grpo")),
], ids=["clip-higher (DAPO)", "sequence-level ratio (GSPO)"])
def test_off_policy_clipping_follows_trl_over_two_mini_batches(ours_hp, trl, symmetric):
    """The second mini-batch is off-policy (its ratios moved with the first update), so the clip range and the
    ratio's level change it; the test checks they moved far enough to matter."""
    lr = 1.0
    hp = rloo.RLOOHParams(baseline="group_mean", scale_rewards="group", kl_coef=0.0, max_grad_norm=1e9,
                          num_mini_batches=2, **ours_hp)
    tokenizer, model, ref, queries, responses, rewards = setup()
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    torch.manual_seed(7)
    metrics = rloo.rloo_step(model, ref, torch.optim.SGD(model.parameters(), lr=lr), queries, responses, rewards,
                             hp=hp, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    ours = torch.cat([p.detach().flatten() for p in model.parameters()]) - before
    expected = trl_two_mini_batches(lr, **trl)
    assert_same_direction_and_size(ours, expected)
    assert metrics["policy/clipfrac_avg"] > 0
    other = trl_two_mini_batches(lr, **symmetric)
    assert (other - expected).abs().max() > 1e-2 * expected.abs().max(), "the switch made no difference here"


def test_sampler_correction_is_trls_token_truncate():
    """sampler_correction_cap: each token's policy-gradient loss times min(exp(old - sampler), cap)."""
    tokenizer, model, ref, queries, responses, rewards = setup()
    mask = trl_completion_mask(responses, tokenizer.eos_token_id)
    with torch.no_grad():
        old = trl_logps(model, queries, responses, mask)
    torch.manual_seed(3)
    sampler = old + 0.5 * torch.randn_like(old)  # a sampler whose logprobs differ from the trainer's
    hp = rloo.RLOOHParams(baseline="group_mean", kl_coef=0.0, max_grad_norm=1e9, sampler_correction_cap=1.5)
    ours, metrics = ours_change(hp, sampler_logprobs=sampler)
    logps = trl_logps(model, queries, responses, mask)
    weight = torch.exp(old - sampler).clamp(max=1.5)
    trl_loss(logps, logps.detach(), trl_advantages(rewards, "group_mean", "none"), mask, is_ratio=weight).backward()
    assert_same_direction_and_size(ours, -flat_grad(model))
    diff = (old - sampler).abs()[mask.bool()]
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(diff.max().item(), rel=1e-4)
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(diff.mean().item(), rel=1e-4)
    uncorrected, _ = ours_change(rloo.RLOOHParams(baseline="group_mean", kl_coef=0.0, max_grad_norm=1e9),
                                 sampler_logprobs=sampler)
    assert (uncorrected - ours).abs().max() > 1e-3 * ours.abs().max()


def test_filtered_sampling_is_on_policy():
    """The decode loop's logprob of each token (top-k 3, top-p 0.9) equals the update's, computed on the same
    truncated support; the full softmax's logprobs (what the update used before) differ by far more than float
    noise."""
    tokenizer = rloo.build_tokenizer()
    torch.manual_seed(0)
    model = rloo.build_tiny_model(tokenizer)
    queries = torch.tensor([tokenizer("3+5=").input_ids, tokenizer("2+2=").input_ids]).repeat_interleave(8, 0)
    sample, _ = rloo.generation_configs(rloo.GenArgs(max_new_tokens=6), tokenizer, 1.0, top_k=3, top_p=0.9)
    responses, lengths, _, sampler, _ = rloo.generate(model, tokenizer, queries, sample, [])
    valid = torch.arange(responses.shape[1])[None] < lengths[:, None]
    with torch.no_grad():
        query_mask = (queries[::8] != tokenizer.pad_token_id).cumsum(1) > 0
        exact, _ = rloo.response_logprobs(model, queries[::8], query_mask, responses, valid, 1.0, (3, 0.9, 0.0))
        full, _ = rloo.response_logprobs(model, queries[::8], query_mask, responses, valid, 1.0)
    assert (exact - sampler)[valid].abs().max() < 1e-5
    assert (full - sampler)[valid].abs().max() > 0.1


def test_a_sampled_token_stays_inside_the_support():
    """Float noise between sampler and trainer can move a token across the top-k boundary: the update keeps it."""
    logits = torch.tensor([[[3.0, 2.0, 1.999, 0.0]]])  # [1, 1, V]: token 2 is just outside top-2
    logprobs, _ = rloo.token_logprobs(logits, torch.tensor([[2]]), 1.0, (2, 1.0, 0.0))
    assert torch.isfinite(logprobs).all()
    expected = logits[0, 0, :3].log_softmax(-1)[2]
    torch.testing.assert_close(logprobs[0, 0], expected)


def recipe_table() -> dict[str, str]:
    """docs/rloo.md's table of named configurations: name -> its flags."""
    text = (ROOT / "docs" / "rloo.md").read_text()
    table = text[text.index("| Name | Flags |"):].split("\n\n")[0].splitlines()[2:]
    rows = {}
    for line in table:
        name, flags = [cell.strip() for cell in line.strip("|").split("|")][:2]
        rows[name.strip("`")] = flags.split("`")[1] if flags.startswith("`") else ""  # the flags in backticks, or none
    return rows


def test_the_docs_table_of_configurations_is_the_code():
    rows = recipe_table()
    assert set(rows) == set(rloo.RECIPES)
    for name, flags in rows.items():
        from_docs = tyro.cli(rloo.Args, args=[*shlex.split(flags), "--exp-name", name])
        assert from_docs == rloo.named_config(name), f"docs/rloo.md's {name} row: {flags}"


def test_a_named_configuration_runs_and_flags_after_it_override_it(tmp_path):
    result = run_main("rloo.py", "grpo", "--total-episodes", "16", "--batch-size", "8", "--rloo-k", "2",
                      "--eval-every", "1", "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["rloo"]["baseline"] == "group_mean" and config["rloo"]["loss_type"] == "grpo"
    assert config["rloo"]["rloo_k"] == 2 and config["exp_name"] == "grpo"  # the flag overrides the recipe's 4
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"policy/clipfrac_low_avg", "policy/clipfrac_high_avg", "val/truncated_frac",
            "sampling/sampling_logp_difference/mean"} <= set(rows[-1])


def test_trl_rloo_recipe_is_trls_rlootrainer_over_two_mini_batches():
    """The trl_rloo recipe against TRL's RLOOTrainer, written out from its `_generate_and_score_completions` and
    `_compute_loss` (TRL 1.x): k = 2, the summed k1 KL in the reward (beta 0.05), leave-one-out advantages, one ratio
    per response, exp(sum of its token log-ratios), clipped to [0.8, 1.2], the mean of the responses' losses. Two
    mini-batches make the second off-policy, so the sequence ratio's clip acts; the former recipe (token ratios,
    dr_grpo's sum over responses x max length) gave 1/T of the first mini-batch's update and no such clip."""
    k, lr = 2, 1.0
    hp = rloo.named_config("trl_rloo").rloo
    hp.max_grad_norm, hp.num_mini_batches = 1e9, 2
    tokenizer, model, ref, queries, responses, rewards = setup()
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    torch.manual_seed(7)
    metrics = rloo.rloo_step(model, ref, torch.optim.SGD(model.parameters(), lr=lr), queries, responses, rewards,
                             hp=hp, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    ours = torch.cat([p.detach().flatten() for p in model.parameters()]) - before

    tokenizer, model, ref, queries, responses, rewards = setup()
    mask = trl_completion_mask(responses, tokenizer.eos_token_id)
    with torch.no_grad():
        old = trl_logps(model, queries, responses, mask)
        kl = ((old - trl_logps(ref, queries, responses, mask)) * mask).sum(-1)
    grouped = (rewards - 0.05 * kl).view(-1, k)
    advantages = (grouped - (grouped.sum(1, keepdim=True) - grouped) / (k - 1)).flatten()
    old_logps = (old * mask).sum(1)
    torch.manual_seed(7)
    for groups in torch.randperm(len(rewards) // k).split(2):
        rows = (groups[:, None] * k + torch.arange(k)).flatten()
        model.zero_grad()
        logps = (trl_logps(model, queries[rows], responses[rows], mask[rows]) * mask[rows]).sum(1)
        coef_1 = torch.exp(logps - old_logps[rows])
        coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)
        loss = -torch.min(coef_1 * advantages[rows], coef_2 * advantages[rows]).mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(lr * p.grad)
    expected = torch.cat([p.detach().flatten() for p in model.parameters()]) - before
    assert_same_direction_and_size(ours, expected)
    assert metrics["policy/clipfrac_avg"] > 0, "the second mini-batch's ratios stayed inside the clip range"
