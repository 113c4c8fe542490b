# /// script
# requires-python = ">=3.11"
# dependencies = ["torch==2.13.0", "transformers==5.24.0", "tokenizers==0.23.3", "safetensors==0.8.0",
#                 "datasets==5.2.0", "tyro==1.0.17", "wandb==0.31.0", "tqdm==4.70.1", "peft==0.21.2"]
# ///
# `uv run interleave.py` needs ppo.py, rloo.py and stepwise_prm.py beside it (it imports them)
"""Interleave training strategies inside one loop: SFT, PPO, RLOO and a process reward model, one shared policy.

A declarative schedule picks the phase that the next step serves: round-robin with per-phase step counts, a seeded
weighted choice, or transitions on a condition (a logged metric crossing a threshold, or a step budget). The RL
phases can hand the prompts they failed to the next SFT turn, as ReLIFT (Ma et al. 2025, arXiv 2506.07527); SFT next
to RL is InstructGPT's PPO-ptx idea done as whole steps. docs/interleave.md explains the schedule and every metric.

    python interleave.py                                # recipe 'interleaved': SFT and RLOO turn about, built-in task
    python interleave.py sft-then-rl                    # SFT until its loss is low, then RLOO
    python interleave.py rl-with-sft-on-failures --rloo.reward-fn my_rewards.py:score --rloo.prompt-fn ...

The phases call `ppo_step`, `rloo_step` and `prm_step` of the scripts beside it (ppo.py, rloo.py, stepwise_prm.py
must sit in the same folder); this file adds `sft_step`, the schedule and the loop. Left out: mixing two objectives
in one gradient step (each step serves one phase), and more than one policy."""

import contextlib
import copy
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Literal

import torch
import tyro
from tqdm import tqdm

import ppo
import stepwise_prm
from ppo import PPOHParams, TaskArgs, fail, ppo_step
from rloo import RLOOHParams, check_group_update, rloo_step, sequence_rewards
from stepwise_prm import prm_step

PHASES = ("sft", "ppo", "rloo", "prm")
DEFAULT_LR_BUILTIN = {"sft": 1e-3, "ppo": 1e-3, "rloo": 1e-3, "prm": 3e-3}  # the tiny model, from random weights
DEFAULT_LR_PRETRAINED = {"sft": 1e-5, "ppo": 3e-6, "rloo": 3e-6, "prm": 1e-5}  # as ppo.py, rloo.py, stepwise_prm.py
# what each phase logs (under its own name: sft/loss, ppo/objective/scores, ...); tests check these against the steps
RL_LOGGED = ["objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
             "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg", "loss/policy_avg",
             "val/ratio", "val/ratio_var", "val/num_eos_tokens", "val/response_length", "loss/nonfinite_skipped"]
LOGGED = {"sft": ["loss", "token_accuracy", "nonfinite_skipped"],
          "ppo": [*RL_LOGGED, "loss/value_avg", "val/clipfrac_avg"],
          "rloo": [*RL_LOGGED, "loss/kl_avg", "rloo/baseline_avg", "rloo/advantage_std", "rloo/frac_equal_groups",
                   "policy/clipfrac_low_avg", "policy/clipfrac_high_avg", "policy/loss_token_frac",
                   "val/truncated_frac"],
          "prm": ["train/loss", "train/step_accuracy", "train/pad_fraction", "train/tokens", "train/nonfinite_skipped"]}
EVAL_METRICS = ["task/accuracy", "eval/scores"]
COUNTS = ("val/num_eos_tokens", "train/tokens")  # per-process counts: summed over processes, the other metrics averaged


@dataclass
class Turn:
    """How the schedule treats a phase."""

    steps: int = 1
    """steps per turn (round-robin schedule)"""
    weight: float = 1.0
    """relative chance of being picked (weighted schedule)"""
    until: str | None = None
    """transitions schedule: move on once this holds, e.g. 'sft/loss<0.05' or 'task/accuracy>0.9'"""
    max_steps: int = 0
    """transitions schedule: move on after this many steps (0: no budget)"""
    learning_rate: float | None = None
    """learning rate of this phase's steps (default: 1e-3, the PRM's 3e-3, on the built-in model; 1e-5 for SFT and
    the PRM, 3e-6 for PPO and RLOO, on any other)"""
    batch_size: int = 64
    """rows (SFT, PRM) or responses (PPO, RLOO) per step"""


@dataclass
class SFTPhase:
    """Supervised fine-tuning: next-token loss on the completion of each demonstration."""

    turn: Annotated[Turn, tyro.conf.arg(name="")] = field(default_factory=Turn)
    dataset: str | None = None
    """demonstrations: a hub id or local json/jsonl/parquet/csv file (default: the built-in task's answers)"""
    dataset_split: str = "train"
    """split of --sft.dataset"""
    prompt_column: str = "prompt"
    """column with the prompt"""
    completion_column: str = "answer"
    """column with the demonstration (in --sft.dataset, and in RL rows when --sft.on-failures is on)"""
    on_failures: bool = False
    """train first on the prompts the RL phases failed (score below their --success-threshold), with their
    demonstrations; the rest of each batch comes from the demonstrations"""
    max_grad_norm: float = 1.0
    """gradient-norm clip"""
    skip_nonfinite: bool = False
    """skip (and count) a step whose loss or gradient norm is NaN/inf, instead of stopping the run"""
    logits_chunk: int = 2 ** 24
    """logits made at a time (positions x vocabulary rows), recomputed in the backward pass (0: all at once)"""


@dataclass
class PPOPhase:
    """PPO steps (ppo.py's ppo_step) on this phase's prompts and rewards; adds a value model."""

    turn: Annotated[Turn, tyro.conf.arg(name="")] = field(default_factory=Turn)
    task: Annotated[TaskArgs, tyro.conf.arg(name="")] = field(default_factory=TaskArgs)
    hp: Annotated[PPOHParams, tyro.conf.arg(name="")] = field(default_factory=PPOHParams)


@dataclass
class RLOOPhase:
    """RLOO steps (rloo.py's rloo_step) on this phase's prompts and rewards."""

    turn: Annotated[Turn, tyro.conf.arg(name="")] = field(default_factory=Turn)
    task: Annotated[TaskArgs, tyro.conf.arg(name="")] = field(default_factory=TaskArgs)
    hp: Annotated[RLOOHParams, tyro.conf.arg(name="")] = field(default_factory=RLOOHParams)


@dataclass
class PRMPhase:
    """Trains a process reward model (stepwise_prm.py's prm_step) beside the policy, on its own optimizer."""

    turn: Annotated[Turn, tyro.conf.arg(name="")] = field(default_factory=Turn)
    dataset: str | None = None
    """stepwise rows (prompt, completions, labels); default: the built-in multi-step arithmetic data"""
    dataset_split: str = "train"
    """split of --prm.dataset"""
    step_separator: str = "\n"
    """appended to every step; the label sits on its last token"""
    skip_nonfinite: bool = False
    """skip (and count) a step whose loss or gradient norm is NaN/inf, instead of stopping the run"""


@dataclass
class Args:
    """Alternate SFT, PPO, RLOO and PRM steps on one shared policy, as a schedule says."""

    exp_name: str = "interleave"
    """name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of python, torch, the prompt order and the weighted schedule"""
    output_dir: str | None = None
    """run folder (config.json, metrics.jsonl, checkpoints/, model/); default runs/<run_name>"""
    track: bool = False
    """log to Weights & Biases (works offline with WANDB_MODE=offline)"""
    wandb_project: str = "rlft"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team or user)"""
    model: str = "builtin"
    """the shared policy: a Hugging Face id or a local folder; 'builtin' is a tiny Llama-shaped model"""
    trust_remote_code: bool = False
    """allow model code from the hub (off unless asked)"""
    phases: tuple[str, ...] = ("sft", "rloo")
    """the phases, in order: any of sft, ppo, rloo, prm"""
    schedule: Literal["round-robin", "weighted", "transitions"] = "round-robin"
    """round-robin: each phase for its --X.steps in turn; weighted: a seeded random phase per step by --X.weight;
    transitions: each phase until its --X.until holds or its --X.max-steps run out, then the next"""
    total_steps: int = 2000
    """steps in all, over all phases"""
    anneal_lr: bool = True
    """decay every phase's learning rate linearly to 0 over --total-steps"""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay of every weight but biases and normalisation weights (as transformers' Trainer)"""
    shared_optimizer: bool = True
    """one AdamW for the policy across phases (each step uses its phase's learning rate); else one per phase"""
    eval_every: int = 25
    """evaluate with greedy decoding every this many steps (and at the start and the end; 0: only there)"""
    save_every: int = 0
    """write a checkpoint every this many steps (0: only the final model)"""
    keep_checkpoints: int = 2
    """keep the newest this many checkpoints (0: all)"""
    resume: str | None = None
    """continue from a checkpoint folder, or 'latest' in --output-dir"""
    fsdp: bool = False
    """shard every model over the processes with FSDP2 (under torchrun)"""
    gen: Annotated[ppo.GenArgs, tyro.conf.arg(name="")] = field(default_factory=ppo.GenArgs)
    memory: Annotated[ppo.MemoryArgs, tyro.conf.arg(name="")] = field(default_factory=ppo.MemoryArgs)
    sft: SFTPhase = field(default_factory=SFTPhase)
    ppo: PPOPhase = field(default_factory=PPOPhase)
    rloo: RLOOPhase = field(default_factory=RLOOPhase)
    prm: PRMPhase = field(default_factory=PRMPhase)


RECIPES = {
    "interleaved": ("SFT and RLOO take turns, one step each (the default)", Args()),
    "sft-then-rl": ("SFT until its loss falls below 0.05 (at most 300 steps), then RLOO",
                    Args(schedule="transitions", sft=SFTPhase(turn=Turn(until="sft/loss<0.05", max_steps=300)))),
    "rl-with-sft-on-failures": ("RLOO, and every third step SFT on the prompts RLOO failed (ReLIFT-style)",
                                Args(phases=("rloo", "sft"), rloo=RLOOPhase(turn=Turn(steps=2)),
                                     sft=SFTPhase(on_failures=True))),
    "weighted": ("a seeded random phase each step: SFT 1 : RLOO 2",
                 Args(schedule="weighted", rloo=RLOOPhase(turn=Turn(weight=2.0)))),
    "with-prm": ("SFT, RLOO and a process reward model trained beside the policy, in turn",
                 Args(phases=("sft", "rloo", "prm"))),
}


# ---------------------------------------------------------------------------------------------------------------------
# The schedule: pure functions of (config, step, state, recent metrics)


def parse_condition(text: str) -> tuple[str, str, float]:
    """'sft/loss<0.05' -> ('sft/loss', '<', 0.05)."""
    op = "<" if "<" in text else ">"
    name, _, value = text.partition(op)
    return name.strip(), op, float(value)


def schedule(args: Args, step: int, state: dict, recent: dict[str, float]) -> tuple[str, dict]:
    """The phase that serves `step` (1, 2, ...), and the schedule's new state ({'index', 'steps'}: the current phase
    of the transitions schedule and the steps spent in it). Round-robin and weighted depend on (config, step) alone."""
    turns = {p: getattr(args, p).turn for p in args.phases}
    if args.schedule == "round-robin":
        cycle = [p for p in args.phases for _ in range(turns[p].steps)]
        return cycle[(step - 1) % len(cycle)], state
    if args.schedule == "weighted":
        rng = random.Random(args.seed * 1_000_003 + step)
        return rng.choices(args.phases, [turns[p].weight for p in args.phases])[0], state
    index, steps = state["index"], state["steps"]
    turn = turns[args.phases[index]]
    met = False
    if turn.until:
        name, op, value = parse_condition(turn.until)
        met = name in recent and (recent[name] < value if op == "<" else recent[name] > value)
    if index + 1 < len(args.phases) and (met or 0 < turn.max_steps <= steps):
        index, steps = index + 1, 0
    return args.phases[index], {"index": index, "steps": steps + 1}


# ---------------------------------------------------------------------------------------------------------------------
# Supervised fine-tuning


def sft_batch(tokenizer, prompts: list, completions: list[str]) -> dict[str, torch.Tensor]:
    """Right-padded prompt + completion + EOS; labels are -100 on the prompt and on padding. All [B, L]."""
    examples = []
    for p, c in zip(prompts, completions):
        prompt_ids = ppo.render_prompt(tokenizer, p)
        completion_ids = tokenizer(c, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        examples.append({"input_ids": prompt_ids + completion_ids, "labels": [-100] * len(prompt_ids) + completion_ids})
    return stepwise_prm.pad_batch(examples, tokenizer.pad_token_id)


def sft_step(policy, optimizer, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor, *,
             max_grad_norm: float = 1.0, skip_nonfinite: bool = False, logits_chunk: int = 2 ** 24) -> dict[str, float]:
    """One supervised step: next-token cross-entropy on the labelled tokens (input_ids, attention_mask, labels [B, L],
    labels -100 where there is nothing to learn), summed over all processes and divided by their count."""
    device = next(policy.parameters()).device
    input_ids, attention_mask, labels = input_ids.to(device), attention_mask.to(device), labels.to(device)
    (B, L), targets, mask = input_ids.shape, labels[:, 1:], labels[:, 1:] != -100  # [B, L-1]
    scored = torch.arange(B * L, device=device).view(B, L)[:, :-1][mask]  # [N] the positions with a label next
    h, head = ppo.forward_to_head(policy, scored, logits_chunk, input_ids=input_ids, attention_mask=attention_mask,
                                  use_cache=False)  # h [N, H], or the logits [N, V]
    n = ppo.global_sum(mask.sum().float()).clamp(min=1) / ppo.world_size()
    losses, hits = ppo.over_logits([head], [h], targets.clamp(min=0), lambda x, t: (  # [B, L-1] each: loss, hit
        -ppo.token_logprobs(x, t, 1.0)[0], (x.argmax(-1) == t).float()), logits_chunk, mask)
    loss = (losses * mask).sum() / n
    loss.backward()  # even when not finite: every process runs the same collectives
    finite = torch.isfinite(loss)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    taken = ppo.step_or_skip(optimizer, params, ppo.global_sum((~finite).float()) > 0, max_grad_norm, skip_nonfinite)
    return {"loss": ppo.masked_mean(losses.detach(), mask).item(),
            "token_accuracy": ppo.masked_mean(hits, mask).item(), "nonfinite_skipped": float(not taken)}


# ---------------------------------------------------------------------------------------------------------------------
# The loop: one step is the numbered steps below (main calls functions defined after it: names resolve at the call).


def main(args: Args) -> None:
    # ---- validate the configuration before anything is loaded
    builtin = check_args(args)
    rank, world, device = ppo.setup_distributed()
    rl = [p for p in args.phases if p in ("ppo", "rloo")]
    args.gen.max_new_tokens = args.gen.max_new_tokens or (4 if builtin else 64)
    args.rloo.hp.max_completion_length = args.rloo.hp.max_completion_length or args.gen.max_new_tokens
    if args.resume and args.resume != "latest" and args.output_dir is None:
        args.output_dir = str(Path(args.resume).parent.parent)
    stamp = int(time.time())  # a default folder of a run started in the same second: the next free second's name
    while args.output_dir is None and Path(f"runs/{args.exp_name}__{args.seed}__{stamp}").exists():
        stamp += 1
    run_name = f"{args.exp_name}__{args.seed}__{stamp}"
    output_dir = Path(args.output_dir or f"runs/{run_name}")
    ckpt = ppo.find_checkpoint(args.resume, output_dir)

    # ---- models: the shared policy, its frozen reference, a value model for PPO, a PRM beside them; each phase's data
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    tokenizer, policy = ppo.load_policy(args.model, args.trust_remote_code)
    models = {"policy": policy}
    ref_policy = None if args.memory.lora_r else ppo.disable_dropout(copy.deepcopy(policy)).eval().requires_grad_(False)
    # 1. Models: the value model (PPO) and the PRM start from the policy's weights under fresh heads; with LoRA, each
    #    gets adapters of its own (the policy's, trained by every policy phase, are off for the reference).
    for name, phase, num_labels in (("value", "ppo", 1), ("prm", "prm", 2)):
        if phase in args.phases:
            models[name] = ppo.token_classifier_from(policy, num_labels, "--model", f"drop the {phase} phase",
                                                     args.trust_remote_code)
    models = {name: ppo.with_lora(model, args.memory) for name, model in models.items()}
    policy = models["policy"]
    context = ppo.model_context(policy)
    sources = {p: load_phase(args, p, tokenizer, context) for p in args.phases}
    eval_task = sources[rl[0]] if rl else ppo.load_task(TaskArgs(), tokenizer, context, args.gen.max_new_tokens)
    if ckpt is not None:
        for name, model in models.items():
            ppo.load_weights(model, ckpt / name)
    ppo.place([*models.values(), ref_policy, *[m for p in rl for m in (sources[p].reward_model, sources[p].prm)]],
              device, args.fsdp, world)

    # ---- optimizers: the policy's (shared, or one per phase) and the PRM's own
    def adamw(*mods):  # AdamW over the modules' parameters (each step sets its phase's learning rate)
        return ppo.adamw(list(mods), 1e-3, args.weight_decay)

    defaults = DEFAULT_LR_BUILTIN if args.model == "builtin" else DEFAULT_LR_PRETRAINED
    lrs = {p: defaults[p] if (lr := getattr(args, p).turn.learning_rate) is None else lr for p in args.phases}
    # 2. One AdamW for the policy's phases (each step sets its phase's learning rate), or one per phase.
    value = [models["value"]] if "value" in models else []
    shared = adamw(policy, *value)
    own = lambda p: adamw(models["prm"]) if p == "prm" else adamw(policy, *(value if p == "ppo" else []))
    optimizers = {p: shared if args.shared_optimizer and p != "prm" else own(p) for p in args.phases}  # the PRM's own

    # ---- per-process seeding, or the saved state of a resumed run
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    start, elapsed, sched, failures = 0, 0.0, {"index": 0, "steps": 0}, []
    data = {p: {"epoch": 0, "pos": 0, "rng": random.Random(args.seed + i).getstate()} for i, p in enumerate(PHASES)}
    recent: dict[str, float] = {}
    if ckpt is not None:
        state = ppo.load_state(ckpt)
        for p, opt in optimizers.items():
            ppo.load_optimizer_state(opt, state["optimizers"][p])
        ppo.rng_states(state["rng"][rank % len(state["rng"])])
        start, elapsed, sched = state["step"] + 1, state["elapsed"], state["schedule"]
        failures = [row for saved in state["failures"][rank::world] for row in saved]  # its own (any process count)
        data, recent, run_name = state["data"], state["recent"], state["run_name"]
    metrics_path, run = ppo.open_run(args, output_dir, start, run_name) if rank == 0 else (None, None)
    samplers = {p: ppo.generation_configs(args.gen, tokenizer, hp.temperature, hp.top_k, hp.top_p, hp.min_p)[0]
                for p, hp in ((p, getattr(args, p).hp) for p in rl)}
    greedy = ppo.generation_configs(args.gen, tokenizer, 1.0)[1]

    def evaluate() -> tuple[dict, list]:
        """Greedy (and --eval-num-samples sampled) decoding of the first RL phase's eval prompts, else built-in's."""
        with phase_flags(rl[0] if rl else "eval"):
            sample = samplers[rl[0]] if rl else greedy
            return ppo.evaluate(policy, tokenizer, eval_task, sample, greedy, args.gen.stop_strings, rank, world)

    if start == 0:
        metrics, samples = evaluate()
        recent.update(metrics)
        ppo.log_row(metrics_path, run, {"iteration": 0, "phase": "eval", "elapsed_s": 0.0, **metrics}, samples)
        start = 1
    progress = tqdm(range(start, args.total_steps + 1), initial=start - 1, total=args.total_steps,
                    desc="interleave", disable=rank != 0)
    t0 = time.time() - elapsed
    for step in progress:
        # 3. The schedule picks this step's phase; the phase's learning rate, annealed over --total-steps.
        phase, sched = schedule(args, step, sched, recent)
        for group in optimizers[phase].param_groups:
            group["lr"] = lrs[phase] * ((1 - (step - 1) / args.total_steps) if args.anneal_lr else 1)
        # One step of the phase (steps 4 to 6 below main), on this process's share of the phase's batch.
        try:
            if phase == "sft":
                metrics = sft_phase_step(args, policy, optimizers["sft"], tokenizer, sources["sft"], data["sft"],
                                         failures, rank, world)
            elif phase == "prm":
                metrics = prm_phase_step(args, models["prm"], optimizers["prm"], tokenizer, sources["prm"], step,
                                         rank, world)
            else:
                metrics = rl_phase_step(args, phase, models, ref_policy, optimizers[phase], tokenizer, sources[phase],
                                        samplers[phase], data[phase], failures, rank, world)
        except FloatingPointError as e:
            check = "the rewards" if phase in rl else "the data"
            fail(f"--{phase}.skip-nonfinite", False, f"{e} at step {step}: the run stops here, its last good "
                 f"checkpoint kept; lower --{phase}.learning-rate, check {check}, or pass the flag")
        # 7. Log: metrics under the phase's name (sft/loss, rloo/objective/kl, ...); evaluation every --eval-every.
        row = {"iteration": step, "phase": phase, "elapsed_s": round(time.time() - t0, 3),
               "lr": optimizers[phase].param_groups[0]["lr"],
               **{f"{phase}/{k}": v for k, v in ppo.average_metrics(metrics, device, COUNTS).items()}}
        samples = None
        if args.eval_every and step % args.eval_every == 0 or step == args.total_steps:
            eval_metrics, samples = evaluate()
            row.update(eval_metrics)
        recent.update({k: v for k, v in row.items() if isinstance(v, float)})
        ppo.log_row(metrics_path, run, row, samples)
        progress.set_postfix(phase=phase, acc=f"{recent['task/accuracy']:.3f}")  # the last evaluation's
        # 8. Checkpoint: models, optimizers, random states, schedule state, failures and data positions.
        if args.save_every and step % args.save_every == 0:
            mine = [(ppo.rng_states(), failures)] * world  # every process's random states and failures
            if world > 1:
                torch.distributed.all_gather_object(mine, mine[0])
            state = {"step": step, "elapsed": time.time() - t0, "schedule": sched, "failures": [f for _, f in mine],
                     "data": data, "recent": recent, "run_name": run_name, "rng": [r for r, _ in mine],
                     "optimizers": {p: ppo.optimizer_state(opt) for p, opt in optimizers.items()}}
            weights = {name: ppo.full_state_dict(model) for name, model in models.items()}
            if rank == 0:
                ppo.save_checkpoint(output_dir / "checkpoints" / f"iter_{step:06d}", models, weights, tokenizer,
                                    state, args.keep_checkpoints)

    for name, model in models.items():  # model/ (the policy), value/, prm/; with LoRA merged, the adapters beside
        folder, adapter = ("model", "adapter") if name == "policy" else (name, f"{name}_adapter")
        ppo.save_model(model, tokenizer, output_dir / folder, output_dir / adapter, rank)
    if rank == 0:
        final = json.loads(metrics_path.read_text().splitlines()[-1])
        print(f"final task/accuracy {final.get('task/accuracy')} after {args.total_steps} steps in "
              f"{final['elapsed_s']:.0f}s; model in {output_dir / 'model'}")
    if run is not None:
        run.finish()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # no process tears the group down while another still uses it (saving)
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# One step of each phase, on this process's share of the phase's global batch


def sft_phase_step(args: Args, policy, optimizer, tokenizer, demos: ppo.Task, data: dict, failures: list, rank: int,
                   world: int) -> dict[str, float]:
    """The SFT phase's step: demonstrations (and the RL phases' failures), then one sft_step."""
    # 4. SFT: the next demonstrations; with --sft.on-failures, this process's oldest failures replace the first.
    local = args.sft.turn.batch_size // world
    rows = ppo.draw_rows(demos, data, args.sft.turn.batch_size, args.seed)[rank * local:(rank + 1) * local]
    if args.sft.on_failures:
        rows = failures[:local] + rows[len(failures[:local]):]
        del failures[:local]
    batch = sft_batch(tokenizer, [r["prompt"] for r in rows], [str(r[args.sft.completion_column]) for r in rows])
    return sft_step(policy, optimizer, **batch, max_grad_norm=args.sft.max_grad_norm,
                    skip_nonfinite=args.sft.skip_nonfinite, logits_chunk=args.sft.logits_chunk)


def rl_phase_step(args: Args, phase: str, models: dict, ref_policy, optimizer, tokenizer, task: ppo.Task, sample,
                  data: dict, failures: list, rank: int, world: int) -> dict[str, float]:
    """A PPO or RLOO phase's step: a rollout on the phase's own prompts and rewards, then ppo_step or rloo_step."""
    # 5. RL: k samples of each next prompt (k = 1 for PPO), scored; prompts with a failure join the failure buffer.
    cfg, policy = getattr(args, phase), models["policy"]
    k = cfg.hp.rloo_k if phase == "rloo" else 1
    local = cfg.turn.batch_size // world // k  # prompts of this process
    prompts = ppo.draw_rows(task, data, cfg.turn.batch_size // k, args.seed)
    rows = [r for r in prompts[rank * local:(rank + 1) * local] for _ in range(k)]
    with ppo.autocast(cfg.hp.dtype, next(policy.parameters()).device), phase_flags(phase):
        out = ppo.rollout(policy, tokenizer, rows, sample, args.gen.stop_strings, task)
    if args.sft.on_failures:  # each prompt once, however many of its k samples failed; the buffer keeps the newest 1024
        col = args.sft.completion_column  # of a row, what SFT reads, as plain data that a checkpoint can hold
        failed = {i // k: json.loads(json.dumps({"prompt": rows[i]["prompt"], col: str(rows[i][col])}, default=str))
                  for i in range(len(rows)) if out["scores"][i] < task.args.success_threshold}
        failures.extend(failed.values())
        del failures[:-1024]
    common = {"hp": cfg.hp, "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
              "sampler_logprobs": out["sampler_logprobs"]}
    if phase == "ppo":  # a PRM's step scores go in per token, as in ppo.py, or per response, as in rloo.py
        rewards = ppo.token_rewards(out["scores"], out["masks"], out["process"], cfg.task.prm_weight, cfg.hp.gamma)
        metrics = ppo_step(policy, models["value"], ref_policy, optimizer, out["queries"], out["responses"], rewards,
                           out["masks"], **common)
    else:
        rewards = sequence_rewards(out["scores"], out["process"], cfg.hp.prm_aggregate, cfg.task.prm_weight)
        metrics = rloo_step(policy, ref_policy, optimizer, out["queries"], out["responses"], rewards, out["masks"],
                            ended=out["ended"], **common)
    return {**metrics, "sampling/decode_live_frac": out["decode_live_frac"]}


def prm_phase_step(args: Args, prm, optimizer, tokenizer, examples: list[dict], step: int, rank: int,
                   world: int) -> dict[str, float]:
    """The PRM phase's step: this process's share of a batch of stepwise rows, then one prm_step on the PRM."""
    # 6. PRM: a random batch of stepwise rows (seeded by --seed + step), sorted by length so that it pads little.
    local = args.prm.turn.batch_size // world
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(args.seed + step))
    batch = [examples[i] for i in order[:args.prm.turn.batch_size].tolist()][rank * local:(rank + 1) * local]
    return prm_step(prm, optimizer, sorted(batch, key=lambda e: len(e["input_ids"])),
                    pad_token_id=tokenizer.pad_token_id, skip_nonfinite=args.prm.skip_nonfinite)


# ---------------------------------------------------------------------------------------------------------------------
# Loading each phase's data and checking the configuration, with ppo.py's errors under this script's flag names


@contextlib.contextmanager
def phase_flags(phase: str):
    """Rename the flags in a one-line error of ppo.py's or stepwise_prm.py's helpers as this script spells them:
    their --reward-fn is --rloo.reward-fn here (the flags of TaskArgs and the updates'; --max-new-tokens stays)."""
    try:
        yield
    except SystemExit as e:
        names = "|".join(f.name.replace("_", "-") for c in (TaskArgs, PPOHParams, RLOOHParams) for f in fields(c))
        raise SystemExit(re.sub(rf"--({names})(?![\w-])", rf"--{phase}.\1", str(e))) from None


def load_phase(args: Args, phase: str, tokenizer, context: int) -> ppo.Task | list[dict]:
    """What a phase trains on: an RL phase's task (prompts and rewards), SFT's demonstrations (a task whose rows hold
    --sft.completion-column), or the PRM's tokenized stepwise rows."""
    with phase_flags(phase):
        if phase == "sft" and args.sft.dataset:
            demos = ppo.load_prompt_dataset(args.sft.dataset, args.sft.dataset_split, args.sft.prompt_column)
            if args.sft.completion_column not in demos.column_names:
                fail("--sft.completion-column", args.sft.completion_column, f"the dataset has {demos.column_names}")
            return ppo.Task(TaskArgs(), demos, [])
        if phase == "sft":
            return ppo.Task(TaskArgs(), ppo.addition_prompt, [])
        if phase == "prm":
            if args.prm.dataset:
                rows = stepwise_prm.load_stepwise(args.prm.dataset, args.prm.dataset_split)
            else:
                rows = stepwise_prm.builtin_rows(random.Random(args.seed), 4096, held_out=False)
            return [stepwise_prm.tokenize_example(tokenizer, r["prompt"], r["completions"], r["labels"],
                                                  args.prm.step_separator) for r in rows]
        task = ppo.load_task(getattr(args, phase).task, tokenizer, context, args.gen.max_new_tokens,
                             args.trust_remote_code)
    if args.sft.on_failures and args.sft.completion_column not in task.eval_rows[0]:
        fail("--sft.completion-column", args.sft.completion_column, f"the {phase} phase's prompt rows have no such "
             f"column ({sorted(task.eval_rows[0])}), so its failures have no demonstrations")
    return task


def check_args(args: Args) -> bool:
    """Validate the schedule and the phases before any model is loaded, one line per problem; True when every RL
    phase takes the built-in task's prompts. Processes: torchrun's WORLD_SIZE (the group does not exist yet)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    unknown = [p for p in args.phases if p not in PHASES]
    if unknown or not args.phases or len(set(args.phases)) != len(args.phases):
        fail("--phases", list(args.phases), f"name each phase once, from {list(PHASES)}")
    absent = [p for p in PHASES if p not in args.phases and getattr(args, p) != type(getattr(args, p))()]
    if absent and os.environ.get("RANK", "0") == "0":  # flags of a phase that never runs: said, not ignored in silence
        print(f"note: --{'.*, --'.join(absent)}.* set for phases not in --phases {list(args.phases)}: they do nothing")
    for p in args.phases:
        turn = getattr(args, p).turn
        if turn.steps < 1:
            fail(f"--{p}.steps", turn.steps, "steps per turn must be positive")
        if turn.max_steps < 0:
            fail(f"--{p}.max-steps", turn.max_steps, "a step budget must be positive, or 0 for none")
        if turn.batch_size < 1 or turn.batch_size % world:
            fail(f"--{p}.batch-size", turn.batch_size, f"must be positive and divisible by {world} process(es)")
        if turn.weight <= 0 and args.schedule == "weighted":
            fail(f"--{p}.weight", turn.weight, "weights must be positive, or the phase never runs")
        if turn.until:
            try:
                name, _, _ = parse_condition(turn.until)
            except ValueError:
                fail(f"--{p}.until", turn.until, "write it as metric<value or metric>value, e.g. sft/loss<0.05")
            known = [f"{p}/{m}" for m in LOGGED[p]] + EVAL_METRICS
            if name not in known:
                fail(f"--{p}.until", turn.until, f"phase {p} does not log {name}; it logs {known}")
    for i, p in enumerate(args.phases[:-1] if args.schedule == "transitions" else []):
        if not (getattr(args, p).turn.until or getattr(args, p).turn.max_steps):
            fail(f"--{p}.until", None, f"phase {p} never ends, so {list(args.phases[i + 1:])} can never run; give "
                                        f"--{p}.until or --{p}.max-steps")
    if "sft" in args.phases and args.sft.max_grad_norm <= 0:  # a clip to 0 zeroes every gradient
        fail("--sft.max-grad-norm", args.sft.max_grad_norm, "give a value > 0 (at 0 nothing would train)")
    if args.sft.on_failures and not {"ppo", "rloo"} & set(args.phases):
        fail("--sft.on-failures", True, "needs an RL phase (ppo or rloo) whose failures it trains on")
    builtin = True
    for p in [p for p in args.phases if p in ("ppo", "rloo")]:
        hp, size = getattr(args, p).hp, getattr(args, p).turn.batch_size
        k, groups = (hp.rloo_k, f"--rloo-k ({hp.rloo_k}: whole groups) x ") if p == "rloo" else (1, "")
        with phase_flags(p):
            builtin = ppo.check_task(getattr(args, p).task) and builtin
            ppo.check_update(hp)
            if p == "rloo":
                check_group_update(hp)
            if size % (k * world) or size // (k * world) % (hp.num_mini_batches * hp.gradient_accumulation_steps):
                fail(f"--{p}.batch-size", size, f"must be divisible by {groups}{world} process(es) x "
                     f"--num-mini-batches ({hp.num_mini_batches}) x --gradient-accumulation-steps "
                     f"({hp.gradient_accumulation_steps})")
    return builtin


if __name__ == "__main__":
    main(ppo.parse_args(Args, RECIPES, sys.argv[1:], "Alternate SFT, PPO, RLOO and PRM steps on one shared policy. "
                        "Name a recipe (before or after the flags), which the flags override; with none named, "
                        "'interleaved' runs. Recipes:"))
    if "LOCAL_RANK" in os.environ:  # under torchrun: all is saved and the group torn down; skip interpreter
        sys.stdout.flush()          # teardown, where gloo's leftover threads can abort the process (SIGABRT)
        sys.stderr.flush()
        os._exit(0)
