"""The newest of the GRPO family in rloo.py (TRL 1.16's cispo, sapo, vespo and luspo losses, the two-sided clip
`delta`, top_entropy_quantile, off_policy_mask_threshold): each formula worked by hand at ratios below, inside and
above its clip or gate, and rloo_step's update against the one TRL 1.16's GRPOTrainer computes with its own
`_compute_loss` on the same batch (benchmarks/trl_side.py grpo-losses, in benchmarks/.trl116-venv)."""

import json
import math

import pytest
import torch
from test_grpo_family import K, P, assert_same_direction_and_size, setup, trl_advantages, trl_completion_mask, trl_logps

import rloo
from conftest import ROOT, run_main, run_script

TRL116 = ROOT / "benchmarks" / ".trl116-venv" / "bin" / "python"


def losses_and_grads(ratios: list[float], adv: float, mask: torch.Tensor | None = None, **hp) -> tuple:
    """policy_losses at these token ratios (one response, old logprobs log 0.5), and d loss / d logprob of each."""
    old = torch.full((1, len(ratios)), math.log(0.5))
    logprobs = (old + torch.tensor([ratios]).log()).requires_grad_()
    mask = torch.ones(1, len(ratios), dtype=torch.bool) if mask is None else mask
    losses, log_ratio, extra = rloo.policy_losses(logprobs, old, torch.tensor([[adv]]), mask, rloo.RLOOHParams(**hp))
    (grad,) = torch.autograd.grad(losses.sum(), logprobs)
    return losses.detach()[0].tolist(), grad[0].tolist(), extra


@pytest.mark.parametrize("adv, delta, expected_losses, expected_grads", [
    # r = 0.5 (below 1 - 0.2), 1 (inside), 1.5 (above 1 + 0.2): PPO's pessimistic clip; grad = -A r where unclipped
    (1.0, None, [-0.5, -1.0, -1.2], [-0.5, -1.0, 0.0]),
    (-1.0, None, [0.8, 1.0, 1.5], [0.0, 1.0, 1.5]),
    (-1.0, 1.3, [0.8, 1.0, 1.3], [0.0, 1.0, 0.0]),  # delta caps the ratio where A < 0: no gradient past it
    (1.0, 1.3, [-0.5, -1.0, -1.2], [-0.5, -1.0, 0.0]),  # and changes nothing where A > 0
])
def test_the_clip_and_delta_by_hand(adv, delta, expected_losses, expected_grads):
    losses, grads, _ = losses_and_grads([0.5, 1.0, 1.5], adv, loss_type="grpo", delta=delta)
    assert losses == pytest.approx(expected_losses, abs=1e-6) and grads == pytest.approx(expected_grads, abs=1e-6)


@pytest.mark.parametrize("adv", [1.0, -2.0])
def test_cispo_by_hand(adv):
    """-sg(min(r, eps_high)) A log pi: the gradient -min(r, 1.2) A at every ratio, none clipped to 0."""
    losses, grads, _ = losses_and_grads([0.5, 1.0, 1.5], adv, loss_type="cispo", epsilon_high=1.2)
    weights = [0.5, 1.0, 1.2]
    assert grads == pytest.approx([-w * adv for w in weights], abs=1e-6)
    assert losses == pytest.approx([-w * adv * math.log(0.5 * r) for w, r in zip(weights, [0.5, 1.0, 1.5])], abs=1e-6)


@pytest.mark.parametrize("adv, tau", [(1.0, 1.0), (-1.0, 1.05)])
def test_sapo_by_hand(adv, tau):
    """-A 4 / tau sigmoid(tau (r - 1)): the gradient -A 4 s (1 - s) r, exactly -A at r = 1, smaller away from it."""
    losses, grads, _ = losses_and_grads([0.5, 1.0, 1.5], adv, loss_type="sapo")
    for r, loss, grad in zip([0.5, 1.0, 1.5], losses, grads):
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        assert loss == pytest.approx(-adv * 4 / tau * s, abs=1e-6)
        assert grad == pytest.approx(-adv * 4 * s * (1 - s) * r, abs=1e-6)
    assert grads[1] == pytest.approx(-adv, abs=1e-6)


@pytest.mark.parametrize("w, adv, k, lam", [(1.0, 1.0, 2, 3), (0.5, 1.0, 2, 3), (2.0, 1.0, 2, 3), (0.5, -1.0, 3, 2),
                                            (2.0, -1.0, 3, 2)])
def test_vespo_by_hand(w, adv, k, lam):
    """phi(w) = e^lambda w^k e^(-lambda w) of the response's ratio w (the product of its token ratios), 1 at w = 1;
    every token's gradient -phi A (phi held constant); (k, lambda) = (2, 3) for A >= 0, (3, 2) below."""
    ratios = [w ** 0.5, w ** 0.5, 5.0]  # the third token is masked out: not in w
    mask = torch.tensor([[True, True, False]])
    _, grads, extra = losses_and_grads(ratios, adv, mask, loss_type="vespo")
    phi = math.exp(lam) * w ** k * math.exp(-lam * w)
    assert extra["policy/vespo_phi_avg"].item() == pytest.approx(phi, rel=1e-5)
    assert grads[:2] == pytest.approx([-phi * adv] * 2, rel=1e-5)


def test_luspo_sums_each_response_then_averages():
    """luspo: a response's token losses summed (its loss times its length for a ratio per response), then the mean
    over responses; grpo divides each response's sum by its length."""
    losses = torch.tensor([[1.0, 1.0, 1.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert rloo.aggregate_loss(losses, mask, "luspo", torch.tensor(4.0), 2, 3).item() == pytest.approx((3 + 2) / 2 / 2)
    assert rloo.aggregate_loss(losses, mask, "grpo", torch.tensor(4.0), 1, 3).item() == pytest.approx((1 + 2) / 2)
    for same_as in (("cispo", "dapo"), ("vespo", "dapo"), ("sapo", "grpo")):
        a, b = (rloo.aggregate_loss(losses, mask, name, torch.tensor(4.0), 2, 3) for name in same_as)
        assert a.item() == b.item()


def test_the_loss_token_masks_by_hand():
    """off_policy_mask_threshold drops a response only when A < 0 and its mean KL(sampler || policy) is above the
    threshold; top_entropy_quantile keeps the tokens at or above the quantile of the masked entropies."""
    logprobs = torch.zeros(3, 2)
    sampler = torch.tensor([[0.4, 0.4], [0.4, 0.4], [0.1, 0.1]])  # mean KLs 0.4, 0.4, 0.1
    adv = torch.tensor([[1.0], [-1.0], [-1.0]])
    mask = torch.ones(3, 2, dtype=torch.bool)
    hp = rloo.RLOOHParams(off_policy_mask_threshold=0.2)
    keep = rloo.loss_token_mask(logprobs, torch.zeros(3, 2), adv, mask, sampler, hp)
    assert keep.tolist() == [[True, True], [False, False], [True, True]]
    entropy = torch.tensor([[0.1, 0.9], [0.5, 0.3], [0.7, 2.0]])
    mask[2, 1] = False  # the 2.0 is not a loss token: not counted in the quantile
    keep = rloo.loss_token_mask(logprobs, entropy, adv, mask, sampler, rloo.RLOOHParams(top_entropy_quantile=0.4))
    threshold = torch.quantile(torch.tensor([0.1, 0.9, 0.5, 0.3, 0.7]), 0.6).item()  # 0.58
    assert keep.tolist() == [[False, True], [False, False], [True, False]] and 0.5 < threshold < 0.7


# ---------------------------------------------------------------------------------------------------------------------
# Against TRL 1.16's own _compute_loss: rloo_step over two mini-batches of one prompt each (the second off-policy),
# SGD at lr 1; TRL's GRPOTrainer on the same batch, advantages and mini-batch order.

CASES = {  # name: RLOOHParams' settings; TRL's GRPOConfig gets the same names (cliprange: epsilon; KL: beta, k3)
    "dapo": dict(loss_type="dapo"),
    "grpo": dict(loss_type="grpo"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.05),
    "cispo, a ratio per response": dict(loss_type="cispo", epsilon_high=1.05, importance_sampling_level="sequence"),
    "cispo, k3 KL in the loss": dict(loss_type="cispo", epsilon_high=1.05, kl_in_reward=False, kl_estimator="k3",
                                     kl_coef=0.04),
    "sapo": dict(loss_type="sapo"),
    "sapo, a ratio per response": dict(loss_type="sapo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "delta": dict(loss_type="grpo", delta=1.05),
    "top_entropy_quantile": dict(loss_type="dapo", top_entropy_quantile=0.2),
    "off_policy_mask_threshold": dict(loss_type="grpo", off_policy_mask_threshold=0.02),
}
BASE = {"cispo": "dapo", "sapo": "grpo", "vespo": "dapo", "luspo": "grpo", "delta": "grpo",
        "top_entropy_quantile": "dapo", "off_policy_mask_threshold": "grpo"}  # what each switch changes


def trl_config(ours: dict) -> dict:
    names = {"cliprange": "epsilon", "kl_coef": "beta"}
    return {names.get(key, key): value for key, value in ours.items() if key not in ("kl_in_reward", "kl_estimator")}


def batch(prompts=("3+5=", "2+7=")) -> tuple:
    """test_grpo_family's batch with prompts of one length (TRL's forward takes no position ids: no left padding)
    and a sampler whose logprobs differ from the policy's."""
    tokenizer, model, ref, queries, responses, rewards = setup()
    queries = torch.tensor([tokenizer(p).input_ids for p in prompts]).repeat_interleave(K, 0)
    mask = trl_completion_mask(responses, tokenizer.eos_token_id)
    with torch.no_grad():
        old = trl_logps(model, queries, responses, mask)
    torch.manual_seed(3)
    sampler = (old + 0.05 * torch.randn_like(old)) * mask
    return tokenizer, model, ref, queries, responses, rewards, mask, sampler


def ours(settings: dict) -> tuple[torch.Tensor, dict]:
    tokenizer, model, ref, queries, responses, rewards, mask, sampler = batch()
    hp = rloo.RLOOHParams(**{"baseline": "group_mean", "scale_rewards": "group", "kl_coef": 0.0, "max_grad_norm": 1e9,
                             "num_mini_batches": 2, **settings})
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    torch.manual_seed(7)  # the mini-batch order
    metrics = rloo.rloo_step(model, ref, torch.optim.SGD(model.parameters(), lr=1.0), queries, responses, rewards,
                             hp=hp, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                             sampler_logprobs=sampler)
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before, metrics


@pytest.fixture(scope="module")
def trl_changes(tmp_path_factory) -> dict:
    """Each case's parameter change by TRL 1.16's GRPOTrainer (one subprocess in its environment)."""
    if not TRL116.exists():
        pytest.skip("no TRL 1.16 environment: python -m venv benchmarks/.trl116-venv && benchmarks/.trl116-venv/bin/"
                    "pip install torch==2.13.0 trl==1.16.0 tyro==1.0.17 peft==0.21.2")
    folder = tmp_path_factory.mktemp("trl116")
    tokenizer, model, ref, queries, responses, rewards, mask, sampler = batch()
    for name, m in (("model", model), ("ref", ref)):
        m.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    torch.manual_seed(7)
    order = [[p] for p in torch.randperm(P).tolist()]  # rloo_step's mini-batches of one prompt
    torch.save({"prompt_ids": queries, "completion_ids": responses, "completion_mask": mask, "sampler": sampler,
                "advantages": trl_advantages(rewards, "group_mean", "group")}, folder / "batch.pt")
    cases = {name: trl_config(settings) for name, settings in CASES.items()}
    (folder / "cases.json").write_text(json.dumps({**cases, "num_generations": K, "order": order}))
    result = run_script("benchmarks/trl_side.py", "grpo-losses", folder, launcher=[str(TRL116)])
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: torch.load(folder / f"{name}.pt") for name in CASES}


@pytest.mark.parametrize("name", CASES)
def test_rloo_step_moves_the_weights_as_trl_116(name, trl_changes):
    change, metrics = ours(CASES[name])
    assert_same_direction_and_size(change, trl_changes[name], tolerance=1e-5)
    base = BASE.get(name.split(",")[0])
    if base:  # the switch acted on this batch
        assert (trl_changes[name] - trl_changes[base]).abs().max() > 1e-2 * trl_changes[name].abs().max()
    if "mask" in name or "quantile" in name:
        assert metrics["policy/loss_token_frac"] < 1


def test_a_run_with_the_new_switches_and_the_others(tmp_path):
    """vespo's recipe with dynamic sampling, filtered sampling (top-k, top-p), both token masks and the KL in the
    loss: a run of the script, its metrics logged."""
    result = run_main("rloo.py", "vespo", "--dynamic-sampling", "--top-k", "3", "--top-p", "0.9",
                      "--top-entropy-quantile", "0.2", "--off-policy-mask-threshold", "0.1", "--no-kl-in-reward",
                      "--kl-estimator", "k3", "--kl-coef", "0.04", "--total-episodes", "32", "--batch-size", "16",
                      "--num-mini-batches", "2", "--eval-every", "1", "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["iteration"] == 2 and 0 < rows[-1]["policy/vespo_phi_avg"]
    assert 0 < rows[-1]["policy/loss_token_frac"] < 0.5  # a fifth of the tokens by entropy, fewer if masked


@pytest.mark.parametrize("args, words", [
    (["--loss-type", "cispo"], "error: --epsilon-high None: --loss-type cispo caps the ratio at --epsilon-high"),
    (["--top-entropy-quantile", "1.5"], "error: --top-entropy-quantile 1.5: is a share of the tokens"),
])
def test_settings_that_cannot_work_stop_with_one_line(args, words, tmp_path):
    result = run_main("rloo.py", *args, "--output-dir", tmp_path / "run")
    assert result.returncode != 0 and result.stderr.strip().splitlines()[-1].startswith(words), result.stderr[-2000:]


def test_luspo_with_token_ratios_is_noted_once(tmp_path):
    result = run_main("rloo.py", "--loss-type", "luspo", "--total-episodes", "16", "--batch-size", "16",
                      "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("note: --loss-type luspo with --importance-sampling-level token") == 1
