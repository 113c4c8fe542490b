"""Tool use with ppo.py's `ppo_step`: a tiny model learns to call a calculator, in one file.

TRL's old step API (<= 0.11) had a calculator example; this one is built from ppo.py's public pieces (`generate`,
`ppo_step`) and interleave.py's `sft_step`. Tasks are made on the fly: `a*b+c=` with numbers of 1 to 3 digits, which
the tiny model cannot work out alone. It calls the calculator by writing `<calc>123*45</calc>`: generation stops at
the stop string `</calc>`, the loop evaluates the request (+ - * on integers, parsed by hand, never Python's eval),
appends `<out>5535</out>` and lets the model go on, for at most --max-calls calls. The final answer ends with EOS
and is scored by exact match (reward 1 or 0). A malformed call (a bad expression, a `<calc>` still open at EOS or at
the token limit) gets an error as its output, e.g. `<out>error: bad expression</out>`, never an exception.

The whole episode is one response for `ppo_step`, with a mask that is 0 on the tool's tokens: they get no gradient
and no KL, but stay in the response (the value model reads them, GAE runs through them).

    1. SFT warm start (`sft_step`) on generated demonstrations, the tool's output masked out of the labels. Most
       tool demonstrations (--mental-fraction 0.7) let the calculator multiply and then add in the head, always
       correctly; the rest call it a second time for the sum. The model copies the habit but not the skill. A
       quarter of all demonstrations (--direct-fraction) answer at once, after a prompt that offers no calculator.
    2. PPO on tool-use episodes, rewarded on the final answer alone: it learns to make the second call.
    3. Greedy accuracy on 200 held-out tasks with the tool, after the warm start and after PPO; and without it, for
       contrast: the same model with the prompt that offers no calculator (a format it learnt in the same warm start,
       on the same tasks; a call there gets `<out>error: no calculator</out>`).

Measured with OMP_NUM_THREADS=1 on a 2-core CPU, about 5 minutes a run:

    seed   with the tool: warm start -> PPO   calls per episode   without the tool
    1      0.150 -> 0.745                     1.11 -> 1.88        0.000 (0.010 after PPO)
    2      0.220 -> 0.785                     1.29 -> 2.00        0.000

After seed 2's warm start, the episodes that added in the head were right 8 times in 142, those that called twice
36 times in 58. PPO does not fix the model's copying slips: with --mental-fraction 0 (always two calls) seed 1 went
from 0.570 to 0.545. A model trained for the same 1,500 steps on direct answers alone gets 0.015 without the tool.

    python examples/calculator.py                       # about 5 minutes on 2 CPU cores, offline
    python examples/calculator.py --mental-fraction 0   # demonstrations that always call twice
    python examples/calculator.py --help
"""

import copy
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import torch
import tyro
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoModelForTokenClassification, GenerationConfig, PreTrainedTokenizerFast

# ppo.py and interleave.py live in the repository root: put it on the path so that this file runs from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from interleave import sft_batch, sft_step  # noqa: E402
from ppo import (  # noqa: E402
    GenArgs,
    PPOHParams,
    adamw,
    build_tiny_model,
    disable_dropout,
    fail,
    find_checkpoint,
    generate,
    generation_configs,
    left_pad,
    log_row,
    model_context,
    open_run,
    ppo_step,
)


@dataclass
class Args:
    """Teach a tiny model to use a calculator: SFT on demonstrations, then PPO with masked tool output."""

    exp_name: str = "calculator"
    """name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of python, torch and the training tasks (the evaluation tasks are the same for every seed)"""
    output_dir: str | None = None
    """run folder (config.json, metrics.jsonl, warm_start/ and model/ with the tokenizer); default runs/<run_name>"""
    track: bool = False
    """log to Weights & Biases (works offline with WANDB_MODE=offline)"""
    wandb_project: str = "rlft"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team or user)"""
    hidden: int = 64
    """hidden size of the tiny Llama-shaped model"""
    layers: int = 2
    """decoder layers of the tiny model"""
    digits: int = 3
    """a, b and c in a*b+c have 1 to this many digits"""
    max_calls: int = 3
    """tool calls allowed per episode; a call beyond them ends the episode unanswered"""
    turn_tokens: int = 16
    """most tokens the model writes per turn (between tool outputs)"""
    sft_steps: int = 1500
    """supervised steps of the warm start"""
    sft_batch_size: int = 64
    """demonstrations per supervised step"""
    sft_learning_rate: float = 3e-3
    """AdamW learning rate of the warm start (decayed linearly to 0)"""
    direct_fraction: float = 0.25
    """share of the demonstrations that answer directly, after a prompt without the calculator"""
    mental_fraction: float = 0.7
    """share of the tool demonstrations that skip the second call and add in the head (correctly): a habit the model
    imitates but cannot match; PPO, rewarded on the answer alone, can learn to call the calculator instead"""
    ppo_iterations: int = 200
    """PPO updates after the warm start"""
    batch_size: int = 64
    """episodes per PPO update"""
    learning_rate: float = 1e-4
    """AdamW learning rate of PPO (policy and value model)"""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay of the warm start and of PPO, on every weight but biases and normalisation
    weights (as transformers' Trainer)"""
    anneal_lr: bool = True
    """decay the PPO learning rate linearly to 0"""
    num_eval_tasks: int = 200
    """held-out tasks of the greedy evaluation (never drawn for training)"""
    eval_every: int = 50
    """evaluate every this many PPO updates (and after the warm start and at the end; 0: only there)"""
    ppo: Annotated[PPOHParams, tyro.conf.arg(name="")] = field(default_factory=PPOHParams)


# ---------------------------------------------------------------------------------------------------------------------
# The tool, its syntax and the task

CALL, STOP, OUT, OUT_END = "<calc>", "</calc>", "<out>", "</out>"
CHARS = "0123456789+-*=: \nabcdefghijklmnopqrstuvwxyz"
MAX_RESULT = 10**12  # larger results are an error, so that a tool output never outgrows the context


def build_tokenizer() -> PreTrainedTokenizerFast:
    """ppo.build_tokenizer's character-level recipe, plus letters for error messages and one token for each of the
    four tags, as real tool-use tokenizers have."""
    tags = [CALL, STOP, OUT, OUT_END]
    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *tags, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"</?calc>|</?out>|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")


def calculator(expression: str) -> int:
    """Evaluate integers joined by + - * (* first), e.g. '12*-3+4' -> -32, without Python's eval: a regular
    expression checks the whole text, another splits it into (number, next operator) pairs that are folded by hand.
    Raises ValueError on anything else, and on results of 10**12 or more."""
    number = r"-?\d{1,12}"
    if len(expression) > 64 or not re.fullmatch(rf"{number}(?:[+*-]{number})*", expression):
        raise ValueError("bad expression")
    total, term, op = 0, 1, "+"
    for digits, next_op in re.findall(r"(-?\d+)([+*-]?)", expression):
        term = term * int(digits) if op == "*" else (1 if op == "+" else -1) * int(digits)
        if next_op != "*":
            total += term
        op = next_op
    if abs(total) >= MAX_RESULT:
        raise ValueError("too large")
    return total


def parse_call(text: str) -> str:
    """The request of the call that ends a turn: the text between its last <calc> and the closing </calc>. Raises
    ValueError when there is no <calc> or the call is still open."""
    _, opened, request = text.rpartition(CALL)
    if not opened:
        raise ValueError("missing start")
    if not request.endswith(STOP):
        raise ValueError("unterminated call")
    return request.removesuffix(STOP)


def tool_output(turn_text: str, tool: bool = True) -> str:
    """What the loop appends after a call: <out>result</out>, or <out>error: why</out> (always text, never raised)."""
    try:
        request = parse_call(turn_text)
        if not tool:
            raise ValueError("no calculator")
        return f"{OUT}{calculator(request)}{OUT_END}"
    except ValueError as e:
        return f"{OUT}error: {e}{OUT_END}"


def make_task(rng: random.Random, digits: int) -> dict:
    """One task a*b+c; each number has 1 to `digits` digits, the count drawn first. Mixed lengths matter: with
    three digits always, the model learns to copy from fixed offsets and fails whenever a*b has five digits."""
    a, b, c = (rng.randrange(10 ** (n - 1) if n > 1 else 0, 10**n) for n in (rng.randint(1, digits) for _ in range(3)))
    return {"question": f"{a}*{b}+{c}=", "answer": str(a * b + c), "a": a, "b": b, "c": c}


def prompt(task: dict, tool: bool) -> str:
    """The prompt offers the calculator ('calc: ' in front) or not."""
    return ("calc: " if tool else "") + task["question"]


def demonstration(task: dict, style: str) -> list[tuple[str, int]]:
    """A demonstrated completion as (text, mask) pieces, the tool's outputs real and masked (EOS is added later).
    'tool': one call per operation, then the answer; 'mental': the product by the calculator, the sum done in the
    head (correctly); 'direct': the answer alone."""
    product = f"{CALL}{task['a']}*{task['b']}{STOP}"
    total = f"{CALL}{task['a'] * task['b']}+{task['c']}{STOP}"
    return {"tool": [(product, 1), (tool_output(product), 0), (total, 1), (tool_output(total), 0)],
            "mental": [(product, 1), (tool_output(product), 0)], "direct": []}[style] + [(task["answer"], 1)]


# ---------------------------------------------------------------------------------------------------------------------
# Episodes: several turns of generation, tool outputs in between


@dataclass
class Episode:
    """One episode in progress: the prompt, and the response so far with its mask (1: the model wrote it, 0: the
    tool did)."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    calls: int = 0
    errors: int = 0
    answer: str | None = None
    done: bool = False


def step_episode(ep: Episode, turn_ids: list[int], tokenizer, max_calls: int, tool: bool = True) -> None:
    """Add one turn of model tokens (cut after EOS or </calc>, or at the token limit) and act on it:
    - a call (ended by </calc>, or a <calc> left open at EOS or at the token limit) gets the tool's output appended
      with mask 0, and the episode goes on (an EOS that left a call open stays in the episode: the model wrote it);
      a call beyond max_calls ends the episode unanswered;
    - EOS outside a call ends the episode; the turn's text is the final answer;
    - a turn that reaches the token limit without a call ends the episode unanswered."""
    eos = turn_ids[-1:] == [tokenizer.eos_token_id]
    text = tokenizer.decode(turn_ids[:-1] if eos else turn_ids)
    is_call = text.endswith(STOP) or CALL in text
    ep.ids += turn_ids
    ep.mask += [1] * len(turn_ids)
    if not is_call:
        ep.answer, ep.done = (text if eos else None), True
        return
    ep.calls += 1
    if ep.calls > max_calls:
        ep.done = True
        return
    out = tool_output(text, tool)
    out_ids = tokenizer(out, add_special_tokens=False).input_ids
    ep.errors += out.startswith(f"{OUT}error")
    ep.ids += out_ids
    ep.mask += [0] * len(out_ids)


@torch.no_grad()
def run_episodes(policy, tokenizer, prompts: list[str], gen: GenerationConfig, max_calls: int,
                 tool: bool = True) -> list[Episode]:
    """Play a batch of episodes turn by turn: each turn generates for the unfinished episodes (prompt + response so
    far, left-padded) until EOS, </calc> or the token limit, then step_episode acts on each. At most max_calls + 1
    turns, so every episode ends."""
    device = next(policy.parameters()).device
    episodes = [Episode(tokenizer(p).input_ids) for p in prompts]
    for _ in range(max_calls + 1):
        active = [ep for ep in episodes if not ep.done]
        if not active:
            break
        queries = left_pad([ep.prompt_ids + ep.ids for ep in active], tokenizer.pad_token_id)
        responses, lengths, _, _, _ = generate(policy, tokenizer, queries.to(device), gen, [STOP])
        for ep, row, n in zip(active, responses.tolist(), lengths.tolist()):
            step_episode(ep, row[:n], tokenizer, max_calls, tool)
    return episodes  # all done: each turn but the last ends in a call, so turn max_calls + 1 makes one too many


def episode_batch(episodes: list[Episode], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ppo_step's inputs: queries [B, Lq] left-padded, responses [B, T] right-padded with pad, masks [B, T] with 0 on
    tool tokens and on padding. (A pad token the model itself wrote stays a model token with mask 1; only as the very
    last token of a response would ppo_step take it for padding.)"""
    T = max(len(ep.ids) for ep in episodes)
    queries = left_pad([ep.prompt_ids for ep in episodes], pad_token_id)
    responses = torch.tensor([ep.ids + [pad_token_id] * (T - len(ep.ids)) for ep in episodes])
    masks = torch.tensor([ep.mask + [0] * (T - len(ep.mask)) for ep in episodes])
    return queries, responses, masks


def reward(ep: Episode, task: dict) -> float:
    """1.0 for the exact answer followed by EOS, else 0.0."""
    return float(ep.answer == task["answer"])


def demo_batch(tokenizer, tasks: list[dict], styles: list[str]) -> dict[str, torch.Tensor]:
    """sft_batch's rows (prompt + completion + EOS, labels -100 on the prompt), with labels -100 on the tool's
    output as well: the model learns to call and to read the tool, not to guess its answers."""
    prompts = [prompt(t, style != "direct") for t, style in zip(tasks, styles)]
    pieces = [demonstration(t, style) for t, style in zip(tasks, styles)]
    batch = sft_batch(tokenizer, prompts, ["".join(text for text, _ in p) for p in pieces])
    for i, (p, demo) in enumerate(zip(prompts, pieces)):
        pos = len(tokenizer(p).input_ids)
        for text, keep in demo:
            n = len(tokenizer(text, add_special_tokens=False).input_ids)
            if not keep:
                batch["labels"][i, pos:pos + n] = -100
            pos += n
    return batch


def evaluate(policy, tokenizer, tasks: list[dict], greedy: GenerationConfig, max_calls: int, tool: bool,
             prefix: str) -> tuple[dict, list]:
    """Greedy episodes on the held-out tasks: accuracy, calls and tool errors per episode, and every episode's
    prompt, completion and score."""
    episodes = []
    for i in range(0, len(tasks), 100):
        chunk = tasks[i:i + 100]
        episodes += run_episodes(policy, tokenizer, [prompt(t, tool) for t in chunk], greedy, max_calls, tool)
    n = len(tasks)
    metrics = {f"{prefix}/accuracy": sum(reward(ep, t) for ep, t in zip(episodes, tasks)) / n,
               f"{prefix}/calls": sum(ep.calls for ep in episodes) / n,
               f"{prefix}/errors": sum(ep.errors for ep in episodes) / n,
               f"{prefix}/answered": sum(ep.answer is not None for ep in episodes) / n}
    samples = [{"prompt": prompt(t, tool), "completion": tokenizer.decode(ep.ids), "score": reward(ep, t)}
               for ep, t in zip(episodes, tasks)]  # every episode, as log_row writes them to samples.jsonl
    return metrics, samples


# ---------------------------------------------------------------------------------------------------------------------
# The loop


def main(args: Args) -> None:
    # ---- validate the configuration before anything is built
    if not 1 <= args.digits <= 5:
        fail("--digits", args.digits, "give 1 to 5 (the tool refuses results of 10**12 or more)")
    if args.turn_tokens < 3 * args.digits + 3:
        fail("--turn-tokens", args.turn_tokens, f"the demonstrations' longest turn, <calc>{'9' * 2 * args.digits}+"
             f"{'9' * args.digits}</calc>, needs {3 * args.digits + 3} tokens; raise it or lower --digits")
    if args.max_calls < 1:
        fail("--max-calls", args.max_calls, "allow at least one call")
    if not 1 <= args.num_eval_tasks <= 10 ** (3 * args.digits) // 4:
        fail("--num-eval-tasks", args.num_eval_tasks, f"give 1 to {10 ** (3 * args.digits) // 4}: the held-out tasks "
             "must leave most of the tasks for training; or raise --digits")
    if not 0 <= args.direct_fraction < 1:
        fail("--direct-fraction", args.direct_fraction, "give a share in [0, 1)")
    if not 0 <= args.mental_fraction <= 1:
        fail("--mental-fraction", args.mental_fraction, "give a share in [0, 1]")
    if args.batch_size % (args.ppo.num_mini_batches * args.ppo.gradient_accumulation_steps):
        fail("--batch-size", args.batch_size, f"must be divisible by --num-mini-batches ({args.ppo.num_mini_batches})"
             f" x --gradient-accumulation-steps ({args.ppo.gradient_accumulation_steps})")
    stamp = int(time.time())  # a default folder of a run started in the same second: the next free second's name
    while args.output_dir is None and Path(f"runs/{args.exp_name}__{args.seed}__{stamp}").exists():
        stamp += 1
    run_name = f"{args.exp_name}__{args.seed}__{stamp}"
    output_dir = Path(args.output_dir or f"runs/{run_name}")
    find_checkpoint(None, output_dir)  # a folder holding another run is refused (its rows and model would be lost)

    # ---- seeding, the tokenizer and the policy; held-out evaluation tasks, the same for every seed
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    policy = disable_dropout(build_tiny_model(tokenizer, hidden=args.hidden, layers=args.layers))
    eval_rng, task_rng = random.Random(0), random.Random(args.seed)
    eval_tasks = [make_task(eval_rng, args.digits) for _ in range(args.num_eval_tasks)]
    held_out = {t["question"] for t in eval_tasks}

    def train_task() -> dict:
        while (task := make_task(task_rng, args.digits))["question"] in held_out:
            pass
        return task

    longest_out = len(tokenizer(f"{OUT}error: unterminated call{OUT_END}", add_special_tokens=False).input_ids)
    longest = len(tokenizer(prompt({"question": "9" * (3 * args.digits + 3)}, True)).input_ids)
    longest += (args.max_calls + 1) * args.turn_tokens + args.max_calls * longest_out
    if longest > model_context(policy):
        fail("--max-calls", args.max_calls, f"an episode may reach {longest} tokens, over the model's context of "
             f"{model_context(policy)}; lower --max-calls or --turn-tokens")
    sample, greedy = generation_configs(GenArgs(max_new_tokens=args.turn_tokens), tokenizer, args.ppo.temperature)
    metrics_path, run = open_run(args, output_dir, 0, run_name)
    t0 = time.time()

    def log_eval(iteration: int, phase: str) -> dict:
        with_tool, samples = evaluate(policy, tokenizer, eval_tasks, greedy, args.max_calls, True, "eval")
        no_tool, _ = evaluate(policy, tokenizer, eval_tasks, greedy, args.max_calls, False, "eval_no_tool")
        row = {"iteration": iteration, "phase": phase, "elapsed_s": round(time.time() - t0, 3), **with_tool,
               **no_tool}
        log_row(metrics_path, run, row, samples)
        print(f"{phase} {iteration}: accuracy with the tool {with_tool['eval/accuracy']:.3f} (calls "
              f"{with_tool['eval/calls']:.2f}, errors {with_tool['eval/errors']:.2f}), without "
              f"{no_tool['eval_no_tool/accuracy']:.3f}  [{row['elapsed_s']:.0f}s]", flush=True)
        return row

    # ---- 1. SFT warm start on demonstrations (tool output masked out of the labels)
    optimizer = adamw([policy], args.sft_learning_rate, args.weight_decay)
    for step in range(1, args.sft_steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = args.sft_learning_rate * (1 - (step - 1) / args.sft_steps)
        tasks = [train_task() for _ in range(args.sft_batch_size)]
        styles = ["direct" if random.random() < args.direct_fraction else "mental"
                  if random.random() < args.mental_fraction else "tool" for _ in tasks]
        batch = demo_batch(tokenizer, tasks, styles)
        metrics = sft_step(policy, optimizer, **batch)
        if step % 50 == 0 or step == args.sft_steps:
            log_row(metrics_path, run, {"iteration": step, "phase": "sft", "elapsed_s": round(time.time() - t0, 3),
                                        **{f"sft/{k}": v for k, v in metrics.items()}})
    after_sft = log_eval(args.sft_steps, "sft")
    policy.save_pretrained(output_dir / "warm_start")
    tokenizer.save_pretrained(output_dir / "warm_start")

    # ---- 2. PPO from the warm start: a frozen reference and a value model with the policy's trunk
    ref_policy = copy.deepcopy(policy).eval().requires_grad_(False)
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    value_model = disable_dropout(AutoModelForTokenClassification.from_config(config))
    value_model.load_state_dict(policy.state_dict(), strict=False)
    optimizer = adamw([policy, value_model], args.learning_rate, args.weight_decay)
    row = after_sft
    for iteration in range(1, args.ppo_iterations + 1):
        for group in optimizer.param_groups if args.anneal_lr else []:
            group["lr"] = args.learning_rate * (1 - (iteration - 1) / args.ppo_iterations)
        tasks = [train_task() for _ in range(args.batch_size)]
        episodes = run_episodes(policy, tokenizer, [prompt(t, True) for t in tasks], sample, args.max_calls)
        queries, responses, masks = episode_batch(episodes, tokenizer.pad_token_id)
        rewards = torch.tensor([reward(ep, t) for ep, t in zip(episodes, tasks)])
        # an EOS can sit inside an episode (after a call left open), so padding alone marks where a response ends:
        # no eos_token_id (and so no val/num_eos_tokens; rollout/answered counts the episodes that ended with EOS)
        metrics = ppo_step(policy, value_model, ref_policy, optimizer, queries, responses, rewards, masks,
                           hp=args.ppo, pad_token_id=tokenizer.pad_token_id)
        metrics.pop("val/num_eos_tokens", None)
        step = args.sft_steps + iteration
        log_row(metrics_path, run, {"iteration": step, "phase": "ppo", "elapsed_s": round(time.time() - t0, 3),
                                    "lr": optimizer.param_groups[0]["lr"], **metrics,
                                    "rollout/calls": sum(ep.calls for ep in episodes) / len(episodes),
                                    "rollout/errors": sum(ep.errors for ep in episodes) / len(episodes),
                                    "rollout/answered": sum(ep.answer is not None for ep in episodes) / len(episodes)})
        if args.eval_every and iteration % args.eval_every == 0 or iteration == args.ppo_iterations:
            row = log_eval(step, "ppo")

    policy.save_pretrained(output_dir / "model")
    tokenizer.save_pretrained(output_dir / "model")
    print(f"accuracy with the tool: {after_sft['eval/accuracy']:.3f} after the warm start, {row['eval/accuracy']:.3f} "
          f"after PPO; without the tool: {after_sft['eval_no_tool/accuracy']:.3f} after the warm start, "
          f"{row['eval_no_tool/accuracy']:.3f} after PPO ({len(eval_tasks)} held-out tasks, "
          f"{time.time() - t0:.0f}s); run in {output_dir}")
    if run is not None:
        run.finish()


if __name__ == "__main__":
    main(tyro.cli(Args))
