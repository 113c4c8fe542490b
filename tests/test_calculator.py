"""examples/calculator.py: the tool and its parser, malformed calls, the episode masks in ppo_step, and a tiny run."""

import builtins
import copy
import importlib.util
import json

import pytest
import torch
from transformers import AutoModelForTokenClassification

import ppo
from conftest import ROOT, assert_one_line_error, run_script

spec = importlib.util.spec_from_file_location("calculator", ROOT / "examples" / "calculator.py")
calc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(calc)


@pytest.fixture
def tokenizer():
    return calc.build_tokenizer()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


# ---- the tool ------------------------------------------------------------------------------------------------------


def test_calculator_hand_computed(monkeypatch):
    monkeypatch.setattr(builtins, "eval", None)  # the tool must not need Python's eval
    cases = {"7": 7, "123*456": 56088, "2+3*4": 14, "10-2-3": 5, "12*-3+4": -32, "-5*-5": 25, "3--4": 7,
             "2*3*4-1": 23, "56088+789": 56877, "0*999": 0}
    assert {e: calc.calculator(e) for e in cases} == cases


@pytest.mark.parametrize("expression", ["", "12*", "*3", "1 +2", "2**8", "(1+2)", "3/4", "1e5", "abc", "3---4",
                                        "__import__('os').system('true')", "<calc>1+2", "999999*999999*2",
                                        "1" * 13])
def test_calculator_rejects_everything_else(expression):
    with pytest.raises(ValueError, match="bad expression|too large"):
        calc.calculator(expression)


def test_parse_call():
    assert calc.parse_call("<calc>12*3</calc>") == "12*3"
    assert calc.parse_call("junk<calc>1+2</calc>") == "1+2"
    assert calc.parse_call("<calc></calc>") == ""
    with pytest.raises(ValueError, match="unterminated call"):
        calc.parse_call("<calc>12*3")
    with pytest.raises(ValueError, match="missing start"):
        calc.parse_call("12*3</calc>")


def test_tool_output_is_always_text():
    assert calc.tool_output("<calc>123*456</calc>") == "<out>56088</out>"
    assert calc.tool_output("<calc>12*</calc>") == "<out>error: bad expression</out>"
    assert calc.tool_output("<calc>12*3") == "<out>error: unterminated call</out>"
    assert calc.tool_output("<calc>1+1</calc>", tool=False) == "<out>error: no calculator</out>"


def test_tokenizer_has_one_token_per_tag_and_round_trips(tokenizer):
    text = "<calc>123*456</calc><out>error: bad expression</out>56088"
    assert ids(tokenizer, "<calc></calc><out></out>") == [4, 5, 6, 7]
    assert tokenizer.unk_token_id not in ids(tokenizer, text)
    assert tokenizer.decode(ids(tokenizer, text)) == text


# ---- episodes ------------------------------------------------------------------------------------------------------


def play(tokenizer, turns: list[str], max_calls: int = 3) -> calc.Episode:
    """Feed scripted model turns to step_episode ('<eos>' in a turn stands for the EOS token)."""
    ep = calc.Episode(tokenizer("calc: 12*34+5=").input_ids)
    for turn in turns:
        text, eos = turn.removesuffix("<eos>"), turn.endswith("<eos>")
        assert not ep.done
        calc.step_episode(ep, ids(tokenizer, text) + [tokenizer.eos_token_id] * eos, tokenizer, max_calls)
    return ep


def tool_text(tokenizer, ep: calc.Episode) -> list[str]:
    """The runs of mask-0 tokens, decoded."""
    runs, current = [], []
    for token, m in zip(ep.ids, ep.mask):
        if m == 0:
            current.append(token)
        elif current:
            runs, current = runs + [tokenizer.decode(current)], []
    return runs + ([tokenizer.decode(current)] if current else [])


def test_good_episode_masks_exactly_the_tool_output(tokenizer):
    ep = play(tokenizer, ["<calc>12*34</calc>", "<calc>408+5</calc>", "413<eos>"])
    assert ep.done and ep.answer == "413" and ep.calls == 2 and ep.errors == 0
    assert tool_text(tokenizer, ep) == ["<out>408</out>", "<out>413</out>"]
    assert tokenizer.decode(ep.ids) == "<calc>12*34</calc><out>408</out><calc>408+5</calc><out>413</out>413<eos>"
    assert calc.reward(ep, {"answer": "413"}) == 1.0 and calc.reward(ep, {"answer": "414"}) == 0.0


@pytest.mark.parametrize("turn, error", [("<calc>12*</calc>", "bad expression"),
                                         ("<calc>12*34", "unterminated call"),       # the token limit
                                         ("<calc>12*34<eos>", "unterminated call"),  # EOS inside the call
                                         ("12*34</calc>", "missing start")])
def test_malformed_call_gets_an_error_message_and_the_episode_goes_on(tokenizer, turn, error):
    ep = play(tokenizer, [turn])
    assert not ep.done and ep.calls == 1 and ep.errors == 1
    assert tool_text(tokenizer, ep) == [f"<out>error: {error}</out>"]
    eos = [tokenizer.eos_token_id] * turn.endswith("<eos>")  # an EOS that left the call open stays, mask 1
    assert [t for t, m in zip(ep.ids, ep.mask) if m] == ids(tokenizer, turn.removesuffix("<eos>")) + eos
    play_on = play(tokenizer, [turn, "<calc>12*34</calc>", "413<eos>"])  # the model can recover
    assert play_on.done and play_on.answer == "413" and play_on.errors == 1


def test_episode_ends_without_answer_past_the_call_limit_or_at_the_token_limit(tokenizer):
    ep = play(tokenizer, ["<calc>1+1</calc>", "<calc>2+2</calc>"], max_calls=1)
    assert ep.done and ep.answer is None and ep.calls == 2
    assert tokenizer.decode(ep.ids) == "<calc>1+1</calc><out>2</out><calc>2+2</calc>"  # ends on model tokens
    ep = play(tokenizer, ["4133333"])  # no EOS, no call: cut by the token limit
    assert ep.done and ep.answer is None and ep.calls == 0


def test_run_episodes_with_a_random_model_never_raises(tokenizer):
    torch.manual_seed(0)
    policy = ppo.build_tiny_model(tokenizer).eval()
    gen, _ = ppo.generation_configs(ppo.GenArgs(max_new_tokens=12), tokenizer, 1.0)
    prompts = [f"calc: {i}*7+1=" for i in range(32)]
    episodes = calc.run_episodes(policy, tokenizer, prompts, gen, max_calls=2)
    assert all(ep.done and len(ep.ids) == len(ep.mask) and ep.calls <= 3 for ep in episodes)
    assert sum(ep.calls for ep in episodes) > 0 and sum(ep.errors for ep in episodes) > 0  # random calls: malformed
    for ep in episodes:
        outs = tool_text(tokenizer, ep)
        assert len(outs) == min(ep.calls, 2) and all(o.startswith("<out>") and o.endswith("</out>") for o in outs)
    queries, responses, masks = calc.episode_batch(episodes, tokenizer.pad_token_id)
    assert queries.shape[0] == responses.shape[0] == 32 and responses.shape == masks.shape
    for i, ep in enumerate(episodes):
        assert masks[i].tolist() == ep.mask + [0] * (masks.shape[1] - len(ep.mask))
        assert (responses[i, len(ep.ids):] == tokenizer.pad_token_id).all()


def test_demo_batch_labels_skip_the_prompt_and_the_tool_output(tokenizer):
    task = {"question": "12*34+5=", "answer": "413", "a": 12, "b": 34, "c": 5}
    batch = calc.demo_batch(tokenizer, [task, task, task], ["tool", "mental", "direct"])
    labelled = [tokenizer.decode([t for t in row.tolist() if t != -100]) for row in batch["labels"]]
    assert labelled == ["<calc>12*34</calc><calc>408+5</calc>413<eos>", "<calc>12*34</calc>413<eos>", "413<eos>"]
    assert tokenizer.decode(batch["input_ids"][2][batch["attention_mask"][2].bool()]) == "<bos>12*34+5=413<eos>"


# ---- ppo_step on episodes the loop builds ---------------------------------------------------------------------------


def test_tool_tokens_get_no_gradient_and_no_kl(tokenizer):
    episodes = [play(tokenizer, ["<calc>12*34</calc>", "<calc>408+5</calc>", "413<eos>"]),
                play(tokenizer, ["<calc>12*</calc>", "413<eos>"]),
                play(tokenizer, ["<calc>12*34<eos>", "<calc>408+5</calc>", "4<eos>"]),
                play(tokenizer, ["41<eos>"])]
    queries, responses, masks = calc.episode_batch(episodes, tokenizer.pad_token_id)
    torch.manual_seed(0)
    policy, ref = ppo.build_tiny_model(tokenizer), ppo.build_tiny_model(tokenizer).requires_grad_(False)
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    value = ppo.disable_dropout(AutoModelForTokenClassification.from_config(config))
    optimizer = torch.optim.AdamW([*policy.parameters(), *value.parameters()], lr=1e-2)
    before = copy.deepcopy(policy)
    grads = []

    def keep_grad(module, inputs, out):
        if out.requires_grad:
            out.register_hook(grads.append)

    handle = policy.lm_head.register_forward_hook(keep_grad)
    hp = ppo.PPOHParams(num_ppo_epochs=1, num_mini_batches=1, kl_coef=0.1, logits_chunk=0)  # whole logits: hooked
    metrics = ppo.ppo_step(policy, value, ref, optimizer, queries, responses, torch.tensor([1.0, 1.0, 0.0, 0.0]),
                           masks, hp=hp, pad_token_id=tokenizer.pad_token_id)  # as the loop calls it: no EOS id
    handle.remove()
    (grad,) = grads  # [1, N, V]: the logits at the N valid response tokens' scoring positions, row-major
    valid = ppo.response_valid_mask(responses, tokenizer.pad_token_id, None, masks)
    query_mask = (queries != tokenizer.pad_token_id).cumsum(1) > 0
    assert grad.shape[:2] == (1, int(valid.sum()))
    per_position = torch.zeros(responses.shape)  # [B, T]: gradient reaching the logits of each token
    per_position[valid] = grad[0].abs().sum(-1)
    # where the tool's tokens are, found from the text (<out> ... </out>), not from the masks under test
    in_out = (responses == tokenizer.convert_tokens_to_ids("<out>")).cumsum(1) \
        - (responses == tokenizer.convert_tokens_to_ids("</out>")).cumsum(1)
    tool = (in_out > 0) | (responses == tokenizer.convert_tokens_to_ids("</out>"))
    model = (responses != tokenizer.pad_token_id) & ~tool
    assert tool.sum(1).tolist() == [10, 23, 31, 0]  # <out>408</out><out>413</out>; errors; none
    assert (per_position[tool] == 0).all() and (per_position[responses == tokenizer.pad_token_id] == 0).all()
    assert (per_position[model] > 0).all()
    # the KL in the metrics counts only the model's tokens
    with torch.no_grad():
        lp, _ = ppo.response_logprobs(before, queries, query_mask, responses, valid, 1.0)
        rp, _ = ppo.response_logprobs(ref, queries, query_mask, responses, valid, 1.0)
    expected_kl = ((lp - rp) * masks).sum(1).mean().item()
    assert metrics["objective/kl"] == pytest.approx(expected_kl, rel=1e-4, abs=1e-5)
    assert metrics["val/response_length"] == pytest.approx(sum(len(ep.ids) for ep in episodes) / 4)


# ---- the script ----------------------------------------------------------------------------------------------------


def test_bad_flags_stop_with_one_line():
    with pytest.raises(SystemExit, match="error: --mental-fraction 1.5"):
        calc.main(calc.Args(mental_fraction=1.5))
    with pytest.raises(SystemExit, match="error: --num-eval-tasks 500: give 1 to 250"):
        calc.main(calc.Args(digits=1, num_eval_tasks=500))


def test_tiny_run_from_another_folder_writes_metrics(tmp_path):
    out = tmp_path / "run"
    result = run_script("examples/calculator.py", "--sft-steps", "30", "--sft-batch-size", "16", "--ppo-iterations",
                        "2", "--batch-size", "8", "--num-mini-batches", "2", "--num-ppo-epochs", "1",
                        "--num-eval-tasks", "8", "--eval-every", "0", "--output-dir", out, cwd=tmp_path,
                        env={"PYTHONPATH": ""}, timeout=300)  # no PYTHONPATH: the script finds ppo.py itself
    assert result.returncode == 0, result.stderr[-3000:]
    assert "accuracy with the tool:" in result.stdout.strip().splitlines()[-1]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["phase"] for r in rows} == {"sft", "ppo"}
    evals = [r for r in rows if "eval/accuracy" in r]
    assert len(evals) == 2 and all("eval_no_tool/accuracy" in r for r in evals)  # --eval-every 0: warm start, end
    ppo_rows = [r for r in rows if r["phase"] == "ppo" and "objective/kl" in r]
    assert len(ppo_rows) == 2 and all("rollout/calls" in r for r in ppo_rows)
    assert json.loads((out / "config.json").read_text())["mental_fraction"] == 0.7
    assert (out / "model" / "config.json").exists() and (out / "warm_start" / "tokenizer.json").exists()
    again = run_script("examples/calculator.py", "--output-dir", out, cwd=tmp_path, env={"PYTHONPATH": ""})
    assert_one_line_error(again, "--output-dir", "metrics.jsonl")  # the finished run is kept, not overwritten
