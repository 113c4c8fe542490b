# /// script
# requires-python = ">=3.11"
# dependencies = ["torch==2.13.0", "transformers==5.24.0", "tokenizers==0.23.3", "safetensors==0.8.0",
#                 "datasets==5.2.0", "tyro==1.0.17", "wandb==0.31.0", "tqdm==4.70.1", "peft==0.21.2"]
# ///
"""Process-supervised (stepwise) reward models, in one file: train one, evaluate it, use it.

A process reward model (PRM) scores every reasoning step of a solution (Lightman et al. 2023, arXiv 2305.20050;
Math-Shepherd, Wang et al. 2024, arXiv 2312.08935): token classification with 2 labels as in TRL's PRMTrainer (up to
TRL 1.13), each step's label on its last token (the separator), every other token ignored; a step's score is
softmax(logits)[..., 1] there, a solution's the minimum over its steps. docs/stepwise_prm.md explains each step.

    python stepwise_prm.py        # built-in task: multi-step running sums, tiny model, offline, about 2 minutes
    python stepwise_prm.py --model Qwen/Qwen2.5-0.5B --dataset trl-lib/math_shepherd --max-length 1024

A PRM must start from a model that knows the domain (one label a step teaches random weights nothing): the built-in
tiny model first gets a short causal-LM warm start on the all-correct solutions (--warmup-steps). Custom loops import
`prm_step` and `score_steps` (best-of-N reranking, per-step rewards in RL); `main()` below is one such loop.
Left out: labelling steps by rollouts (Math-Shepherd's automatic labels), generative or value-based verifiers."""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import pickle
import random
import shutil
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

import datasets
import peft
import torch
import tyro
from safetensors.torch import load_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from torch.distributed.tensor import distribute_tensor
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedTokenizerFast,
)
from transformers.trainer_pt_utils import get_parameter_names


@dataclass
class Args:
    """Train a process reward model (a 2-label token classifier) on stepwise-labelled solutions."""

    exp_name: str = "stepwise_prm"
    """name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of python, torch, the built-in training rows and the batch order (each process adds its rank)"""
    output_dir: str | None = None
    """run folder (config.json, metrics.jsonl, checkpoints/, model/); default runs/<run_name>"""
    track: bool = False
    """log to Weights & Biases (works offline with WANDB_MODE=offline)"""
    wandb_project: str = "rlft"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team or user)"""
    model: str = "builtin"
    """a Hugging Face id or local folder, loaded as a 2-label token classifier (a causal LM gets a fresh head);
    'builtin' is a tiny Llama-shaped model built from config"""
    trust_remote_code: bool = False
    """allow model code from the hub (off unless asked)"""
    dataset: str | None = None
    """stepwise rows (prompt, completions, labels): a hub id, or a local json/jsonl/parquet file or folder;
    default: the built-in task"""
    dataset_split: str = "train"
    """split of --dataset to train on"""
    eval_split: str | None = None
    """split of --dataset to evaluate on (default: the last --num-eval-rows rows of --dataset-split, held out)"""
    num_train_rows: int = 20_000
    """rows of the built-in training set"""
    num_eval_rows: int = 1000
    """rows to evaluate on: the built-in held-out set, the first rows of --eval-split, or those held out"""
    best_of_n: int = 8
    """candidates per problem in the built-in task's best-of-N check (0: off)"""
    step_separator: str = "\n"
    """appended to every step; the step's label goes on its last token"""
    max_length: int | None = None
    """cut each tokenized row to this many tokens (default: the model's context)"""
    max_completion_length: int | None = None
    """cut the steps to this many tokens before --max-length applies (default: no cut)"""
    train_on_last_step_only: bool = False
    """train on the label of the final step only (evaluation always uses every step)"""
    warmup_steps: int | None = None
    """causal-LM steps on the all-correct training solutions before PRM training, for the built-in model only
    (default: 1500; a pretrained --model needs none)"""
    total_steps: int = 1500
    """PRM optimizer steps, each on --batch-size rows"""
    batch_size: int = 64
    """rows per step, over all processes"""
    gradient_accumulation_steps: int = 1
    """micro-batches per step in each process (gradients accumulated)"""
    learning_rate: float | None = None
    """AdamW learning rate of the warm start and the PRM (default: 1e-3 for the built-in model, 1e-5 for any other)"""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay of every weight but biases and normalisation weights (as transformers' Trainer)"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    skip_nonfinite: bool = False
    """skip (and count) a step whose loss or gradient norm is NaN/inf, instead of stopping the run"""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """compute dtype of the forward passes: bf16 runs them under autocast (weights, gradients and optimizer state
    stay fp32)"""
    eval_every: int = 250
    """evaluate on the held-out rows every this many steps (and at the start and the end; 0: only there)"""
    save_every: int = 0
    """write a checkpoint every this many steps (0: only the final model)"""
    keep_checkpoints: int = 2
    """keep the newest this many checkpoints (0: all)"""
    resume: str | None = None
    """continue from a checkpoint folder (.../checkpoints/iter_000100), or 'latest' in --output-dir"""
    memory: Annotated[MemoryArgs, tyro.conf.OmitArgPrefixes] = field(default_factory=lambda: MemoryArgs())


@dataclass
class MemoryArgs:
    """Less memory: LoRA adapters (peft; only they and a classifier's head train; the reference: adapters off)."""

    lora_r: int = 0
    """rank of the adapters (0: off, every weight trains)"""
    lora_alpha: int | None = None
    """the adapters' scale numerator (None: 2 x --lora-r)"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input; only 0 is taken: dropout would change the logprobs between passes"""
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """modules that get adapters, by name ('all-linear': every linear layer but the output layer and heads)"""
    gradient_checkpointing: bool = False
    """recompute each layer's activations in the training passes' backward (transformers'): less memory, more compute"""


# ---------------------------------------------------------------------------------------------------------------------
# The algorithm: a row's tokens with each step's label on its last token, one update (prm_step), and using a PRM:
# step scores (score_steps), the held-out metrics (evaluate), best-of-N reranking


def tokenize_example(tokenizer, prompt: str, completions: list[str], labels: list[bool], step_separator: str = "\n",
                     max_length: int | None = None, max_completion_length: int | None = None,
                     train_on_last_step_only: bool = False) -> dict[str, list[int]]:
    """Token ids and labels of one stepwise row: [BOS] prompt step_1 sep step_2 sep ... Each step's label (1 correct,
    0 wrong) sits on its last token (the last separator token); every other token is -100. The BOS comes only when
    the tokenizer has one. The steps are cut to max_completion_length first, then the whole row to max_length; a
    step cut short loses its label."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    if tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id, *prompt_ids]
    separator = tokenizer(step_separator, add_special_tokens=False).input_ids
    step_ids = tokenizer(list(completions), add_special_tokens=False).input_ids if completions else []
    completion_ids, completion_labels = [], []
    for i, (ids, label) in enumerate(zip(step_ids, labels)):
        keep = not train_on_last_step_only or i == len(completions) - 1
        completion_ids += ids + separator
        completion_labels += [-100] * (len(ids) + len(separator) - 1) + [int(label) if keep else -100]
    # the steps cut to max_completion_length, then the row to max_length (a slice up to None cuts nothing)
    input_ids = prompt_ids + completion_ids[:max_completion_length]
    labels = [-100] * len(prompt_ids) + completion_labels[:max_completion_length]
    return {"input_ids": input_ids[:max_length], "labels": labels[:max_length]}


def prm_step(model, optimizer, batch: list[dict], *, pad_token_id: int, gradient_accumulation_steps: int = 1,
             max_grad_norm: float = 1.0, skip_nonfinite: bool = False, dtype: str = "fp32") -> dict[str, float]:
    """One update of a PRM on tokenized rows (tokenize_example's output, best sorted by length).

    The loss is the cross-entropy summed over labelled tokens / the batch's labelled-token count over all processes,
    so accumulation over micro-batches (each padded to its own longest row) and data parallelism give one big batch's
    gradient. A NaN/inf loss or gradient norm raises FloatingPointError, or with skip_nonfinite skips the update.
    Returns metrics over this process's rows.
    """
    device = next(model.parameters()).device
    # 1. The divisor: the labelled tokens of the whole batch, over all processes.
    labelled_here = sum(label != -100 for e in batch for label in e["labels"])
    n_labelled = global_sum(torch.tensor(float(labelled_here), device=device)).clamp(min=1) / world_size()
    # 2. Micro-batches, each padded to its own longest row: summed cross-entropy / the divisor, gradients accumulated.
    micro = -(-len(batch) // gradient_accumulation_steps)
    total_loss = correct = tokens = real_tokens = bad = 0.0
    for start in range(0, len(batch), micro):
        mb = {k: v.to(device) for k, v in pad_batch(batch[start:start + micro], pad_token_id).items()}
        with autocast(dtype, device):
            logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits.float()  # [b, L, 2]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), reduction="sum")
        (loss / n_labelled).backward()  # even when not finite: every process runs the same collectives
        labelled = mb["labels"] != -100  # the positions cross_entropy counts (it ignores -100)
        total_loss, bad = total_loss + loss.item(), bad + (not math.isfinite(loss.item()))
        correct += (logits.argmax(-1) == mb["labels"])[labelled].sum().item()
        tokens, real_tokens = tokens + mb["attention_mask"].numel(), real_tokens + mb["attention_mask"].sum().item()
    # 3. One optimizer step: gradients averaged over processes and clipped; NaN/inf stops (or skips) it.
    params = [p for g in optimizer.param_groups for p in g["params"]]
    taken = step_or_skip(optimizer, params, global_sum(torch.tensor(bad, device=device)) > 0, max_grad_norm,
                         skip_nonfinite)
    # 4. Metrics over this process's rows (the caller averages them over processes).
    return {"train/loss": total_loss / max(labelled_here, 1), "train/step_accuracy": correct / max(labelled_here, 1),
            "train/pad_fraction": 1 - real_tokens / tokens, "train/tokens": float(real_tokens),
            "train/nonfinite_skipped": float(not taken)}


@torch.no_grad()
def score_steps(model, tokenizer, prompt: str | list[str], completions: list[str] | list[list[str]],
                step_separator: str = "\n", batch_size: int = 64) -> list[float] | list[list[float]]:
    """The probability that each step is correct. One solution (a prompt and its steps) gives a list of floats;
    a list of prompts and a list of step lists give one list per solution, scored batch_size at a time."""
    single = isinstance(prompt, str)
    prompts, solutions = ([prompt], [completions]) if single else (prompt, completions)
    examples = [tokenize_example(tokenizer, p, c, [True] * len(c), step_separator) for p, c in zip(prompts, solutions)]
    device, was_training, scores = next(model.parameters()).device, model.training, []
    model.eval()
    for i in range(0, len(examples), batch_size):
        batch = pad_batch(examples[i:i + batch_size], tokenizer.pad_token_id or 0)
        logits = model(input_ids=batch["input_ids"].to(device),
                       attention_mask=batch["attention_mask"].to(device)).logits  # [B, L, 2]
        probs = logits.float().softmax(-1)[..., 1].cpu()  # [B, L] probability of label 1, "correct"
        scores += [p[labels != -100].tolist() for p, labels in zip(probs, batch["labels"])]
    model.train(was_training)
    return scores[0] if single else scores


def first_true(mask: torch.Tensor) -> torch.Tensor:
    """[B] index of the first True in each row of a [B, L] mask (L when there is none)."""
    return torch.where(mask, torch.arange(mask.shape[1], device=mask.device), mask.shape[1]).min(1).values


@torch.no_grad()
def evaluate(model, examples: list[dict], pad_token_id: int, device: torch.device, batch_size: int = 128) -> dict:
    """Held-out metrics, summed over processes: step accuracy; precision, recall and F1 of the "wrong step" class;
    solution accuracy (the first wrong step, or that there is none, found exactly)."""
    was_training, counts = model.training, torch.zeros(6, dtype=torch.float64)
    model.eval()
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["input_ids"]))
    for i in range(0, len(order), batch_size):
        batch = pad_batch([examples[j] for j in order[i:i + batch_size]], pad_token_id)
        labels = batch["labels"]  # [B, L]
        pred = model(input_ids=batch["input_ids"].to(device),
                     attention_mask=batch["attention_mask"].to(device)).logits.argmax(-1).cpu()  # [B, L] 1: correct
        labelled = labels != -100
        wrong, said_wrong = labelled & (labels == 0), labelled & (pred == 0)
        solved = first_true(wrong) == first_true(said_wrong)  # [B]
        counts += torch.tensor([(wrong & said_wrong).sum(), (~wrong & said_wrong).sum(), (wrong & ~said_wrong).sum(),
                                (labelled & ~wrong & ~said_wrong).sum(), solved.sum(), len(labels)]).double()
    model.train(was_training)
    tp, fp, fn, tn, solved, rows = global_sum(counts.to(device)).tolist()
    precision, recall = tp / max(tp + fp, 1), tp / max(tp + fn, 1)
    f1 = 2 * precision * recall / max(precision + recall, 1e-12)
    return {"eval/step_accuracy": (tp + tn) / max(tp + fp + fn + tn, 1), "eval/wrong_step_precision": precision,
            "eval/wrong_step_recall": recall, "eval/wrong_step_f1": f1, "eval/solution_accuracy": solved / max(rows, 1)}


def best_of_n(model, tokenizer, candidates: list[list[dict]], step_separator: str, device: torch.device) -> dict:
    """Best-of-N with the PRM as the judge: for each problem, the candidate whose lowest step score is highest.
    How often that pick is right (every step correct), against the expected accuracy of a random pick."""
    flat = [c for cands in candidates for c in cands]
    scores = score_steps(model, tokenizer, [c["prompt"] for c in flat], [c["completions"] for c in flat],
                         step_separator)
    picked = random_pick = 0.0
    for k, cands in enumerate(candidates):
        worst = [min(s) for s in scores[k * len(cands):(k + 1) * len(cands)]]
        right = [all(c["labels"]) for c in cands]
        picked += right[worst.index(max(worst))]
        random_pick += sum(right) / len(right)
    totals = global_sum(torch.tensor([picked, random_pick, len(candidates)], dtype=torch.float64, device=device))
    return {"eval/best_of_n_accuracy": (totals[0] / totals[2]).item(),
            "eval/random_pick_accuracy": (totals[1] / totals[2]).item()}


# ---- The loop: the numbered steps below (main calls the machinery under the marker: names resolve at the call). ------


def main(args: Args) -> None:
    t0 = time.time()
    # ---- validate the configuration before anything is loaded
    rank, world, device = setup_distributed()
    builtin = args.model == "builtin"
    for flag, value in (("--total-steps", args.total_steps),
                        ("--gradient-accumulation-steps", args.gradient_accumulation_steps)):
        if value < 1:
            fail(flag, value, "give at least 1")
    if args.max_grad_norm <= 0:  # as step_or_skip says at the first step, but before the data and the warm start
        fail("--max-grad-norm", args.max_grad_norm, "give a value > 0 (at 0 nothing would train)")
    if args.batch_size % (world * args.gradient_accumulation_steps):
        fail("--batch-size", args.batch_size, f"must be divisible by {world} process(es) x "
                                              f"--gradient-accumulation-steps ({args.gradient_accumulation_steps})")
    if args.warmup_steps and not builtin:
        fail("--warmup-steps", args.warmup_steps, "the warm start is for the built-in model; a pretrained --model "
                                                  "needs none: leave it out")
    if args.resume and args.resume != "latest" and args.output_dir is None:
        args.output_dir = str(Path(args.resume).parent.parent)
    stamp = int(time.time())  # a default folder of a run started in the same second: the next free second's name
    while args.output_dir is None and Path(f"runs/{args.exp_name}__{args.seed}__{stamp}").exists():
        stamp += 1
    run_name = f"{args.exp_name}__{args.seed}__{stamp}"
    output_dir = Path(args.output_dir or f"runs/{run_name}")
    ckpt = find_checkpoint(args.resume, output_dir)

    # ---- tokenizer, model (the built-in one a causal LM until step 6; the same weights in every process), data
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    tokenizer, model = load_model(args)
    train_rows, eval_rows, candidates = load_rows(args)
    # 5. Tokenize: [BOS] prompt step sep step sep ..., each step's label on its last token, -100 elsewhere.
    tokenize = functools.partial(tokenize_example, tokenizer, step_separator=args.step_separator,
                                 max_length=args.max_length or model_context(model),
                                 max_completion_length=args.max_completion_length)
    train = [tokenize(**r, train_on_last_step_only=args.train_on_last_step_only) for r in train_rows]
    evals = [tokenize(**r) for r in eval_rows]
    train, evals = [e for e in train if max(e["labels"]) >= 0], [e for e in evals if max(e["labels"]) >= 0]
    if len(train) < args.batch_size or len(evals) < world:  # truncation can cut every label of a row
        fail("--batch-size", args.batch_size, f"{len(train)} training and {len(evals)} held-out rows keep a label "
                                              "after truncation; give more data, or raise --max-length")

    # ---- the token classifier: the built-in LM after its warm start under a fresh 2-label head, or --model
    lr = (1e-3 if builtin else 1e-5) if args.learning_rate is None else args.learning_rate
    warmup_loss = None
    if builtin and args.memory.lora_r:  # the LoRA flags checked before the warm start rather than after it
        with_lora(copy.deepcopy(model), args.memory)
    if builtin:
        # 6. Built-in model: a causal-LM warm start on the all-correct solutions, then a fresh 2-label head.
        lm = model
        warmup_steps = 1500 if args.warmup_steps is None else args.warmup_steps
        if warmup_steps and ckpt is None:
            warmup_loss = warm_start(lm.to(device), tokenizer, [tokenize(**r) for r in train_rows if all(r["labels"])],
                                     warmup_steps, lr, args.weight_decay, args.batch_size, args.seed,
                                     output_dir / "warmup_lm", rank)
        elif warmup_steps and args.memory.lora_r:  # a LoRA checkpoint holds no base weights: they are the warm start's
            if not (output_dir / "warmup_lm" / "model.safetensors").exists():
                fail("--resume", args.resume, f"a LoRA checkpoint needs its base, the warm start's LM, in "
                                              f"{output_dir / 'warmup_lm'}: resume in the run's own --output-dir")
            lm = AutoModelForCausalLM.from_pretrained(output_dir / "warmup_lm")
        config = copy.deepcopy(lm.config)
        config.num_labels = 2
        model = AutoModelForTokenClassification.from_config(config)
        model.load_state_dict(lm.state_dict(), strict=False)  # all but the head (score.*)
    model.config.id2label, model.config.label2id = {0: "wrong", 1: "correct"}, {"wrong": 0, "correct": 1}
    model.config.pad_token_id = tokenizer.pad_token_id
    model.train()  # from_pretrained leaves eval mode: train as the built-in model does (its dropout, checkpointing)
    model = with_lora(model, args.memory).to(device)  # --lora-r: adapters and the head train, the rest is frozen
    if ckpt is not None:
        load_weights(model, ckpt / "model")
    optimizer = adamw([model], lr, args.weight_decay, eps=1e-8)

    # ---- seeding per process (dropout differs between ranks), or the saved state of a resumed run
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    state = {"iteration": 0, "elapsed": time.time() - t0, "run_name": run_name, "f1": None,  # f1: the last eval's
             "data_state": {"epoch": 0, "batches": []}}  # data_state: the position in the data (next_batch)
    if ckpt is not None:
        state = load_state(ckpt)
        load_optimizer_state(optimizer, state.pop("optimizer"))
        rngs = state.pop("rng")
        rng_states(rngs[rank % len(rngs)])
    start = state["iteration"] + 1
    metrics_path, run = open_run(args, output_dir, start, state["run_name"]) if rank == 0 else (None, None)
    lengths, local = [len(e["input_ids"]) for e in train], args.batch_size // world

    # 7. Held-out evaluation: step accuracy, wrong-step precision/recall/F1, solution accuracy, best-of-N.
    def evaluation() -> dict:
        """The held-out metrics of the model now, each process scoring its share of the rows."""
        with autocast(args.dtype, device):
            metrics = evaluate(model, evals[rank::world], tokenizer.pad_token_id, device)
            if candidates:
                metrics.update(best_of_n(model, tokenizer, candidates[rank::world], args.step_separator, device))
        return metrics

    t0 = time.time() - state["elapsed"]
    if start == 1:
        warmup = {"warmup/loss": warmup_loss} if warmup_loss is not None else {}
        row = {"iteration": 0, "elapsed_s": round(state["elapsed"], 3), **warmup, **evaluation()}
        log_row(metrics_path, run, row)
        state["f1"] = row["eval/wrong_step_f1"]
    progress = tqdm(range(start, args.total_steps + 1), initial=start - 1, total=args.total_steps, desc="prm",
                    disable=rank != 0)
    for iteration in progress:
        # 8. Training: anneal the learning rate, a batch of rows of similar length, this process's share, prm_step.
        for group in optimizer.param_groups:
            group["lr"] = lr * (1 - (iteration - 1) / args.total_steps) if args.anneal_lr else lr
        rows = next_batch(lengths, state["data_state"], args.batch_size, args.seed)[rank * local:(rank + 1) * local]
        try:
            metrics = prm_step(model, optimizer, [train[i] for i in rows], pad_token_id=tokenizer.pad_token_id,
                               gradient_accumulation_steps=args.gradient_accumulation_steps,
                               max_grad_norm=args.max_grad_norm, skip_nonfinite=args.skip_nonfinite, dtype=args.dtype)
        except FloatingPointError as e:
            fail("--skip-nonfinite", False, f"{e} at step {iteration}: the run stops here, its last good checkpoint "
                 "kept; lower --learning-rate, check the data, or pass --skip-nonfinite")
        row = {"iteration": iteration, "elapsed_s": round(time.time() - t0, 3), "lr": optimizer.param_groups[0]["lr"],
               **average_metrics(metrics, device, counts=("train/tokens",))}
        if args.eval_every and iteration % args.eval_every == 0 or iteration == args.total_steps:
            row.update(evaluation())
        log_row(metrics_path, run, row)
        state["f1"] = row.get("eval/wrong_step_f1", state["f1"])
        progress.set_postfix(loss=f"{row['train/loss']:.3f}", f1=f"{state['f1']:.3f}")
        # 9. Checkpoint: model, optimizer, random states and data position, written whole or not at all.
        if args.save_every and iteration % args.save_every == 0:
            state.update(iteration=iteration, elapsed=time.time() - t0)
            write_checkpoint(output_dir / "checkpoints" / f"iter_{iteration:06d}", model, tokenizer, optimizer, state,
                             args.keep_checkpoints, rank, world)
    close_run(args, model, tokenizer, output_dir, metrics_path, run, rank)


# Machinery below: the built-in task, loading and checking data, batching, processes, checkpoints; no algorithm.


# ---- The built-in task: a character tokenizer, a tiny model, and multi-step running sums with some wrong steps -------


BUILTIN_CHARS = "0123456789+-*=\n "


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over BUILTIN_CHARS, built offline with the `tokenizers` library."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *BUILTIN_CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left",
                                   chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, hidden: int = 64, layers: int = 2) -> torch.nn.Module:
    """A Llama-shaped causal LM built from config (random init; seed torch first for a fixed one)."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(config)


def multistep_problem(rng: random.Random) -> dict:
    """One problem of the built-in task: a running sum of 3-5 operands 0-4 ('2+3+4='), its correct steps
    (['2+3=5', '5+4=9']) and its answer ('9')."""
    nums = [rng.randrange(5) for _ in range(rng.randint(3, 5))]
    steps, total = [], nums[0]
    for x in nums[1:]:
        steps.append(f"{total}+{x}={total + x}")
        total += x
    return {"prompt": "+".join(map(str, nums)) + "=", "steps": steps, "answer": str(total)}


def multistep_prompt(rng: random.Random) -> dict:
    """A prompt row of the multi-step task, for ppo.py and rloo.py: --prompt-fn stepwise_prm:multistep_prompt."""
    problem = multistep_problem(rng)
    return {"prompt": problem["prompt"], "answer": problem["answer"]}


def multistep_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the result of the last step ('...=9') is the answer, else 0.0 (for ppo.py and rloo.py: --reward-fn
    stepwise_prm:multistep_reward)."""
    last = [c.strip().split("\n")[-1].rpartition("=")[2].strip() for c in completions]
    return [float(x == a) for x, a in zip(last, answer)]


def multistep_row(rng: random.Random, prompt: str | None = None, p_wrong: float = 0.5) -> dict:
    """A labelled solution to `prompt` (default: a new problem), stepwise. With probability p_wrong one step is off by
    1-3, later steps carry on from it, and it and every later one are labelled False, as in Math-Shepherd."""
    prompt = prompt or multistep_problem(rng)["prompt"]
    nums = [int(x) for x in prompt[:-1].split("+")]
    wrong_at = rng.randrange(len(nums) - 1) if rng.random() < p_wrong else len(nums)
    completions, total = [], nums[0]
    for i, x in enumerate(nums[1:]):
        result = total + x
        if i == wrong_at:
            off = rng.randint(1, 3)
            result += off if result < off or rng.random() < 0.5 else -off
        completions.append(f"{total}+{x}={result}")
        total = result
    return {"prompt": prompt, "completions": completions, "labels": [i < wrong_at for i in range(len(nums) - 1)]}


def builtin_rows(rng: random.Random, n: int, held_out: bool) -> list[dict]:
    """n labelled rows whose problems are (held_out=True) or are not in the held-out tenth of all problems, chosen
    by a hash of the prompt, so that no evaluation problem is ever trained on."""
    rows = []
    while len(rows) < n:
        row = multistep_row(rng)
        if (zlib.crc32(row["prompt"].encode()) % 10 == 0) == held_out:
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Loading and checking the model and the data, batches of rows of similar length, the built-in model's warm start


def fail(flag: str, value: Any, fix: str) -> NoReturn:
    """Stop the run with one line that names the flag, its value and the fix (no traceback)."""
    raise SystemExit(f"error: {flag} {value!r}: {fix}")


def load_pretrained(auto_cls, name: str, flag: str, trust_remote_code: bool = False, **kwargs) -> Any:
    """from_pretrained with a one-line error when the folder or hub id cannot be loaded."""
    try:
        return auto_cls.from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as e:
        if "trust_remote_code=True" in str(e) and not trust_remote_code:
            fail(flag, name, "its model code comes with it (auto_map in its config.json), and runs when loaded; pass "
                             "--trust-remote-code if you trust that code")
        hint = "no such folder, and" if not os.path.isdir(name) else "the folder exists but"
        fail(flag, name, f"{hint} it cannot be loaded ({str(e).splitlines()[0][:120]}); give a folder written by "
                         "save_pretrained or a Hugging Face id (offline runs need a local folder)")


def with_lora(model, lora: MemoryArgs) -> torch.nn.Module:
    """The model with fresh LoRA adapters (peft; they and a classifier's head train) and --gradient-checkpointing."""
    if lora.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    if lora.lora_r < 0:
        fail("--lora-r", lora.lora_r, "give the adapters' rank (0: no adapters, every weight trains)")
    if lora.lora_r == 0:
        return model
    if lora.lora_dropout != 0:
        fail("--lora-dropout", lora.lora_dropout, "dropout would change the logprobs between the rollout's and the "
             "update's forward passes; leave it at 0")
    causal_lm = model.get_output_embeddings() is not None  # a token classifier's head trains whole (modules_to_save)
    targets = "all-linear" if lora.lora_target_modules == ["all-linear"] else lora.lora_target_modules  # peft's word
    config = peft.LoraConfig(r=lora.lora_r, lora_alpha=lora.lora_alpha or 2 * lora.lora_r, lora_dropout=0.0,
                             target_modules=targets, exclude_modules=None if causal_lm else ["score", "classifier"],
                             task_type="CAUSAL_LM" if causal_lm else "TOKEN_CLS")
    try:
        return peft.get_peft_model(model, config)
    except ValueError as e:
        fail("--lora-target-modules", lora.lora_target_modules, f"{str(e).splitlines()[0][:160].rstrip('.')}; name "
             "modules the model has (e.g. q_proj v_proj), or all-linear")


def adamw(models: list, lr: float, weight_decay: float, eps: float = 1e-5) -> torch.optim.AdamW:
    """AdamW over what trains, decayed as transformers' Trainer decays: not biases, norm weights (0: one group)."""
    named = [(f"{i}.{n}", p) for i, m in enumerate(models) for n, p in m.named_parameters() if p.requires_grad]
    decay = {f"{i}.{n}" for i, m in enumerate(models) for n in get_parameter_names(m, [torch.nn.LayerNorm], [
        r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"])}  # Trainer's patterns
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups if weight_decay else [p for _, p in named], lr=lr, eps=eps, weight_decay=0.0)


def model_context(model) -> int:
    """The most positions the model takes."""
    return getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None) or 10**9


def load_stepwise(path: str, split: str) -> list[dict]:
    """Rows (prompt, completions, labels) of a hub dataset or a local json/jsonl/parquet file or folder, checked:
    any bad row stops the run with one line naming the row and the fix."""
    kinds = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
    try:
        if os.path.isfile(path):
            if Path(path).suffix not in kinds:
                fail("--dataset", path, f"unknown file type; use one of {sorted(kinds)}")
            ds = datasets.load_dataset(kinds[Path(path).suffix], data_files=path, split=split)
        else:
            ds = datasets.load_dataset(path, split=split)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:  # OSError: no file, or offline
        fail("--dataset", path, f"cannot load split {split!r} ({str(e).splitlines()[0][:120]}); check the path, "
                                "the hub id and --dataset-split/--eval-split (a single file is the split 'train')")
    missing = [c for c in ("prompt", "completions", "labels") if c not in ds.column_names]
    if missing:
        fail("--dataset", path, f"missing column(s) {missing}: stepwise rows need prompt, completions and labels; "
                                f"it has {ds.column_names}")
    rows = ds.select_columns(["prompt", "completions", "labels"]).to_list()
    for i, row in enumerate(rows):
        where, steps, labels = f"row {i} of split {split!r}", row["completions"] or [], row["labels"] or []
        if not isinstance(row["prompt"], str) or not all(isinstance(s, str) for s in steps):
            fail("--dataset", path, f"{where}: the prompt and every completion must be strings")
        if not steps:
            fail("--dataset", path, f"{where} has no completions; give each row at least one step, or drop the row")
        if len(labels) != len(steps):
            fail("--dataset", path, f"{where} has {len(labels)} labels for {len(steps)} completions; give one "
                                    "label per step")
        bad = [v for v in labels if not isinstance(v, bool)]
        if bad:
            fail("--dataset", path, f"{where} has the label {bad[0]!r}, which is not a boolean; write each label as "
                                    "true or false (numbers are not cast)")
    return rows


def load_model(args: Args) -> tuple:
    """The tokenizer and the model: the built-in one as a tiny causal LM (to warm-start), or --model as a 2-label
    token classifier (a causal LM gets a fresh head); --step-separator and --max-length checked against them."""
    if args.model == "builtin":
        tokenizer = build_tokenizer()
        model = build_tiny_model(tokenizer)
    else:
        tokenizer = load_pretrained(AutoTokenizer, args.model, "--model", args.trust_remote_code)
        model = load_pretrained(AutoModelForTokenClassification, args.model, "--model", args.trust_remote_code,
                                num_labels=2, dtype=torch.float32)  # fp32 weights whatever the folder's dtype
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    separator = tokenizer(args.step_separator, add_special_tokens=False).input_ids
    if not separator or tokenizer.unk_token_id in separator:
        fail("--step-separator", args.step_separator, f"the tokenizer cannot encode it (ids {separator}); choose a "
                                                      "separator made of text it knows, such as '\\n'")
    if args.max_length is not None and args.max_length > model_context(model):
        fail("--max-length", args.max_length, f"exceeds the model's context of {model_context(model)}; lower it")
    return tokenizer, model


def load_rows(args: Args) -> tuple[list[dict], list[dict], list[list[dict]]]:
    """Training rows, held-out rows and best-of-N candidates (--best-of-n per held-out problem, for the first 250):
    the built-in task's, its evaluation problems never trained on and the same for every seed, or --dataset's
    (no candidates), held out from --dataset-split unless --eval-split is given."""
    if args.dataset is None:
        train_rows = builtin_rows(random.Random(args.seed), args.num_train_rows, held_out=False)
        eval_rng = random.Random(0)
        eval_rows = builtin_rows(eval_rng, args.num_eval_rows, held_out=True)
        candidates = [[multistep_row(eval_rng, r["prompt"]) for _ in range(args.best_of_n)] for r in eval_rows[:250]]
        return train_rows, eval_rows, candidates if args.best_of_n else []
    train_rows = load_stepwise(args.dataset, args.dataset_split)
    if args.eval_split:
        return train_rows, load_stepwise(args.dataset, args.eval_split)[:args.num_eval_rows], []
    if len(train_rows) <= args.num_eval_rows:
        fail("--num-eval-rows", args.num_eval_rows, f"holding out that many of the {len(train_rows)} rows leaves "
                                                    "none to train on; lower it or give --eval-split")
    return train_rows[:-args.num_eval_rows], train_rows[-args.num_eval_rows:], []


def pad_batch(examples: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad tokenized rows: input_ids, attention_mask and labels, each [B, L] (labels -100 on padding)."""
    lengths = torch.tensor([len(e["input_ids"]) for e in examples])
    mask = torch.arange(int(lengths.max()))[None] < lengths[:, None]  # [B, L] True on each row's own tokens
    ids = torch.tensor([t for e in examples for t in e["input_ids"]])  # the rows' tokens, one after another
    labels = torch.tensor([t for e in examples for t in e["labels"]])
    return {"input_ids": torch.full(mask.shape, pad_token_id).masked_scatter(mask, ids), "attention_mask": mask.long(),
            "labels": torch.full(mask.shape, -100).masked_scatter(mask, labels)}


def length_grouped_batches(lengths: list[int], batch_size: int, seed: int) -> list[list[int]]:
    """One epoch of batches of rows of similar length, so that little of each batch is padding: shuffle, sort each
    window of 50 batches by length, cut it into batches (a window's last partial batch is dropped), shuffle them."""
    generator = torch.Generator().manual_seed(seed)
    order, window, batches = torch.randperm(len(lengths), generator=generator).tolist(), 50 * batch_size, []
    for w in range(0, len(order), window):
        rows = sorted(order[w:w + window], key=lambda i: lengths[i])
        batches += [rows[b:b + batch_size] for b in range(0, len(rows) - batch_size + 1, batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def next_batch(lengths: list[int], state: dict, batch_size: int, seed: int) -> list[int]:
    """Row indices of the next batch. `state` (the epoch and its batches still to come) is all the position there
    is, and goes into checkpoints."""
    if not state["batches"] or len(state["batches"][-1]) != batch_size:  # a resume may change --batch-size
        state["batches"] = length_grouped_batches(lengths, batch_size, seed + state["epoch"])
        state["epoch"] += 1
    return state["batches"].pop()


def warm_start(lm, tokenizer, solutions: list[dict], steps: int, lr: float, weight_decay: float, batch_size: int,
               seed: int, save_to: Path, rank: int) -> float:
    """Train a causal LM on solutions (tokenized rows, EOS appended) so that the PRM starts from weights that know the
    domain; rank 0 saves it to `save_to` (a starting policy for RL on the task). Every process runs the same steps.
    Returns the mean loss over the last tenth of the steps."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    examples = [{"input_ids": e["input_ids"] + eos, "labels": e["labels"] + [-100] * len(eos)} for e in solutions]
    if not examples:
        fail("--warmup-steps", steps, "no training row has every step correct; give 0")
    optimizer = adamw([lm], lr, weight_decay, eps=1e-8)
    state, losses, device = {"epoch": 0, "batches": []}, [], next(lm.parameters()).device
    lengths, batch_size = [len(e["input_ids"]) for e in examples], min(batch_size, len(examples))
    for step in tqdm(range(steps), desc="warm start", disable=rank != 0):
        for group in optimizer.param_groups:
            group["lr"] = lr * (1 - step / steps)
        batch = pad_batch([examples[i] for i in next_batch(lengths, state, batch_size, seed)], tokenizer.pad_token_id)
        targets = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)  # [B, L], the LM shifts them
        loss = lm(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                  labels=targets.to(device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if rank == 0:
        lm.save_pretrained(save_to)
        tokenizer.save_pretrained(save_to)
    tail = losses[-max(1, steps // 10):]
    return sum(tail) / len(tail)


# ---- Processes: autocast, data parallelism (gradient averaging, the NaN guard), metrics over processes ---------------


def autocast(dtype: str, device: torch.device) -> torch.autocast:
    """A context that runs forward passes in bf16 when dtype is 'bf16' (backward passes stay outside it)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")


def world_size() -> int:
    """Number of processes (1 without torchrun)."""
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def global_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over all processes (identity in a single process)."""
    if torch.distributed.is_initialized():
        x = x.clone()
        torch.distributed.all_reduce(x)
    return x


def step_or_skip(optimizer, params: list, nonfinite: bool, max_grad_norm: float, skip_nonfinite: bool) -> bool:
    """Average the gradients over processes (as DistributedDataParallel does; FSDP has reduced its sharded ones), clip,
    step; a NaN/inf loss or norm skips it, or raises FloatingPointError. True if it stepped."""
    if max_grad_norm <= 0:  # clip_grad_norm_ would zero every gradient (0: no step at all) or turn it round (< 0)
        fail("--max-grad-norm", max_grad_norm, "give the gradient norm to clip to, > 0 (1.0: TRL's default)")
    grads = [p.grad for p in params if p.grad is not None and not hasattr(p.grad, "placements")]
    if not nonfinite and grads and torch.distributed.is_initialized():
        flat = torch.cat([g.flatten() for g in grads])
        torch.distributed.all_reduce(flat)
        torch.nn.utils.vector_to_parameters(flat.div_(torch.distributed.get_world_size()), grads)  # slices of flat
    nonfinite = nonfinite or not torch.isfinite(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    if not nonfinite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if nonfinite and not skip_nonfinite:
        raise FloatingPointError("the loss or the gradient norm is NaN/inf")
    return not nonfinite


def setup_distributed() -> tuple[int, int, torch.device]:
    """Rank, world size and device. Under torchrun, joins the process group: nccl on GPUs, gloo on CPUs."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device


def average_metrics(metrics: dict, device: torch.device, counts: tuple[str, ...] = ()) -> dict:
    """Each metric over all processes (the same keys in each): the keys in `counts` (per-process counts) summed, /min
    and /max keys the minimum and maximum, the others averaged (means, and counts all share: loss/nonfinite_skipped)."""
    local = torch.tensor(list(metrics.values()), dtype=torch.float64, device=device)
    sign = torch.tensor([-1.0 if k.endswith("/min") else 1.0 for k in metrics], dtype=torch.float64, device=device)
    extreme = sign * local  # the maximum of -x over processes is minus the minimum of x
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(extreme, op=torch.distributed.ReduceOp.MAX)
    rows = zip(metrics, global_sum(local).tolist(), (sign * extreme).tolist())
    return {k: e if k.endswith(("/min", "/max")) else v if k in counts else v / world_size() for k, v, e in rows}


# ---- Run records and checkpoints -------------------------------------------------------------------------------------


def open_run(args, output_dir: Path, start: int, run_name: str) -> tuple[Path, Any]:
    """config.json, metrics.jsonl and samples.jsonl cut to the rows before `start`, wandb with --track. Rank 0 only."""
    output_dir.mkdir(parents=True, exist_ok=True)
    print(f"run folder: {output_dir}", flush=True)
    (output_dir / "config.json").write_text(json.dumps(asdict(args), indent=2))
    for log in (output_dir / "metrics.jsonl", output_dir / "samples.jsonl"):
        rows = log.read_text().splitlines() if start > 1 and log.exists() else []
        log.write_text("".join(r + "\n" for r in rows if json.loads(r)["iteration"] < start))
    run = None
    if args.track:
        import wandb
        run = wandb.init(project=args.wandb_project, entity=args.wandb_entity, name=run_name, id=run_name,
                         resume="allow", config=asdict(args), dir=str(output_dir), save_code=True)
    return output_dir / "metrics.jsonl", run


def log_row(path: Path | None, run, row: dict) -> None:
    """Append one row to metrics.jsonl, and to wandb when tracking. Rank 0 only (path None elsewhere)."""
    if path is None:
        return
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    if run is not None:
        run.log(row, step=row["iteration"])


def rng_states(restore: dict | None = None) -> dict:
    """This process's random number generator states, after setting them to `restore` (what it returned) if given."""
    if restore is not None:
        random.setstate(restore["python"])
        torch.set_rng_state(restore["torch"])
        if restore["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(restore["cuda"])
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def load_weights(model, folder: Path) -> None:
    """Load a checkpoint's safetensors into the model as they are (no second model, no code run; with LoRA the adapters
    and heads alone); the other kind, or a weight missing but a tied copy save_pretrained leaves out, stops the run."""
    lora = isinstance(model, peft.PeftModel)
    if lora != (folder / "adapter_config.json").exists():
        fail("--lora-r", 0 if not lora else model.peft_config["default"].r, f"the checkpoint {folder.parent} was "
             f"written {'without' if lora else 'with'} LoRA adapters: resume with the run's own --lora-r")
    if lora:  # the adapters' settings are the checkpoint's (others would load onto other modules, or scale otherwise)
        saved = json.loads((folder / "adapter_config.json").read_text())
        for key, flag in (("r", "--lora-r"), ("lora_alpha", "--lora-alpha"), ("lora_dropout", "--lora-dropout"),
                          ("target_modules", "--lora-target-modules")):
            ours, theirs = (sorted({t.rsplit(".", 1)[-1] for t in x}) if isinstance(x, set | list) else x
                            for x in (getattr(model.peft_config["default"], key), saved.get(key)))
            if ours != theirs:
                fail(flag, ours, f"the checkpoint {folder.parent} was written with {key} {theirs}: resume with it")
        found = peft.set_peft_model_state_dict(model, peft.utils.load_peft_weights(str(folder)))
        missing = [k for k in found.missing_keys if "lora_" in k or "modules_to_save" in k]
    else:  # a weight missing whose tied copy is loaded (save_pretrained leaves one out) is not missing
        state = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
        found, own = model.load_state_dict(state, strict=False), model.state_dict()
        held = {own[k].data_ptr() for k in own.keys() - set(found.missing_keys)}
        missing = [k for k in found.missing_keys if own[k].data_ptr() not in held]
    if found.unexpected_keys or missing:
        fail("--resume", str(folder.parent), f"its {folder.name} {'adapters' if lora else 'weights'} do not fit the "
             f"model (unexpected {found.unexpected_keys[:2]}, missing {missing[:2]}); resume with the run's --model")


def save_checkpoint(folder: Path, models: dict, weights: dict, tokenizer, state: dict, keep: int) -> None:
    """Write a checkpoint into a temporary folder renamed into place (never half of one); keep the newest `keep`."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for name, model in models.items():
        model.save_pretrained(tmp / name, state_dict=weights[name], save_original_format=False)  # the live keys
    tokenizer.save_pretrained(tmp / next(iter(models)))
    torch.save(state, tmp / "state.pt")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    for old in sorted(folder.parent.glob("iter_*[0-9]"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old)


def find_checkpoint(resume: str | None, output_dir: Path) -> Path | None:
    """The checkpoint folder that --resume names ('latest': the newest complete one in --output-dir), or None (new)."""
    found = sorted(p for p in (output_dir / "checkpoints").glob("iter_*[0-9]") if (p / "state.pt").exists())
    log = output_dir / "metrics.jsonl"  # a new run would overwrite its rows and model, or prune its checkpoints
    if resume is None and (found or log.is_file() and log.stat().st_size > 0):
        fail("--output-dir", str(output_dir), f"it holds another run ({found[-1].name if found else log.name}); " + (
             "add --resume latest to go on with that run, or give a new folder" if found else "give a new folder"))
    if resume is None:
        return None
    if resume == "latest":
        if not found:
            fail("--resume", resume, f"no complete checkpoint in {output_dir / 'checkpoints'}; check --output-dir")
        return found[-1]
    if not (Path(resume) / "state.pt").exists():
        fail("--resume", resume, "not a checkpoint folder (no state.pt); give .../checkpoints/iter_NNNNNN or 'latest'")
    return Path(resume)


def load_optimizer_state(optimizer, state: dict) -> None:
    """Restore what optimizer_state saved, sharding each tensor like its parameter; the run's weight decay kept (a
    decay on or off makes two parameter groups or one: the checkpoint's way is kept, else the run stops)."""
    params, decay = [p for g in optimizer.param_groups for p in g["params"]], optimizer.param_groups[0]["weight_decay"]
    if len(state["param_groups"]) != len(optimizer.param_groups):
        fail("--weight-decay", decay, f"the checkpoint's optimizer has {len(state['param_groups'])} parameter "
             f"group(s), weight decay {'off' if decay else 'on'}: resume with {'0' if decay else 'one > 0'}")
    for i, s in state["state"].items():
        if hasattr(params[i], "device_mesh"):
            state["state"][i] = {k: distribute_tensor(v, params[i].device_mesh, params[i].placements) if v.dim()
                                 else v for k, v in s.items()}
    optimizer.load_state_dict(state)
    optimizer.param_groups[0]["weight_decay"] = decay  # the state's groups hold the checkpoint's values


def load_state(folder: Path) -> dict:
    """A checkpoint's state.pt by torch.load(weights_only=True): plain data, else the run stops (no code run)."""
    try:
        return torch.load(folder / "state.pt", weights_only=True)
    except pickle.UnpicklingError as e:
        found = str(e).partition("GLOBAL ")[2].split(" ")[0] or "an object"
        fail("--resume", str(folder), f"its state.pt holds {found}, not only tensors, numbers, strings, lists and "
             "dicts, and loading it could run code: refused; resume from a checkpoint that this script wrote")


def write_checkpoint(folder: Path, model, tokenizer, optimizer, state: dict, keep: int, rank: int, world: int) -> None:
    """A checkpoint of the model, the optimizer, every process's random states and the loop's `state`. Every process
    calls it (gathering is a collective); rank 0 writes."""
    rngs = [rng_states()] * world
    if world > 1:
        torch.distributed.all_gather_object(rngs, rng_states())
    if rank == 0:
        save_checkpoint(folder, {"model": model}, {"model": model.state_dict()}, tokenizer,
                        {**state, "optimizer": optimizer.state_dict(), "rng": rngs}, keep)


def close_run(args: Args, model, tokenizer, output_dir: Path, metrics_path: Path | None, run, rank: int) -> None:
    """Save the final model (with LoRA: the adapters and head to adapter/, merged to model/) and print the last
    evaluation (rank 0), close wandb, and leave the process group once every process is done."""
    if rank == 0:
        if isinstance(model, peft.PeftModel):
            model.save_pretrained(output_dir / "adapter")
            model = model.merge_and_unload()
        model.save_pretrained(output_dir / "model")
        tokenizer.save_pretrained(output_dir / "model")
        final = json.loads(metrics_path.read_text().splitlines()[-1])
        bon = (f", best-of-{args.best_of_n} {final['eval/best_of_n_accuracy']:.3f} vs random pick "
               f"{final['eval/random_pick_accuracy']:.3f}") if "eval/best_of_n_accuracy" in final else ""
        print(f"final held-out step accuracy {final['eval/step_accuracy']:.3f}, wrong-step F1 "
              f"{final['eval/wrong_step_f1']:.3f}, solution accuracy {final['eval/solution_accuracy']:.3f}{bon}, "
              f"after {final['iteration']} steps in {final['elapsed_s']:.0f}s; model in {output_dir / 'model'}")
    if run is not None:
        run.finish()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # no process tears the group down while another still uses it (saving)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(tyro.cli(Args))
    if "LOCAL_RANK" in os.environ:  # under torchrun: all is saved and the group torn down; skip interpreter
        sys.stdout.flush()          # teardown, where gloo's leftover threads can abort the process (SIGABRT)
        sys.stderr.flush()
        os._exit(0)
