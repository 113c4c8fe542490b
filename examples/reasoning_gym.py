# /// script
# requires-python = ">=3.11"
# dependencies = ["reasoning-gym==0.1.25", "math-verify==0.9.0"]
# ///
"""Any reasoning-gym task for rloo.py and ppo.py, offline: a prompt dataset writer and a reward by the task's scorer.

reasoning-gym (Stojanovski et al. 2025, arXiv 2505.24760) generates about a hundred tasks procedurally (arithmetic,
logic, puzzles, ...), each entry a question, an answer and metadata, each task with its scorer `score_answer`. This file
turns a task into what the scripts take: `--dataset` (a folder of train.jsonl and test.jsonl, which `datasets` reads as
the splits 'train' and 'test') and `--reward-fn examples/reasoning_gym.py:score`. Each row holds:

    prompt   chat messages: a system prompt of reasoning-gym's (--system-prompt; 'default': think step by step, then
             give the answer as <answer>...</answer>), --shots solved train entries (question, then the assistant's
             <answer>...</answer>), then the question
    entry    the task's entry (question, answer, metadata) as JSON, which the task's scorer reads
    config   the task's --config as JSON, under which the scorer is built (some read theirs: decimal_arithmetic's
             tolerance, puzzle24's number range); a dataset without the column is scored under the task's defaults

`score` takes the last <answer>...</answer> of a completion (reasoning-gym's `extract_answer`; none: 0) and scores it
with the task's scorer, found by the entry's `source_dataset`. Where the right answer is an integer, math-verify parses
both and an equal answer scores 1 ("292 legs", "\\boxed{292}", "292.0" and "+292" are 292; "- 3" and "−3" are -3); an
unequal one keeps the credit of a task's own scorer (gsm_symbolic: 0.01 for any number) below 1 (gsm_symbolic's reads
-747 as 747) but 0 from the generic one, whose substring credit would give "10" 0.5 against "0". Other answers are the
task's scorer's alone, which knows what they must be: a fraction in lowest terms, a decimal to 12 significant digits,
any expression that makes 24.

The test split is held out: reasoning-gym seeds entry i of a task with seed + i, so the train split takes the seeds
seed .. seed + size - 1, the test split those from seed + size on, and a test question equal to a train question (or to
an earlier test one) is skipped all the same. The shots are train entries, never the row's own.

    python examples/reasoning_gym.py --task leg_counting --size 2000 --eval-size 200 --seed 1 --out data/leg_counting
    python rloo.py grpo --model benchmarks/.cache/real_model/SmolLM2-135M-Instruct --dataset data/leg_counting \\
        --eval-split test --reward-fn examples/reasoning_gym.py:score --max-new-tokens 256
    python examples/reasoning_gym.py --task basic_arithmetic --config '{"max_terms": 2, "max_digits": 1}'
    python examples/reasoning_gym.py --list     # the task names; a task's --config fields: its *Config dataclass

Without a shot, SmolLM2-135M-Instruct wrote no <answer> tag in 72 replies under four instructions (so scored 0); with
one it tags 83-100% of its replies, answering at once. Its greedy accuracy on 64 held-out rows (1 shot, 256 new
tokens): leg_counting 0.00, basic_arithmetic with --config '{"max_terms": 2, "max_digits": 1}' 0.16, letter_counting
0.30 (a third of the answers are 1).

With --answer-fn examples/reasoning_gym.py:final_answer, --eval-num-samples N also logs eval/maj@N. `prompt` serves
--prompt-fn with TASK, SYSTEM_PROMPT and SHOTS, a fresh entry per call, but the scripts' evaluation draws may repeat
training questions: for a held-out evaluation, write a dataset.
"""

import argparse
import functools
import json
import random
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from math_verify import parse, verify

# this file has the package's name: off the path with its folder, or `import reasoning_gym` would import this file
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
import reasoning_gym  # noqa: E402
from reasoning_gym.dataset import ProceduralDataset  # noqa: E402
from reasoning_gym.factory import DATASETS  # noqa: E402
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer  # noqa: E402

TASK = "leg_counting"
"""the task of `prompt` and the writer's default"""
SIZE, EVAL_SIZE, SEED = 2000, 200, 1
"""the writer's defaults: rows of the train and test splits, and the seed of the first train entry"""
SYSTEM_PROMPT = "default"
"""a name in reasoning_gym.utils.SYSTEM_PROMPTS, or 'none' (no system message)"""
SHOTS = 1
"""solved examples before the question: small models (SmolLM2-135M) write no <answer> tags without one"""
INTEGER = re.compile(r"-?\d+")
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def row(entry: dict, system_prompt: str = SYSTEM_PROMPT, shots: Sequence[dict] = (), config: str = "{}") -> dict:
    """A prompt row: as chat messages the system prompt, each shot's question and its answer in tags (the assistant's
    turn), and the question; the whole entry as JSON, and the task's config (JSON)."""
    system = [] if system_prompt == "none" else [{"role": "system", "content": SYSTEM_PROMPTS[system_prompt]}]
    shown = [m for s in shots for m in ({"role": "user", "content": s["question"]},
                                        {"role": "assistant", "content": f"<answer>{s['answer']}</answer>"})]
    return {"prompt": [*system, *shown, {"role": "user", "content": entry["question"]}], "entry": encode(entry),
            "config": config}


def encode(entry: dict) -> str:
    """The entry as JSON; what JSON has no type for (gsm_symbolic's Fractions) as its str()."""
    return json.dumps(entry, default=str)


def prompt(rng: random.Random) -> dict:
    """--prompt-fn: a fresh entry of TASK after SHOTS others, from a seed that rng draws."""
    *shots, entry = reasoning_gym.create_dataset(TASK, seed=rng.getrandbits(32), size=SHOTS + 1)
    return row(entry, SYSTEM_PROMPT, shots)


def final_answer(completion: str) -> str | None:
    """The text of the completion's last <answer>...</answer>, stripped; None without one (also for --answer-fn)."""
    return extract_answer(completion)


@functools.cache
def task_scorer(name: str, config: str = "{}"):
    """The task's own score_answer(answer, entry) -> [0, 1] under its config (JSON), built once per task and config."""
    dataset_cls, config_cls = DATASETS[name]
    return dataset_cls(config=config_cls(**json.loads(config))).score_answer


def score_entry(completion: str, entry: dict, config: str = "{}") -> float:
    """The reward of one completion: 0 without an answer. An integer answer: 1 if it holds one number and math-verify
    finds it equal to the right one (math-verify would take "3 or 4" as 4 and evaluate "-5 * 9"; a leading + or a
    spaced or Unicode minus is a sign), else the task's own scorer's credit below 1, or 0 where the task has only the
    generic scorer (its substring credit would give "10" 0.5 against "0"). Any other answer: the task's scorer alone."""
    answer = final_answer(completion)
    if answer is None:
        return 0.0
    scorer, read = task_scorer(entry["metadata"]["source_dataset"], config), []
    if INTEGER.fullmatch(str(entry["answer"])):
        read = parse(re.sub(r"^\+|^-\s+", lambda m: m[0][0].strip("+"), answer.replace("\u2212", "-")))  # +3, - 3, −3
        if len(NUMBER.findall(answer)) == 1 and verify(parse(entry["answer"]), read):  # not "3 or 4", nor "-5 * 9"
            return 1.0
        if scorer.__func__ is ProceduralDataset.score_answer:
            return 0.0
    try:
        credit = float(scorer(answer, entry))
    except Exception:  # model text can break a scorer (prime_factorization's raises ValueError on "abc"): no credit
        return 0.0
    return 0.0 if read and credit >= 1 else credit  # another number read: a scorer that says right is wrong (-3 for 3)


def score(prompts: list, completions: list, entry: list[str], config: list[str] | None = None, **kwargs) -> list[float]:
    """--reward-fn, called as TRL calls it: a completion is text or [{'role': 'assistant', 'content': text}]."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    configs = config or ["{}"] * len(entry)
    return [score_entry(text, json.loads(e), c) for text, e, c in zip(texts, entry, configs, strict=True)]


# ---------------------------------------------------------------------------------------------------------------------
# The writer


def fail(flag: str, value, fix: str) -> NoReturn:
    """Stop with one line that names the flag, its value and the fix, as the scripts do."""
    raise SystemExit(f"error: {flag} {value!r}: {fix}")


def make_splits(task: str, size: int, eval_size: int, seed: int, config: dict) -> tuple[list[dict], list[dict]]:
    """The train entries (seeds seed .. seed + size - 1) and the test entries (seeds from seed + size on, each
    question new: not in train, not earlier in test; 10 x eval_size candidates at most)."""
    try:
        train = list(reasoning_gym.create_dataset(task, seed=seed, size=size, **config))
        candidates = reasoning_gym.create_dataset(task, seed=seed + size, size=10 * eval_size, **config)
    except (TypeError, ValueError, AssertionError) as e:
        fail("--config", json.dumps(config), f"the task rejects it ({str(e).splitlines()[0][:120]}); give fields of "
                                             f"{DATASETS[task][1].__name__}")
    seen, test = {e["question"] for e in train}, []
    for e in candidates:
        if e["question"] not in seen:
            seen.add(e["question"])
            test.append(e)
        if len(test) == eval_size:
            return train, test
    fail("--eval-size", eval_size, f"only {len(test)} of {10 * eval_size} new entries ask a question the train split "
                                   "does not; lower --size or --eval-size, or widen the task with --config")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write a reasoning-gym task as a prompt dataset (train.jsonl, test.jsonl) "
                                            "for rloo.py and ppo.py; score it with --reward-fn "
                                            "examples/reasoning_gym.py:score.")
    p.add_argument("--task", default=TASK, help=f"a reasoning-gym task name (default {TASK}; see --list)")
    p.add_argument("--list", action="store_true", help="print the task names and stop")
    p.add_argument("--size", type=int, default=SIZE, help=f"rows of the train split (default {SIZE})")
    p.add_argument("--eval-size", type=int, default=EVAL_SIZE, help=f"rows of the test split (default {EVAL_SIZE})")
    p.add_argument("--seed", type=int, default=SEED, help=f"seed of the first train entry (default {SEED})")
    p.add_argument("--config", default="{}", help="the task's config fields as JSON, e.g. '{\"max_animals\": 3}' "
                                                  "(default: the task's defaults)")
    p.add_argument("--system-prompt", default=SYSTEM_PROMPT, choices=[*SYSTEM_PROMPTS, "none"],
                   help=f"reasoning-gym's system prompt of this name, or none (default {SYSTEM_PROMPT})")
    p.add_argument("--shots", type=int, default=SHOTS, help="solved train entries shown before each question, as "
                   f"earlier turns (default {SHOTS})")
    p.add_argument("--out", help="folder to write train.jsonl and test.jsonl to (default data/<task>)")
    args = p.parse_args(argv)
    if args.list:
        print(" ".join(sorted(DATASETS)))
        return
    if args.task not in DATASETS:
        fail("--task", args.task, "not a reasoning-gym task; --list prints their names")
    if args.size < 1 or args.eval_size < 1:
        fail("--size" if args.size < 1 else "--eval-size", min(args.size, args.eval_size), "give at least 1 row")
    if not 0 <= args.shots < args.size:
        fail("--shots", args.shots, f"give 0 to --size - 1 ({args.size - 1}): each row's shots are other train rows")
    try:
        config = json.loads(args.config)
    except json.JSONDecodeError:
        config = None
    if not isinstance(config, dict):
        fail("--config", args.config, "give a JSON object of the task's config fields, e.g. '{\"max_animals\": 3}'")

    train, test = make_splits(args.task, args.size, args.eval_size, args.seed, config)
    if args.shots and any(e["answer"] is None for e in train):  # a scorer that checks validity (graph_color)
        fail("--shots", args.shots, "this task's entries carry no answer to show (its scorer checks a reply's own "
                                    "validity): use --shots 0")
    config = json.dumps(config, sort_keys=True)
    for e in train + test:  # the scorer must read the JSON copy as it reads the entry (arc_agi's tuple grids do not)
        fn = task_scorer(e["metadata"]["source_dataset"], config)
        if fn(e["answer"], json.loads(encode(e))) != fn(e["answer"], e):
            fail("--task", args.task, "its scorer reads the entries' JSON copies differently (tuples become lists); "
                                      "this example cannot score it")
    out = Path(args.out or f"data/{args.task}")
    out.mkdir(parents=True, exist_ok=True)
    for split, entries in (("train", train), ("test", test)):  # row i's shots: train rows i + 1 .. i + shots
        rows = [row(e, args.system_prompt, [train[(i + j) % len(train)] for j in range(1, args.shots + 1)], config)
                for i, e in enumerate(entries)]
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out}/train.jsonl ({len(train)} rows) and {out}/test.jsonl ({len(test)} rows, held out): "
          f"--dataset {out} --eval-split test --reward-fn examples/reasoning_gym.py:score")


if __name__ == "__main__":
    main()
