"""What the scripts and the docs tell the user holds: the evaluation set of the built-in task, the note on sampling
filters, the size of RLOO's per-token loss against TRL's sequence loss, and every 'exactly' in the pages."""

import json
import re
import textwrap

import torch

import ppo
import rloo
from conftest import ROOT, run_main

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TINY = ["--total-episodes", "16", "--batch-size", "8", "--num-mini-batches", "1", "--num-ppo-epochs", "1",
        "--eval-every", "1", "--num-eval-prompts", "4"]


def test_builtin_evaluation_sums_are_the_training_prompts_and_no_page_calls_them_held_out():
    rng = __import__("random").Random(0)
    drawn = {ppo.addition_prompt(rng)["prompt"] for _ in range(2000)}
    evaluated = {row["prompt"] for row in ppo.addition_eval_rows()}
    assert evaluated == drawn  # all 100 sums are trained on: evaluation measures the training distribution
    for page in PAGES:
        for line in page.read_text().splitlines():
            assert not re.search(r"held[- ]out.{0,40}sums|sums.{0,40}held[- ]out", line, re.I), f"{page.name}: {line}"
    for script in ("ppo.py", "rloo.py"):
        text = (ROOT / script).read_text()
        assert "held-out sums" not in text and "held out sums" not in text


def test_sampling_filters_are_on_policy_and_only_the_others_are_named_off_policy(tmp_path, capsys):
    """top-k, top-p and min-p: the update's logprobs use the sampler's support, so a run logs a sampler-trainer
    difference at float noise and prints no note; a repetition penalty and a minimum length stay off-policy, said."""
    ppo.print_once.cache_clear()
    ppo.generation_configs(ppo.GenArgs(), ppo.build_tokenizer(), 1.0, top_k=3, top_p=0.9, min_p=0.1)
    assert capsys.readouterr().out == ""
    ppo.generation_configs(ppo.GenArgs(min_new_tokens=2, repetition_penalty=1.2), ppo.build_tokenizer(), 1.0)
    note = capsys.readouterr().out
    assert "--min-new-tokens 2" in note and "--repetition-penalty 1.2" in note and "off-policy" in note
    for script in ("ppo.py", "rloo.py"):
        help_text = " ".join(run_main(script, "--help").stdout.replace("│", " ").split())  # one line of words
        for flag, words in (("--top-k", "on-policy"), ("--top-p", "on-policy"), ("--min-p", "same support"),
                            ("--repetition-penalty", "off-policy"), ("--min-new-tokens", "off-policy")):
            block = help_text[re.search(f"{flag} [A-Z]", help_text).start():][:300]  # the flag's own entry
            assert words in block, f"{script} --help: {flag} does not say {words}"
        filtered = run_main(script, *TINY, "--top-k", "3", "--top-p", "0.9", "--output-dir", tmp_path / script, *(
            ["--rloo-k", "2"] if script == "rloo.py" else []))
        assert filtered.returncode == 0, filtered.stderr[-2000:]
        assert "off-policy" not in filtered.stdout, filtered.stdout[-2000:]
        rows = [json.loads(line) for line in (tmp_path / script / "metrics.jsonl").read_text().splitlines()[1:]]
        assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in rows), rows
        assert all(abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4 for r in rows), rows
        penalised = run_main(script, *TINY, "--repetition-penalty", "1.3", "--output-dir", tmp_path / f"p-{script}", *(
            ["--rloo-k", "2"] if script == "rloo.py" else []))
        lines = [line for line in penalised.stdout.splitlines() if "off-policy" in line]
        assert len(lines) == 1 and "--repetition-penalty 1.3" in lines[0], penalised.stdout[-2000:]


def sequence_level_loss(logprobs: torch.Tensor, old: torch.Tensor, train: torch.Tensor, adv: torch.Tensor):
    """TRL's RLOO loss (v0.19, v1.9): one ratio per sequence from the summed logprobs, averaged over sequences."""
    ratio = ((logprobs - old) * train).sum(1).exp()  # [B]
    return (-adv * ratio).mean()


def test_per_token_loss_agrees_with_the_sequence_loss_in_direction_and_differs_by_responses_over_tokens():
    torch.manual_seed(0)
    tokenizer = rloo.build_tokenizer()
    policy = rloo.build_tiny_model(tokenizer)
    k, pad = 4, tokenizer.pad_token_id
    queries = rloo.left_pad([tokenizer("3+4=").input_ids, tokenizer("2+2=").input_ids], pad)
    responses = torch.randint(4, len(tokenizer), (8, 5))
    for i, n in enumerate([1, 2, 3, 5, 4, 2, 5, 3]):
        responses[i, n:] = pad
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 0.0, 0.75])
    hp = rloo.RLOOHParams(rloo_k=k, kl_coef=0.0, max_grad_norm=1e9)
    before = [p.detach().clone() for p in policy.parameters()]
    rloo.rloo_step(policy, policy, torch.optim.SGD(policy.parameters(), lr=1.0), queries.repeat_interleave(k, 0),
                   responses, rewards, hp=hp, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
    per_token = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, policy.parameters())])  # = its gradient
    with torch.no_grad():
        for p, b in zip(policy.parameters(), before):
            p.copy_(b)
    valid = responses != pad
    query_mask = (queries != pad).cumsum(1) > 0
    logprobs, _ = rloo.response_logprobs(policy, queries, query_mask, responses, valid, 1.0)
    advantages, _ = rloo.group_advantages(rewards, k, "leave_one_out", "none")
    policy.zero_grad()
    sequence_level_loss(logprobs, logprobs.detach(), valid, advantages).backward()
    sequence = torch.cat([p.grad.flatten() for p in policy.parameters()])
    cosine = torch.nn.functional.cosine_similarity(per_token, sequence, dim=0)
    assert cosine > 0.9999
    factor = len(responses) / valid.sum().item()  # responses / trained tokens
    torch.testing.assert_close(per_token.norm() / sequence.norm(), torch.tensor(factor), rtol=1e-3, atol=0)
    page = (ROOT / "docs" / "rloo.md").read_text()
    assert "agree exactly" not in page and "responses / trained tokens" in page


def test_exactly_in_the_docs_is_said_only_where_it_holds():
    """Every 'exactly' left in the pages is one of these reviewed sentences (a new one needs a review too)."""
    allowed = ["which continues exactly", "exactly 32 new tokens", "exactly `prompts`", "exactly that",
               "exactly as TRL's trainers call them", "is exactly\n1", "all exactly equal", "exactly 1 on-policy",
               "first wrong step exactly", "tokenizes exactly as training", "found exactly",
               "exactly as the standalone", "exactly with one mini-batch", "exactly the packages",
               "gradients exactly, summing", "reads exactly what training read",
               "state and resume exactly",  # LoRA checkpoints: test_lora.py's resume test (bit-identical weights)
               "optimizer states, and resume exactly"]  # interleave.py with LoRA: test_interleave_lora.py's
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"exactly", text):
            context = text[max(0, m.start() - 40):m.end() + 30]
            shown = textwrap.shorten(context, 90)
            assert any(a in context for a in allowed), f"{page.name}: unreviewed 'exactly': {shown}"
