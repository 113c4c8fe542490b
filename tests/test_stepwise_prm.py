"""stepwise_prm.py's pure helpers against hand-built expectations, and prm_step / score_steps on real tiny models."""

import copy
import math
import random
import re

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForTokenClassification, PreTrainedTokenizerFast

import stepwise_prm as prm

X = -100  # an ignored position

# ---- tokenize_example ----------------------------------------------------------------------------------------------
# The built-in tokenizer: <pad> 0, <bos> 1, <eos> 2, <unk> 3, then one id per character of "0123456789+-*=\n ".
BOS, PLUS, EQ, NL = 1, 14, 17, 18
D = [4 + d for d in range(10)]  # the digits


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with no BOS token (unlike the built-in one)."""
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "what", "is", "two", "plus", "three", "five", "six",
                                         "equals", "END", "STEP"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


def test_tokenize_example_bos_and_one_token_separator():
    out = prm.tokenize_example(prm.build_tokenizer(), "1+2+2=", ["1+2=3", "3+2=6"], [True, False])
    assert out["input_ids"] == [BOS, D[1], PLUS, D[2], PLUS, D[2], EQ,
                                D[1], PLUS, D[2], EQ, D[3], NL,
                                D[3], PLUS, D[2], EQ, D[6], NL]
    assert out["labels"] == [X] * 7 + [X, X, X, X, X, 1] + [X, X, X, X, X, 0]


def test_tokenize_example_two_token_separator_puts_the_label_on_its_last_token():
    out = prm.tokenize_example(prm.build_tokenizer(), "1=", ["1=1"], [True], step_separator=" \n")
    assert out["input_ids"] == [BOS, D[1], EQ, D[1], EQ, D[1], 19, NL]
    assert out["labels"] == [X, X, X, X, X, X, X, 1]


def test_tokenize_example_without_bos_and_two_token_separator():
    tokenizer = word_tokenizer()
    assert tokenizer.bos_token_id is None
    out = prm.tokenize_example(tokenizer, "what is two plus three", ["two plus three equals five", "equals six"],
                               [True, False], step_separator=" END STEP")
    # what is two plus three | two plus three equals five END STEP | equals six END STEP (no BOS in front)
    assert out["input_ids"] == [2, 3, 4, 5, 6, 4, 5, 6, 9, 7, 10, 11, 9, 8, 10, 11]
    assert out["labels"] == [X] * 5 + [X, X, X, X, X, X, 1] + [X, X, X, 0]


def test_tokenize_example_last_step_only():
    out = prm.tokenize_example(prm.build_tokenizer(), "1+2+2=", ["1+2=3", "3+2=6"], [True, False],
                               train_on_last_step_only=True)
    assert out["labels"] == [X] * 7 + [X] * 6 + [X, X, X, X, X, 0]
    out = prm.tokenize_example(word_tokenizer(), "what", ["two", "six", "five"], [False, False, True],
                               step_separator=" END STEP", train_on_last_step_only=True)
    assert out["labels"] == [X, X, X, X, X, X, X, X, X, 1]


def test_tokenize_example_completion_truncation_comes_first_and_a_cut_step_loses_its_label():
    tokenizer = prm.build_tokenizer()
    args = (tokenizer, "1+2+2=", ["1+2=3", "3+2=6"], [True, False])
    # the steps are cut to 6 tokens: step 1 ("1+2=3\n") is whole and keeps its label, step 2 is gone
    out = prm.tokenize_example(*args, max_completion_length=6)
    assert out["input_ids"] == [BOS, D[1], PLUS, D[2], PLUS, D[2], EQ, D[1], PLUS, D[2], EQ, D[3], NL]
    assert out["labels"] == [X] * 12 + [1]
    # cut to 9 tokens: step 2 keeps three tokens and no label
    out = prm.tokenize_example(*args, max_completion_length=9)
    assert out["input_ids"][-3:] == [D[3], PLUS, D[2]] and out["labels"] == [X] * 12 + [1, X, X, X]
    # cut to 5: step 1 loses its separator, so its label too
    assert prm.tokenize_example(*args, max_completion_length=5)["labels"] == [X] * 12
    # the whole row to 15 tokens: the prompt counts (7), step 1 keeps its label, step 2 loses it
    out = prm.tokenize_example(*args, max_length=15)
    assert len(out["input_ids"]) == 15 and out["labels"] == [X] * 12 + [1, X, X]
    # both: the completion is cut to 9 first (16 tokens in all), then the whole to 14
    out = prm.tokenize_example(*args, max_length=14, max_completion_length=9)
    assert out["input_ids"] == [BOS, D[1], PLUS, D[2], PLUS, D[2], EQ, D[1], PLUS, D[2], EQ, D[3], NL, D[3]]
    assert out["labels"] == [X] * 12 + [1, X]
    # without BOS the prompt is one token shorter
    out = prm.tokenize_example(word_tokenizer(), "what is", ["two", "six"], [True, True], " END STEP", max_length=7)
    assert out["input_ids"] == [2, 3, 4, 10, 11, 8, 10] and out["labels"] == [X, X, X, X, 1, X, X]


# ---- the built-in task ---------------------------------------------------------------------------------------------


def sum_step(step: str) -> tuple[int, int, int]:
    a, b, c = map(int, re.fullmatch(r"(\d+)\+(\d+)=(\d+)", step).groups())
    return a, b, c


def test_multistep_problem_is_a_running_sum():
    rng = random.Random(0)
    for _ in range(200):
        p = prm.multistep_problem(rng)
        nums = [int(x) for x in p["prompt"][:-1].split("+")]
        assert 3 <= len(nums) <= 5 and all(0 <= x <= 4 for x in nums) and len(p["steps"]) == len(nums) - 1
        assert p["steps"][0].startswith(f"{nums[0]}+{nums[1]}=") and p["answer"] == str(sum(nums))


def test_multistep_rows_follow_the_math_shepherd_rule():
    rng, wrong_rows = random.Random(0), 0
    for _ in range(1000):
        row = prm.multistep_row(rng)
        nums, labels = [int(x) for x in row["prompt"][:-1].split("+")], row["labels"]
        assert len(row["completions"]) == len(labels) == len(nums) - 1
        assert all(isinstance(v, bool) for v in labels)
        assert labels == sorted(labels, reverse=True)  # some True steps, then only False ones
        total = nums[0]
        for i, step in enumerate(row["completions"]):
            a, b, c = sum_step(step)
            assert a == total and b == nums[i + 1]  # each step carries on from the previous result, right or wrong
            if i == labels.count(True):
                assert c != a + b  # the first False step is the wrong one...
            else:
                assert c == a + b  # ...and every other step is correct arithmetic
            total = c
        wrong_rows += not all(labels)
    assert 400 < wrong_rows < 600  # about half the solutions have a wrong step
    assert all(prm.multistep_row(rng, "1+2+3=", p_wrong=0.0)["labels"] == [True, True] for _ in range(10))


def test_builtin_held_out_problems_are_never_trained_on():
    train = prm.builtin_rows(random.Random(1), 2000, held_out=False)
    held_out = prm.builtin_rows(random.Random(0), 300, held_out=True)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}


# ---- batching ------------------------------------------------------------------------------------------------------


def test_pad_batch_right_pads():
    batch = prm.pad_batch([{"input_ids": [5, 6, 7], "labels": [X, X, 1]}, {"input_ids": [8], "labels": [0]}], 0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[X, X, 1], [0, X, X]]


def test_length_grouped_batches_cover_an_epoch_with_little_padding():
    lengths = [random.Random(i).randint(5, 60) for i in range(1000)]
    batches = prm.length_grouped_batches(lengths, 20, seed=0)
    assert len(batches) == 50 and sorted(i for b in batches for i in b) == list(range(1000))
    waste = lambda bs: sum(max(lengths[i] for i in b) - lengths[i] for b in bs for i in b)  # noqa: E731
    shuffled = torch.randperm(1000, generator=torch.Generator().manual_seed(0)).view(50, 20).tolist()
    assert waste(batches) < 0.1 * waste(shuffled)
    assert batches != prm.length_grouped_batches(lengths, 20, seed=1)  # each epoch in a new order
    state = {"epoch": 0, "batches": []}
    drawn = [prm.next_batch(lengths, state, 20, seed=0) for _ in range(51)]
    assert sorted(map(tuple, drawn[:50])) == sorted(map(tuple, batches)) and state["epoch"] == 2


def test_a_resume_with_another_batch_size_draws_batches_of_that_size():
    """A checkpoint keeps the rest of its epoch's batches, cut at the size it was run with: resumed with another
    --batch-size, those batches trained instead (8 rows a step where 32 were asked for), silently, to its end."""
    lengths = [random.Random(i).randint(5, 60) for i in range(1000)]
    state = {"epoch": 0, "batches": []}
    prm.next_batch(lengths, state, 8, seed=0)
    assert [len(prm.next_batch(lengths, state, n, seed=0)) for n in (32, 32, 4)] == [32, 32, 4]


def test_first_true():
    mask = torch.tensor([[0, 1, 1], [0, 0, 0], [1, 0, 0]]).bool()
    assert prm.first_true(mask).tolist() == [1, 3, 0]


# ---- prm_step, score_steps, evaluate on a real tiny model ----------------------------------------------------------


def tiny_prm(seed: int = 0):
    torch.manual_seed(seed)
    tokenizer = prm.build_tokenizer()
    config = prm.build_tiny_model(tokenizer).config
    config.num_labels = 2
    model = AutoModelForTokenClassification.from_config(config)
    model.dropout.p = 0.0
    return tokenizer, model


def examples(tokenizer, n: int = 12, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [prm.tokenize_example(tokenizer, **prm.multistep_row(rng)) for _ in range(n)]


def test_prm_step_changes_parameters_and_returns_finite_metrics():
    tokenizer, model = tiny_prm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = prm.prm_step(model, optimizer, examples(tokenizer), pad_token_id=tokenizer.pad_token_id,
                           gradient_accumulation_steps=3)
    assert set(metrics) == {"train/loss", "train/step_accuracy", "train/pad_fraction", "train/tokens",
                            "train/nonfinite_skipped"}
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert 0 <= metrics["train/step_accuracy"] <= 1 and 0 <= metrics["train/pad_fraction"] < 1
    assert metrics["train/loss"] == pytest.approx(math.log(2), abs=0.3)  # a fresh head is close to a coin toss
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_prm_step_nonfinite_loss_stops_or_is_skipped():
    tokenizer, model = tiny_prm()
    with torch.no_grad():
        model.score.bias.fill_(float("nan"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(FloatingPointError):
        prm.prm_step(model, optimizer, examples(tokenizer), pad_token_id=tokenizer.pad_token_id)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = prm.prm_step(model, optimizer, examples(tokenizer), pad_token_id=tokenizer.pad_token_id,
                           skip_nonfinite=True)
    assert metrics["train/nonfinite_skipped"] == 1.0
    for a, b in zip(before, model.parameters()):  # no update was taken (the NaN bias stays NaN)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert all(p.grad is None for p in model.parameters())


def test_prm_step_accumulation_matches_one_big_batch():
    tokenizer, model = tiny_prm()
    batch = examples(tokenizer)
    updated = []
    for accumulation in (1, 4):
        m = copy.deepcopy(model)
        prm.prm_step(m, torch.optim.SGD(m.parameters(), lr=0.1), batch, pad_token_id=tokenizer.pad_token_id,
                     gradient_accumulation_steps=accumulation, max_grad_norm=1e9)
        updated.append(m)
    for a, b in zip(updated[0].parameters(), updated[1].parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_unlabelled_tokens_get_no_gradient():
    tokenizer, model = tiny_prm()
    batch = examples(tokenizer, n=4)
    grads = []

    def keep_grad(module, inputs, out):
        out.register_hook(grads.append)

    handle = model.score.register_forward_hook(keep_grad)
    prm.prm_step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, pad_token_id=tokenizer.pad_token_id)
    handle.remove()
    labelled = prm.pad_batch(batch, tokenizer.pad_token_id)["labels"] != X
    per_position = grads[0].abs().sum(-1)  # [B, L]: gradient reaching each position's logits
    assert (per_position[~labelled] == 0).all() and (per_position[labelled] > 0).all()


def test_score_steps_shapes_range_and_batching():
    tokenizer, model = tiny_prm()
    single = prm.score_steps(model, tokenizer, "1+2+3=", ["1+2=3", "3+3=6"])
    assert len(single) == 2 and all(0.0 <= s <= 1.0 for s in single)
    prompts, solutions = ["1+2+3=", "4+4+4+4+4=", "0+0+1="], [["1+2=3", "3+3=6"], ["4+4=8", "8+4=12", "12+4=16",
                                                                                   "16+4=20"], ["0+0=0", "0+1=2"]]
    many = prm.score_steps(model, tokenizer, prompts, solutions, batch_size=2)
    assert [len(s) for s in many] == [2, 4, 2]
    torch.testing.assert_close(torch.tensor(many[0]), torch.tensor(single))  # right padding changes nothing
    # the score is softmax(logits)[..., 1] at each step's last token
    ids = torch.tensor([prm.tokenize_example(tokenizer, prompts[1], solutions[1], [True] * 4)["input_ids"]])
    probs = model(ids).logits.softmax(-1)[0, :, 1]
    ends = [i for i, t in enumerate(ids[0].tolist()) if t == NL]
    torch.testing.assert_close(torch.tensor(many[1]), probs[ends].detach(), atol=1e-5, rtol=1e-5)
    assert model.training  # score_steps leaves the mode as it found it


def constant_prm(correct: bool):
    """A tiny PRM whose head says 'correct' (or 'wrong') everywhere."""
    tokenizer, model = tiny_prm()
    with torch.no_grad():
        model.score.weight.zero_()
        model.score.bias.copy_(torch.tensor([0.0, 1.0] if correct else [1.0, 0.0]))
    return tokenizer, model


def test_evaluate_hand_computed():
    rows = [{"prompt": "1+1+1=", "completions": ["1+1=2", "2+1=3"], "labels": [True, True]},
            {"prompt": "1+1+1=", "completions": ["1+1=3", "3+1=4"], "labels": [False, False]},
            {"prompt": "1+1+1=", "completions": ["1+1=2", "2+1=4"], "labels": [True, False]}]
    tokenizer, model = constant_prm(correct=True)
    data = [prm.tokenize_example(tokenizer, **r) for r in rows]
    metrics = prm.evaluate(model, data, tokenizer.pad_token_id, torch.device("cpu"), batch_size=2)
    # 3 of 6 steps are right; no step is called wrong; only the first solution has its first wrong step (none) found
    assert metrics == {"eval/step_accuracy": 0.5, "eval/wrong_step_precision": 0.0, "eval/wrong_step_recall": 0.0,
                       "eval/wrong_step_f1": 0.0, "eval/solution_accuracy": pytest.approx(1 / 3)}
    tokenizer, model = constant_prm(correct=False)
    metrics = prm.evaluate(model, data, tokenizer.pad_token_id, torch.device("cpu"))
    # every step called wrong: precision 3/6, recall 1, F1 2/3; the second row's first wrong step is found
    assert metrics["eval/step_accuracy"] == 0.5 and metrics["eval/wrong_step_precision"] == 0.5
    assert metrics["eval/wrong_step_recall"] == 1.0 and metrics["eval/wrong_step_f1"] == pytest.approx(2 / 3)
    assert metrics["eval/solution_accuracy"] == pytest.approx(1 / 3)


def test_best_of_n_against_random_pick():
    rng = random.Random(0)
    candidates = [[prm.multistep_row(rng, "1+2+3+4=") for _ in range(4)] for _ in range(20)]
    tokenizer, model = constant_prm(correct=True)  # every candidate scores the same: the first one is picked
    metrics = prm.best_of_n(model, tokenizer, candidates, "\n", torch.device("cpu"))
    assert metrics["eval/best_of_n_accuracy"] == pytest.approx(sum(all(c[0]["labels"]) for c in candidates) / 20)
    expected_random = sum(sum(all(x["labels"]) for x in c) / 4 for c in candidates) / 20
    assert metrics["eval/random_pick_accuracy"] == pytest.approx(expected_random)
