# /// script
# requires-python = ">=3.11"
# dependencies = ["torch==2.13.0", "transformers==5.24.0", "tokenizers==0.23.3", "safetensors==0.8.0",
#                 "datasets==5.2.0", "tyro==1.0.17", "wandb==0.31.0", "tqdm==4.70.1", "peft==0.21.2"]
# ///
"""PPO for language models, in one file.

Proximal Policy Optimization (Schulman et al. 2017, arXiv 1707.06347) as InstructGPT used it for RLHF (Ouyang et al.
2022, arXiv 2203.02155), after "The N+ Implementation Details of RLHF with PPO" (Huang et al. 2024, arXiv 2403.17031).
docs/ppo.md explains every numbered step and every logged metric.

    python ppo.py                                       # built-in task: single-digit addition, tiny model, offline
    python ppo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset prompts.jsonl --reward-fn my_rewards.py:score

Custom loops (tool use, dense or process rewards) import `ppo_step`; `main()` below is one such loop.
Left out: an inference engine such as vLLM (generation is the model's own forward), asynchronous rollouts (each
update waits for its batch), tensor and pipeline parallelism (FSDP2 at most), a value head on the policy's trunk (the
value model is its own network), reward-model training."""

from __future__ import annotations

import bisect
import copy
import difflib
import functools
import inspect
import json
import math
import numbers
import os
import pickle
import pkgutil
import random
import runpy
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

import datasets
import peft
import torch
import tyro
from safetensors.torch import load_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    CompileConfig,
    GenerationConfig,
    LlamaConfig,
    MinPLogitsWarper,
    PreTrainedTokenizerFast,
    StoppingCriteriaList,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import DynamicCache, StaticCache, StaticLayer
from transformers.trainer_pt_utils import get_parameter_names


@dataclass
class Args:
    """Train a language model with PPO on reward functions, a reward model, or both."""

    exp_name: str = "ppo"
    """name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of python, torch and the prompt order (each process adds its rank)"""
    output_dir: str | None = None
    """run folder (config.json, metrics.jsonl, checkpoints/, model/); default runs/<run_name>"""
    track: bool = False
    """log to Weights & Biases (works offline with WANDB_MODE=offline)"""
    wandb_project: str = "rlft"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team or user)"""
    model: str = "builtin"
    """policy: a Hugging Face id or a local folder; 'builtin' is a tiny Llama-shaped model built from config"""
    value_model: str | None = None
    """value model, loaded as a one-label token classifier (None: --reward-model, else the policy + a fresh head)"""
    trust_remote_code: bool = False
    """allow model code from the hub (off unless asked)"""
    total_episodes: int = 64_000
    """responses to train on in all (iterations = total_episodes // batch_size)"""
    batch_size: int = 256
    """responses per iteration, over all processes"""
    learning_rate: float | None = None
    """AdamW learning rate (None: 1e-3 for the built-in model, 3e-6 for any other; 0 trains nothing)"""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay of every weight but biases and normalisation weights (as transformers' Trainer)"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0"""
    eval_every: int = 25
    """evaluate with greedy decoding every this many iterations (and at the start and the end; 0: only there)"""
    save_every: int = 0
    """write a checkpoint every this many iterations (0: only the final model)"""
    keep_checkpoints: int = 2
    """keep the newest this many checkpoints (0: all)"""
    resume: str | None = None
    """continue from a checkpoint folder (.../checkpoints/iter_000100), or 'latest' in --output-dir"""
    compile: bool = False
    """torch.compile the models' forward passes and the decode loop's one-token step (CUDA graphs on a GPU)"""
    fsdp: bool = False
    """shard the policy, value, reference and reward models over the processes with FSDP2 (under torchrun)"""
    task: Annotated[TaskArgs, tyro.conf.OmitArgPrefixes] = field(default_factory=lambda: TaskArgs())
    gen: Annotated[GenArgs, tyro.conf.OmitArgPrefixes] = field(default_factory=lambda: GenArgs())
    memory: Annotated[MemoryArgs, tyro.conf.OmitArgPrefixes] = field(default_factory=lambda: MemoryArgs())
    ppo: Annotated[PPOHParams, tyro.conf.OmitArgPrefixes] = field(default_factory=lambda: PPOHParams())


@dataclass
class TaskArgs:
    """Where prompts come from and how responses are scored (neither given: the built-in task's prompts and reward)."""

    dataset: str | None = None
    """prompt source: a hub dataset id, or a local json/jsonl/parquet/csv file or folder"""
    dataset_split: str = "train"
    """split of --dataset to train on"""
    eval_split: str | None = None
    """split of --dataset to evaluate on (None: the first rows of --dataset-split)"""
    prompt_column: str = "prompt"
    """column with the prompt: a string, or a list of chat messages (rendered with the tokenizer's chat template)"""
    prompt_fn: str | None = None
    """prompt source: module:function or path/file.py:function; fn(rng: random.Random) -> {'prompt': ..., **columns}"""
    num_eval_prompts: int = 100
    """size of the fixed evaluation set (the built-in task always uses all its 100 sums)"""
    reward_fn: list[str] = field(default_factory=list)
    """reward functions, module:function or file.py:function, called as by TRL: fn(prompts, completions, **columns)"""
    reward_weights: list[float] | None = None
    """one weight per --reward-fn (None: all 1.0)"""
    reward_model: str | None = None
    """a sequence classifier with one label, read at the last token of prompt+completion (its own tokenizer)"""
    reward_model_weight: float = 1.0
    """weight of the reward model's score in the total score"""
    missing_eos_penalty: float | None = None
    """subtracted from the score of responses that end neither with EOS nor with a stop string"""
    success_threshold: float = 1.0
    """an evaluation completion counts towards task/accuracy (and pass@k, maj@N) when its score reaches this"""
    eval_num_samples: int = 0
    """sampled completions per evaluation prompt besides the greedy one, for eval/pass@k and eval/maj@N (0: off)"""
    answer_fn: str | None = None
    """what maj@N votes on: fn(completion text) -> answer or None (module:function; built-in task: the text itself)"""
    prm_model: str | None = None
    """a process reward model (two-label token classifier, e.g. from stepwise_prm.py) that rewards each step"""
    prm_weight: float = 1.0
    """weight w of the process rewards: ppo.py shapes by w x min(p_1..p_k) (step_rewards), rloo.py adds w x aggregate"""
    prm_separator: str = "\n"
    """what ends a step in a response (as in the PRM's training data)"""


@dataclass
class GenArgs:
    """Generation settings (temperature, top-k, top-p and min-p are the algorithm's: the update's logprobs use them)."""

    max_new_tokens: int | None = None
    """most tokens per response (None: 4 for the built-in task, 64 otherwise)"""
    min_new_tokens: int = 0
    """fewest tokens per response, EOS banned before (off-policy, as --repetition-penalty: the logprobs ignore it)"""
    repetition_penalty: float = 1.0
    """repetition penalty (1.0: off; off-policy, see --min-new-tokens)"""
    stop_strings: list[str] = field(default_factory=list)
    """end a response after the first of these strings (kept in the response)"""
    compact_below: float = 0.5
    """drop finished rows from the decode loop's batch once the share still running falls under this (0: never)"""


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


@dataclass
class PPOHParams:
    """The hyperparameters of one PPO update (`ppo_step`)."""

    kl_coef: float = 0.05
    """weight of the per-token KL penalty that is folded into the reward"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """per-token KL in the reward: k1 = logp - ref_logp, or k3 = exp(r) - 1 - r with r = ref_logp - logp (>= 0)"""
    temperature: float = 1.0
    """sampling temperature; the logprobs are computed from logits divided by it"""
    top_k: int = 0
    """sample among the k most likely tokens (0: off); the update's logprobs use the same support (on-policy)"""
    top_p: float = 1.0
    """nucleus sampling (1.0: off); the update's logprobs use the same support (on-policy)"""
    min_p: float = 0.0
    """drop tokens below min_p times the top probability (0: off); the update's logprobs use the same support"""
    sampler_correction_cap: float | None = None
    """weight each token's policy-gradient loss by min(exp(old_logp - sampler_logp), cap): truncated importance
    sampling for what differs between the sampler's and the trainer's logprobs (TRL's token_truncate; None: off)"""
    cliprange: float = 0.2
    """PPO clip range of the policy ratio"""
    cliprange_value: float = 0.2
    """clip range of the value prediction around its rollout value"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    ent_coef: float = 0.0
    """weight of an entropy bonus (0: none, as in the reference recipe)"""
    gamma: float = 1.0
    """discount factor"""
    lam: float = 0.95
    """GAE lambda"""
    whiten_rewards: bool = False
    """whiten the per-token rewards before GAE"""
    num_ppo_epochs: int = 4
    """passes over the rollout batch per update"""
    num_mini_batches: int = 4
    """optimizer steps per epoch: the batch is split into this many mini-batches"""
    gradient_accumulation_steps: int = 1
    """micro-batches per mini-batch (gradients accumulated)"""
    max_grad_norm: float = 1.0
    """gradient-norm clip for policy and value parameters together"""
    forward_batch_size: int = 64
    """rows per chunk in the no-grad rollout forward passes"""
    logits_chunk: int = 2 ** 24
    """logits made at once (scored positions x vocabulary rows; 64 MB fp32), recomputed in backward (0: all at once)"""
    skip_nonfinite: bool = False
    """skip (and count) a mini-batch whose loss or gradient norm is NaN/inf, instead of stopping the run"""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """forward passes in bf16 under autocast but the policy's output layer; weights and optimizer state stay fp32"""


RECIPES: dict[str, tuple] = {}  # named configurations (rloo.py has the GRPO family); none for PPO


# ---- The algorithm: PPO's math on tensors (small pure functions), then one update, ppo_step --------------------------


def response_valid_mask(responses: torch.Tensor, pad_token_id: int, eos_token_id: int | None = None,
                        masks: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] bool: the tokens of each response, its final EOS included, padding excluded. A response ends after its
    first EOS; when pad != EOS, trailing pad tokens are padding; trailing zeros of `masks` are padding too."""
    B, T = responses.shape
    length = torch.full((B,), T, device=responses.device)
    if eos_token_id is not None:
        is_eos = responses == eos_token_id
        length = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, length)
    if pad_token_id != eos_token_id:
        length = torch.minimum(length, T - (responses.flip(1) == pad_token_id).int().cumprod(1).sum(1))
    if masks is not None:
        length = torch.minimum(length, T - (masks.flip(1) == 0).int().cumprod(1).sum(1))
    return torch.arange(T, device=responses.device)[None] < length[:, None]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over mask (0 when the mask is empty)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise x over mask (and over all processes) to unit variance (unbiased) and, if shift_mean, zero mean."""
    n, s = global_sum(mask.sum().float()), global_sum((x * mask).sum())
    mean = s / n
    var = global_sum((((x - mean) * mask) ** 2).sum()) / (n - 1).clamp(min=1)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate at sampled tokens, r = ref - logp (Schulman, "Approximating KL Divergence"): k1 = -r,
    k2 = r^2 / 2, k3 = exp(r) - 1 - r. As values (in the reward) k1 and k3 estimate KL(pi || ref) without bias; as
    loss terms only their expected gradients count: k1's is 0, token by token k2's that of KL(pi || ref) at the sampled
    prefix, k3's that of KL(ref || pi); summed over T > 1 tokens, not the responses' KL gradient (prefixes are held)."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    r = ref_logprobs - logprobs
    if estimator == "k2":
        return 0.5 * r ** 2
    if estimator == "k3":
        return r.exp() - 1 - r
    raise ValueError(f"unknown KL estimator {estimator!r}: use k1, k2 or k3")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, support: tuple = (0, 1.0, 0.0),
                   with_entropy: bool = False, entropy_grad: bool = False, support_of: torch.Tensor | None = None
                   ) -> tuple:
    """Logprobs [B, T] of tokens under logits [B, T, V] (or [N, V]) as sampled: / temperature, on the support the
    filters (top_k, top_p, min_p) keep on them or on `support_of`; and that entropy, differentiable if entropy_grad."""
    logits = logits.float() / temperature  # [B, T, V] (or a chunk [N, V] from over_logits)
    if tuple(support) != (0, 1.0, 0.0):
        sampler = (logits if support_of is None else support_of.float() / temperature).detach()
        logits = logits.masked_fill(filter_logits(sampler, *support, keep=tokens).isneginf(), -float("inf"))
    lse = logits.logsumexp(-1)  # [B, T]
    logprobs = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logprobs, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        kept = logits.masked_fill(logits == -float("inf"), 0.0)  # filtered tokens: probability 0, no term
        return logprobs, lse - (logits.softmax(-1) * kept).sum(-1)


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation backwards over T (rewards, values: 0 on padding); advantages, returns [B, T]."""
    next_values = torch.nn.functional.pad(values[:, 1:], (0, 1))  # [B, T]: 0 after the last token
    advantages, last = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_values[:, t] - values[:, t]
        last = delta + gamma * lam * last
        advantages[:, t] = last
    return advantages, advantages + values


def response_values(value_model, queries, query_mask, responses, valid) -> torch.Tensor:
    """Value of the state before each response token; [B, T] (one forward of the packed sequences: packed_inputs)."""
    inputs, index = packed_inputs(value_model, queries, query_mask, responses, valid)
    return value_model(**inputs).logits.flatten(0, 1)[index, 0].float()  # [B, T]


def token_classifier_from(lm, num_labels: int, flag: str, fix: str, trust_remote_code: bool = False) -> Any:
    """A token classifier (value model, PRM) with a causal LM's weights under a fresh head, or one line with `fix`."""
    config = copy.deepcopy(lm.config)
    config.num_labels = num_labels
    model = AutoModelForTokenClassification.from_config(config, trust_remote_code=trust_remote_code)
    missing = model.load_state_dict(lm.state_dict(), strict=False).missing_keys
    if any(k.startswith(model.base_model_prefix + ".") for k in missing):
        fail(flag, lm.name_or_path, f"a token classifier cannot take this model's weights; {fix}")
    return model


def step_rewards(steps: list[tuple[int, float]], weight: float) -> list[tuple[int, float]]:
    """Process rewards of one response's (token index, p) steps as potential-based shaping (Ng et al. 1999): potential
    w x min(p_1..p_k) after step k, 0 before and at the end; each step the change (last token: -final). They sum to 0:
    they move when credit comes, not the optimum (a plain sum of step scores pays PPO to write one confident step)."""
    out, low, previous = [], 1.0, 0.0
    for j, p in steps:
        low = min(low, p)
        out.append((j, weight * low - previous))
        previous = weight * low
    return out + [(-1, -previous)] if steps else []


def token_rewards(scores: torch.Tensor, masks: torch.Tensor, process: list | None, weight: float,
                  gamma: float = 1.0) -> torch.Tensor:
    """What ppo_step gets: scores [B], or with a PRM [B, T]: each step's reward where it ends, the score at the end;
    gamma < 1: every token t before the last gets gamma Phi(t + 1) - Phi(t), the shaping whose discounted sum is 0."""
    if process is None:
        return scores
    rewards = torch.zeros(masks.shape)
    last = masks.sum(1).clamp(min=1) - 1
    rewards[torch.arange(len(scores)), last] = scores
    for b, steps in enumerate(process):
        for j, r in step_rewards(steps, weight):
            rewards[b, last[b] if j < 0 else j] += r
        shaped = rewards[b, :last[b]]  # [L - 1]: the shaping before the last token, so its cumsum is Phi(t + 1)
        rewards[b, :last[b]] += (gamma - 1) * shaped.cumsum(0)
    return rewards


def ppo_step(policy, value_model, ref_policy, optimizer, queries: torch.Tensor, responses: torch.Tensor,
             rewards: torch.Tensor, masks: torch.Tensor | None = None, *, hp: PPOHParams, pad_token_id: int,
             eos_token_id: int | None = None, sampler_logprobs: torch.Tensor | None = None) -> dict[str, float]:
    """One PPO update on a batch of finished episodes.

    queries [B, Lq] left-padded prompt ids; responses [B, T] right-padded ids; rewards [B] (one score per response)
    or [B, T] (dense or process rewards; past a response's end they count on its last token); masks [B, T], 0 on
    tokens not to train on (tool output: no gradient, no KL, and at the end no value loss). A response ends after its
    first eos_token_id (None when EOS may appear inside an episode), before trailing pad and mask-0 tokens.
    sampler_logprobs [B, T]: logged, and for hp.sampler_correction_cap. ref_policy None: adapters off. No dropout."""
    B, T = responses.shape
    micro = B // (hp.num_mini_batches * hp.gradient_accumulation_steps)
    if micro * hp.num_mini_batches * hp.gradient_accumulation_steps != B:
        raise ValueError(f"batch of {B} does not split into {hp.num_mini_batches} mini-batches x "
                         f"{hp.gradient_accumulation_steps} accumulation steps")
    if rewards.shape not in ((B,), (B, T)):  # [B, 1] would broadcast: the score on every token
        raise ValueError(f"rewards of shape {tuple(rewards.shape)}: give [B] = [{B}] or [B, T] = [{B}, {T}]")
    if hp.kl_estimator not in ("k1", "k3"):  # a custom loop's; k2's value is a biased KL (kl_penalty)
        raise ValueError(f"kl_estimator {hp.kl_estimator!r}: the reward takes the KL's value, so use k1 or k3")
    refuse_dropout(policy=policy, value_model=value_model, ref_policy=ref_policy)
    device = next(policy.parameters()).device
    queries, responses, rewards = queries.to(device), responses.to(device), rewards.to(device).float()
    support = (hp.top_k, hp.top_p, hp.min_p)  # the sampler's filters: the policy's and the reference's logprobs
    sampler_logprobs = None if sampler_logprobs is None else sampler_logprobs.to(device)  # [B, T], moved once

    # 1. Masks: `valid` is the response itself (padding excluded), `train` the valid tokens not masked out.
    valid = response_valid_mask(responses, pad_token_id, eos_token_id, None if masks is None else masks.to(device))
    train = valid & (masks.to(device).bool() if masks is not None else True)
    query_mask = (queries != pad_token_id).cumsum(1) > 0  # left padding is the leading run of pad tokens
    rows = lambda i: (queries[i], query_mask[i], responses[i], valid[i])  # the forwards' inputs for rows i

    # 2. Rollout passes, no gradients: old logprobs and values, the reference's on the policy sampler's support; in
    # one mini-batch without accumulation the first epoch's pass is the rollout's, the policy here only for a filter.
    def forward(i) -> tuple:  # the update's forward pass, with gradients: logprobs, entropy and values of rows i
        with autocast(hp.dtype, device):
            return *response_logprobs(policy, *rows(i), hp.temperature, support, True, hp.ent_coef > 0,
                                      hp.logits_chunk), response_values(value_model, *rows(i))

    fused = hp.num_mini_batches == 1 and hp.gradient_accumulation_steps == 1
    first = forward(slice(None)) if fused else None  # [B, T] each
    with torch.no_grad(), autocast(hp.dtype, device):
        chunks, parts = [slice(i, i + hp.forward_batch_size) for i in range(0, B, hp.forward_batch_size)], []
        for c in chunks:  # models: [(h [b, T, H], output layer)] at the positions that score rows c's responses
            models = [] if fused and support == (0, 1.0, 0.0) else [
                response_hidden(policy, *rows(c), hp.logits_chunk)]
            ref_model, ref_context = reference(policy, ref_policy)  # ref_policy None: the policy, adapters off
            with ref_context:
                models.append(response_hidden(ref_model, *rows(c), hp.logits_chunk))
            parts.append(logprobs_on_support(models, responses[c], hp.temperature, support, hp.logits_chunk, valid[c]))
        ref_logprobs = torch.cat([p[-1] for p in parts])
        if fused:
            old_logprobs, old_values = first[0].detach(), first[2].detach() * valid
        else:
            old_logprobs = torch.cat([p[0] for p in parts])
            old_values = torch.cat([response_values(value_model, *rows(c)) for c in chunks]) * valid

        # 3. Per-token rewards: -kl_coef * KL on trained tokens, plus the score on the last token of the response.
        kl = kl_penalty(old_logprobs, ref_logprobs, hp.kl_estimator) * train  # [B, T]
        non_score = -hp.kl_coef * kl
        last = (valid.sum(1) - 1).clamp(min=0)  # [B] index of the last response token
        if rewards.dim() == 1:  # one score per response: on its last token
            rewards = torch.zeros_like(kl).index_put((torch.arange(B, device=device), last), rewards)
        scores = rewards.sum(1)  # [B]
        per_token = non_score + rewards * valid  # rewards on padding (past the response's end) move to its last token
        per_token[torch.arange(B, device=device), last] += (rewards * ~valid).sum(1)  # no reward is dropped
        if hp.whiten_rewards:
            per_token = masked_whiten(per_token, valid, shift_mean=False) * valid

        # 4. GAE over the response, returns = advantages + values, advantages whitened over trained tokens.
        advantages, returns = gae(per_token, old_values, hp.gamma, hp.lam)
        advantages = masked_whiten(advantages, train) * train

    # 5. PPO epochs over shuffled mini-batches; token sums / the mini-batch's tokens on all processes (one gradient).
    params = [p for g in optimizer.param_groups for p in g["params"]]
    mini, skipped, stats, row = B // hp.num_mini_batches, 0, [], {}  # stats: each finite micro-batch's metrics (row)
    for epoch in range(hp.num_ppo_epochs):
        for mb in torch.randperm(B, device=device).split(mini):  # shuffled mini-batches
            n_train = global_sum(train[mb].sum().float()).clamp(min=1) / world_size()
            n_valid = global_sum(valid[mb].sum().float()).clamp(min=1) / world_size()
            bad = torch.zeros((), device=device)
            for i in mb.split(micro):
                new_logprobs, entropy, new_values = (x[i] for x in first) if fused and epoch == 0 else forward(i)
                v_clipped = old_values[i] + (new_values - old_values[i]).clamp(-hp.cliprange_value, hp.cliprange_value)
                vf_unclipped, vf_clipped = (new_values - returns[i]) ** 2, (v_clipped - returns[i]) ** 2
                vf_losses = torch.max(vf_unclipped, vf_clipped)
                vf_loss = 0.5 * (vf_losses * valid[i]).sum() / n_valid
                log_ratio = new_logprobs - old_logprobs[i]
                ratio = log_ratio.exp()
                pg_losses = torch.max(-advantages[i] * ratio,
                                      -advantages[i] * ratio.clamp(1 - hp.cliprange, 1 + hp.cliprange))
                if hp.sampler_correction_cap is not None and sampler_logprobs is not None:
                    weight = (old_logprobs[i] - sampler_logprobs[i]).exp()  # [b, T], truncated at the cap
                    pg_losses = pg_losses * weight.clamp(max=hp.sampler_correction_cap)
                loss = (pg_losses * train[i]).sum() / n_train + hp.vf_coef * vf_loss
                if hp.ent_coef > 0:
                    loss = loss - hp.ent_coef * (entropy * train[i]).sum() / n_train
                loss.backward()  # even when not finite: every process runs the same collectives
                with torch.no_grad():  # masked means over the trained tokens (the value's: over the response)
                    t, v = train[i], valid[i]
                    row = {"loss/policy_avg": masked_mean(pg_losses, t), "policy/entropy_avg": masked_mean(entropy, t),
                           "loss/value_avg": 0.5 * masked_mean(vf_losses, v), "val/ratio": masked_mean(ratio, t),
                           "policy/approxkl_avg": 0.5 * masked_mean(log_ratio ** 2, t),
                           "policy/clipfrac_avg": masked_mean(((ratio - 1).abs() > hp.cliprange).float(), t),
                           "val/clipfrac_avg": masked_mean((vf_clipped > vf_unclipped).float(), v)}
                if torch.isfinite(loss):
                    stats.append(row)
                else:
                    bad += 1
            if not step_or_skip(optimizer, params, global_sum(bad) > 0, hp.max_grad_norm, hp.skip_nonfinite):
                skipped += 1

    # 6. Metrics (means over this process's batch; the caller averages them over processes).
    eos = (responses == eos_token_id) & valid if eos_token_id is not None else torch.zeros_like(valid)  # [B, T]
    return {
        "objective/kl": kl.sum(1).mean().item(), "objective/entropy": (-old_logprobs * train).sum(1).mean().item(),
        "objective/non_score_reward": non_score.sum(1).mean().item(),
        "objective/rlhf_reward": (scores + non_score.sum(1)).mean().item(), "objective/scores": scores.mean().item(),
        **{key: torch.stack([s[key] for s in stats]).mean().item() if stats else float("nan") for key in row},
        "val/ratio_var": torch.stack([s["val/ratio"] for s in stats]).var().item() if len(stats) > 1 else 0.0,
        "val/num_eos_tokens": eos.sum().item(), "val/response_length": valid.sum(1).float().mean().item(),
        "loss/nonfinite_skipped": float(skipped),
        **({} if sampler_logprobs is None else sampler_metrics(old_logprobs, sampler_logprobs, train)),
    }


# The loop. It calls the machinery below the marker: Python looks a name up when the call runs, so that is fine.
def main(args: Args) -> None:
    hp, gen = args.ppo, args.gen
    # ---- check the configuration before anything is loaded
    rank, world, device = setup_distributed()
    builtin = check_task(args.task)  # the task's flags checked whatever else is given
    gen.max_new_tokens = gen.max_new_tokens or (4 if builtin else 64)
    check_update(hp)
    local_batch = args.batch_size // world
    if args.batch_size % world or local_batch % (hp.num_mini_batches * hp.gradient_accumulation_steps):
        fail("--batch-size", args.batch_size, f"must be divisible by {world} process(es) x --num-mini-batches "
             f"({hp.num_mini_batches}) x --gradient-accumulation-steps ({hp.gradient_accumulation_steps})")
    num_iterations, output_dir, run_name, ckpt = plan_run(args)

    random.seed(args.seed)  # the same initial weights in every process
    torch.manual_seed(args.seed)
    tokenizer, policy = load_policy(args.model, args.trust_remote_code)
    # 7. Models: the reference is a frozen copy of the policy (LoRA: the policy, adapters off); a one-label value model.
    ref_policy = None if args.memory.lora_r else disable_dropout(copy.deepcopy(policy)).eval().requires_grad_(False)
    source, flag = args.value_model or args.task.reward_model, "--value-model" if args.value_model else "--reward-model"
    if source and not args.value_model:  # the value model reads the policy's ids: so must the reward model it starts as
        theirs = load_pretrained(AutoTokenizer, source, flag, args.trust_remote_code).get_vocab()
        added = tokenizer.get_added_vocab()  # special and added tokens may be named otherwise
        if any(theirs.get(token) != i for token, i in tokenizer.get_vocab().items() if token not in added):
            if rank == 0:
                print(f"note: --reward-model {source}'s tokenizer gives the policy's tokens other ids, so the value "
                      "model starts from the policy's weights (--value-model picks another)")
            source = None
    value_model = load_pretrained(AutoModelForTokenClassification, source, flag, args.trust_remote_code, num_labels=1,
                                  dtype=torch.float32) if source else \
        token_classifier_from(policy, 1, "--model", "give --value-model", args.trust_remote_code)  # fp32 as the policy
    value_model.config.pad_token_id = tokenizer.pad_token_id
    policy, value_model = with_lora(policy, args.memory), with_lora(value_model, args.memory)
    task = load_task(args.task, tokenizer, model_context(policy), gen.max_new_tokens, args.trust_remote_code, world)
    if ckpt is not None:
        load_weights(policy, ckpt / "policy")
        load_weights(value_model, ckpt / "value")
    place([policy, ref_policy, value_model, task.reward_model, task.prm], device, args.fsdp, world)
    lr = (1e-3 if args.model == "builtin" else 3e-6) if args.learning_rate is None else args.learning_rate
    optimizer = adamw([policy, value_model], lr, args.weight_decay)

    state, start = resume_state(ckpt, optimizer, args.seed, rank, run_name)
    sample, greedy = generation_configs(gen, tokenizer, hp.temperature, hp.top_k, hp.top_p, hp.min_p)
    compile_models(args.compile, [policy, ref_policy, value_model], [sample, greedy], device)
    metrics_path, run = open_run(args, output_dir, start, state["run_name"]) if rank == 0 else (None, None)
    if start == 1:
        with autocast(hp.dtype, device):
            metrics, samples = evaluate(policy, tokenizer, task, sample, greedy, gen.stop_strings, rank, world)
        log_row(metrics_path, run, {"iteration": 0, "episode": 0, "elapsed_s": 0.0, **metrics}, samples)
        state["accuracy"] = metrics["task/accuracy"]
    spreads = []  # the first iterations' score spreads
    progress = tqdm(range(start, num_iterations + 1), "ppo", total=num_iterations, initial=start - 1, disable=rank > 0)
    t0 = time.time() - state["elapsed"]
    for iteration in progress:
        # 8. Rollout: anneal the learning rate, take this process's share of the prompts, sample and score.
        for group in optimizer.param_groups:
            group["lr"] = lr * (1 - (iteration - 1) / num_iterations) if args.anneal_lr else lr
        rows = draw_rows(task, state["prompt_state"], args.batch_size, args.seed)
        rows = rows[rank * local_batch:(rank + 1) * local_batch]
        with autocast(hp.dtype, device):
            out = rollout(policy, tokenizer, rows, sample, gen.stop_strings, task)
        # 9. Update: the scores (with a PRM, per-token process rewards too) go into one ppo_step.
        rewards = token_rewards(out["scores"], out["masks"], out["process"], args.task.prm_weight, hp.gamma)
        check_scores_vary(rewards.view(len(rewards), -1).sum(1).to(device), spreads, args.model == "builtin", rank)
        try:
            metrics = ppo_step(policy, value_model, ref_policy, optimizer, out["queries"], out["responses"], rewards,
                               out["masks"], hp=hp, pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=tokenizer.eos_token_id, sampler_logprobs=out["sampler_logprobs"])
        except FloatingPointError as e:
            fail("--skip-nonfinite", False, f"{e} at iteration {iteration}: the run stops here, its last good "
                 "checkpoint kept; lower --learning-rate, check the rewards, or pass --skip-nonfinite")
        # 10. Log: metrics averaged over processes (counts summed), a row per iteration; evaluation every --eval-every.
        metrics["sampling/decode_live_frac"] = out["decode_live_frac"]
        metrics["sampling/decode_shapes"] = len(vars(policy).get("decode_caches", ()))  # static caches (--compile)
        if out["process"] is not None:
            step_minima = [min((p for _, p in steps), default=0) for steps in out["process"]]
            metrics["objective/prm_min_step_score"] = sum(step_minima) / len(rows)
        state["episode"] += args.batch_size
        row = {"iteration": iteration, "episode": state["episode"], "elapsed_s": round(time.time() - t0, 3),
               "lr": optimizer.param_groups[0]["lr"], **average_metrics(metrics, device, ("val/num_eos_tokens",))}
        samples = None
        if args.eval_every and iteration % args.eval_every == 0 or iteration == num_iterations:
            with autocast(hp.dtype, device):
                eval_metrics, samples = evaluate(policy, tokenizer, task, sample, greedy, gen.stop_strings, rank, world)
            row.update(eval_metrics)
            state["accuracy"] = eval_metrics["task/accuracy"]
        log_row(metrics_path, run, row, samples)
        progress.set_postfix(score=f"{row['objective/scores']:.3f}", kl=f"{row['objective/kl']:.3f}",
                             acc=f"{state['accuracy']:.3f}")
        # 11. Checkpoint: models, optimizer, random states and prompt position, written whole or not at all.
        if args.save_every and iteration % args.save_every == 0:
            state.update(iteration=iteration, elapsed=time.time() - t0)
            save_state(output_dir / "checkpoints" / f"iter_{iteration:06d}", {"policy": policy, "value": value_model},
                       tokenizer, optimizer, state, args.keep_checkpoints, rank, world)
    finish_run(policy, tokenizer, output_dir, metrics_path, run, rank)


# Machinery below: loading and checking inputs, the task, generation, processes, checkpoints, logs; no algorithm.


# ---- The built-in task: a character tokenizer, a tiny model, and single-digit addition with partial credit -----------


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


def addition_prompt(rng: random.Random) -> dict:
    """One prompt row of the built-in task: 'a+b=' with single digits, and its answer."""
    a, b = rng.randrange(10), rng.randrange(10)
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def addition_eval_rows() -> list[dict]:
    """The built-in task's fixed evaluation set: all 100 sums."""
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]


def addition_reward(prompts, completions, completion_ids, answer, tokenizer, **kwargs) -> list[float]:
    """1.0 for the answer and EOS, else 0.5 x the share of its digits in place (0/1 gives random init no signal)."""
    return [1.0 if list(ids) == tokenizer(ans, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            else 0.5 * sum(c == a for c, a in zip(text, ans)) / len(ans)
            for text, ids, ans in zip(completions, completion_ids, answer)]


# ---- Loading and checking what the user gives: callables, models, prompts, rewards -----------------------------------


def fail(flag: str, value: Any, fix: str) -> NoReturn:
    """Stop the run with one line that names the flag, its value and the fix (no traceback)."""
    raise SystemExit(f"error: {flag} {value!r}: {fix}")


def load_callable(spec: str, flag: str) -> Callable:
    """'module:function' imported (the current folder on the path), or 'path/to/file.py:function' run (runpy)."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        fail(flag, spec, "write it as module:function or path/to/file.py:function")
    if target.endswith(".py") and not os.path.isfile(target):
        fail(flag, spec, f"there is no file {target}; check the path")
    if not target.endswith(".py") and not all(part.isidentifier() for part in target.split(".")):
        fail(flag, spec, f"{target} is not a module name (letters, digits, _, dots); give a file: dir/file.py:{name}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn = runpy.run_path(target).get(name) if target.endswith(".py") else pkgutil.resolve_name(spec)
    except ImportError as e:
        fail(flag, spec, f"cannot import {target} ({e}); check the module name and that it is on the path")
    except AttributeError:
        fn = None
    if not callable(fn):
        fail(flag, spec, f"{target} has no function {name}; check the name after ':'")
    return fn


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


def load_policy(name: str, trust_remote_code: bool) -> tuple:
    """Tokenizer (left padding, a pad token) and causal LM: the built-in pair, or any Hugging Face id or folder."""
    if name == "builtin":
        tokenizer = build_tokenizer()
        return tokenizer, fp32_output_layer(build_tiny_model(tokenizer))
    tokenizer = load_pretrained(AutoTokenizer, name, "--model", trust_remote_code, padding_side="left")
    # fp32 weights whatever the checkpoint's dtype: in bf16, most of AdamW's small steps would round away
    policy = load_pretrained(AutoModelForCausalLM, name, "--model", trust_remote_code, dtype=torch.float32)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    policy.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer, fp32_output_layer(policy)


def fp32_output_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The output layer computes in fp32 under bf16 autocast too: bf16 logits of 10 are off by up to 0.03, and so the
    ratios and the KL (MiniMax-M1, arXiv:2506.13585). The one forward replaced: autocast has no per-layer dtype."""
    def forward(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return type(head).forward(head, hidden.float())

    head = model.get_output_embeddings()
    head.forward = functools.partial(forward, head)  # deepcopy(model) binds the copy's to the copied head
    return model


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


def check_update(hp) -> None:
    """The update's flags that ppo.py and rloo.py share, checked before anything loads."""
    if hp.temperature <= 0:
        fail("--temperature", hp.temperature, "must be > 0: the logits are divided by it (evaluation is greedy anyway)")
    for flag, value in (("--num-ppo-epochs", hp.num_ppo_epochs), ("--num-mini-batches", hp.num_mini_batches),
                        ("--gradient-accumulation-steps", hp.gradient_accumulation_steps)):
        if value < 1:
            fail(flag, value, "give at least 1")
    for flag, value in (("--max-grad-norm", hp.max_grad_norm), ("--sampler-correction-cap", hp.sampler_correction_cap)):
        if value is not None and value <= 0:  # a clip to 0 zeroes every gradient, a cap of 0 every policy loss
            fail(flag, value, "give a value > 0 (at 0 nothing would train)")


def model_context(model) -> int:
    """The most positions the model takes."""
    return getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None) or 10**9


def check_task(task: TaskArgs) -> bool:
    """Validate a task's flags before loading; True if its prompts are the built-in sums (no source given)."""
    has_prompts = bool(task.dataset or task.prompt_fn)
    if task.dataset and task.prompt_fn:
        fail("--prompt-fn", task.prompt_fn, "give one prompt source: --dataset or --prompt-fn, not both")
    if has_prompts and not (task.reward_fn or task.reward_model or task.prm_model):
        fail("--reward-fn", [], "these prompts need a reward: give --reward-fn and/or --reward-model")
    if task.reward_weights is not None and len(task.reward_weights) != len(task.reward_fn):
        fail("--reward-weights", task.reward_weights, f"give one weight per --reward-fn ({len(task.reward_fn)})")
    if task.eval_num_samples < 0:
        fail("--eval-num-samples", task.eval_num_samples, "give how many sampled completions per prompt (0: off)")
    if task.eval_num_samples and has_prompts and not task.answer_fn and os.environ.get("RANK", "0") == "0":
        print("note: no --answer-fn, so eval/maj@N is not logged (the vote needs each completion's answer)")
    return not has_prompts


def load_prompt_dataset(path: str, split: str, column: str) -> datasets.Dataset:
    """A hub dataset or a local json/jsonl/parquet/csv file or folder, with its prompt column renamed 'prompt'."""
    kinds, file = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}, os.path.isfile(path)
    if file and Path(path).suffix not in kinds:
        fail("--dataset", path, f"unknown file type; use one of {sorted(kinds)}")
    try:  # a file's builder by its suffix, or a hub id or folder
        ds = datasets.load_dataset(kinds[Path(path).suffix] if file else path, data_files=path if file else None,
                                   split=split)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:  # OSError: no such file, or offline
        fail("--dataset", path, f"cannot load split {split!r} ({str(e).splitlines()[0][:120]}); check the path, "
                                "the hub id and --dataset-split/--eval-split (a single file is the split 'train')")
    if column not in ds.column_names:
        fail("--prompt-column", column, f"the dataset has no such column; it has {ds.column_names}")
    return ds.rename_column(column, "prompt") if column != "prompt" else ds


def check_rows(rows: list, spec: str | None) -> list[dict]:
    """Rows from a prompt function: dicts with a 'prompt', all with the same keys (the others: reward fns' columns)."""
    for row in rows:
        if not isinstance(row, dict) or "prompt" not in row:
            fail("--prompt-fn", spec, f"returned {str(row)[:60]!r}; return a dict with a 'prompt' key (and any extra "
                                      "columns for the reward functions)")
        if row.keys() != rows[0].keys():
            fail("--prompt-fn", spec, f"returned rows with different keys ({sorted(rows[0])} and {sorted(row)}); "
                                      "return the same keys in every row (None where a column has no value)")
    return rows


def render_prompt(tokenizer, prompt: str | list) -> list[int]:
    """Token ids of a prompt: chat messages go through the tokenizer's chat template."""
    if isinstance(prompt, str):
        return tokenizer(prompt).input_ids
    if not tokenizer.chat_template:
        fail("--model", tokenizer.name_or_path, "the prompts are chat messages but the tokenizer has no chat template")
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True).input_ids  # no special tokens added


@dataclass
class Task:
    """A loaded task (load_task): its flags, prompt source and evaluation rows, its scorers and the answer function."""

    args: TaskArgs
    source: Callable | datasets.Dataset
    eval_rows: list[dict]
    reward_fns: list[tuple[str, Callable]] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    reward_model: Any = None
    rm_tokenizer: Any = None
    prm: Any = None
    prm_tokenizer: Any = None
    context: int = 10**9
    answer_fn: Callable | None = None


def load_task(task: TaskArgs, tokenizer, context: int, max_new_tokens: int, trust_remote_code: bool = False,
              world: int = 1) -> Task:
    """Prompt source, fixed evaluation rows and scorers of a task (checked by check_task), under --trust-remote-code."""
    if task.dataset:
        source = load_prompt_dataset(task.dataset, task.dataset_split, task.prompt_column)
        evals = load_prompt_dataset(task.dataset, task.eval_split, task.prompt_column) if task.eval_split else source
        eval_rows = [evals[i] for i in range(min(task.num_eval_prompts, len(evals)))]
        longest = max(len(render_prompt(tokenizer, p)) for p in source["prompt"])
        if longest + max_new_tokens > context:
            fail("--dataset", task.dataset, f"its longest prompt ({longest} tokens) plus --max-new-tokens exceeds the "
                 f"model's context of {context}; filter the prompts or lower --max-new-tokens")
    elif task.prompt_fn:
        source = load_callable(task.prompt_fn, "--prompt-fn")
        eval_rng = random.Random(0)  # the same evaluation prompts for every seed
        eval_rows = check_rows([source(eval_rng) for _ in range(task.num_eval_prompts)], task.prompt_fn)
    else:  # the built-in task's prompts, scored by the built-in reward or by yours
        source, eval_rows = addition_prompt, addition_eval_rows()
        scorers = [*task.reward_fn, *filter(None, [task.reward_model, task.prm_model])]
        if scorers and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            print(f"note: no --dataset or --prompt-fn, so {' '.join(scorers)} scores the built-in task's prompts: "
                  "single-digit sums like '3+4=', each row with its 'answer' for a reward function to read")
    if len(eval_rows) < world:
        fail("--num-eval-prompts", task.num_eval_prompts, f"give at least one per process ({world})")
    reward_fns = [(spec, load_callable(spec, "--reward-fn")) for spec in task.reward_fn]
    if not (task.reward_fn or task.reward_model or task.prm_model):
        reward_fns = [("builtin:addition_reward", functools.partial(addition_reward, tokenizer=tokenizer))]
    prm = prm_tokenizer = reward_model = rm_tokenizer = None
    if task.prm_model:
        prm_tokenizer = load_pretrained(AutoTokenizer, task.prm_model, "--prm-model", trust_remote_code)
        prm = load_pretrained(AutoModelForTokenClassification, task.prm_model, "--prm-model", trust_remote_code,
                              num_labels=2).eval().requires_grad_(False)
        if prm_tokenizer.unk_token_id in prm_tokenizer(task.prm_separator, add_special_tokens=False).input_ids:
            fail("--prm-separator", task.prm_separator, "the PRM's tokenizer cannot encode it; use its step separator")
    if task.reward_model:
        rm_tokenizer = load_pretrained(AutoTokenizer, task.reward_model, "--reward-model", trust_remote_code)
        reward_model = load_pretrained(AutoModelForSequenceClassification, task.reward_model, "--reward-model",
                                       trust_remote_code, num_labels=1).eval().requires_grad_(False)
        rm_tokenizer.pad_token = rm_tokenizer.pad_token or rm_tokenizer.eos_token
        reward_model.config.pad_token_id = rm_tokenizer.pad_token_id
    answer_fn = load_callable(task.answer_fn, "--answer-fn") if task.answer_fn else None
    answer_fn = answer_fn or (str.strip if source is addition_prompt else None)  # a sum's answer: its text
    return Task(task, source, eval_rows, reward_fns, task.reward_weights or [1.0] * len(reward_fns), reward_model,
                rm_tokenizer, prm, prm_tokenizer, context, answer_fn)


def draw_rows(task: Task, state: dict, n: int, seed: int) -> list[dict]:
    """The next n prompt rows (a dataset in a seeded order each epoch, or a prompt function); `state`: the place."""
    if callable(task.source):
        rng = random.Random()
        rng.setstate(state["rng"])
        rows = check_rows([task.source(rng) for _ in range(n)], task.args.prompt_fn)
        state["rng"] = rng.getstate()
        return rows
    rows = []
    while len(rows) < n:
        order = torch.randperm(len(task.source), generator=torch.Generator().manual_seed(seed + state["epoch"]))
        take = order[state["pos"]: state["pos"] + n - len(rows)].tolist()
        rows += [task.source[i] for i in take]
        state["pos"] += len(take)
        if state["pos"] >= len(task.source):
            state["epoch"], state["pos"] = state["epoch"] + 1, 0
    return rows


# ---- Generation and scoring: the decode loop around the model's own forward, reward calls, the rollout ---------------


def left_pad(seqs: list[list[int]], pad_token_id: int) -> torch.Tensor:
    """[B, L] left-padded ids."""
    return torch.nn.utils.rnn.pad_sequence([torch.tensor(s, dtype=torch.long) for s in seqs], batch_first=True,
                                           padding_value=pad_token_id, padding_side="left")


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding (absolute-position models such as GPT-2 need them)."""
    return (attention_mask.cumsum(1) - 1).clamp(min=0)


def packed_inputs(model, queries: torch.Tensor, query_mask: torch.Tensor, responses: torch.Tensor,
                  valid: torch.Tensor) -> tuple:
    """The forward's inputs for P prompts (queries, query_mask [P, Lq], left-padded) and their k = B / P responses each
    (responses, valid [B, T], right-padded), and index [B, T], the flat output position scoring each response token:
    pack_segments' rows if a sequence packed after another group and a sibling response gets the decoder output of its
    own forward where scored (checked once per model, agreed by all processes), else padded rows, prompts k times."""
    (P, Lq), (B, T), device = queries.shape, responses.shape, queries.device
    if not query_mask.any(1).all():  # a response's first token is scored at its prompt's last
        raise ValueError("a query has no tokens: the first token of its responses has no position to be scored at")
    checked = model.__dict__.setdefault("checks", {})  # "packs", "head": each check passed on every process
    if "packs" not in checked:
        seq = torch.cat([queries[query_mask.bool()], responses[valid]]).repeat(16)[None, :16]  # [1, 16]
        V, hidden = model.get_input_embeddings().num_embeddings, []
        last = {"logits_to_keep": 1} if model.get_output_embeddings() is not None else {}
        other = (seq + 1) % V  # differs at every position
        replies = torch.cat([other[:, 6:], other[:, 6:].flip(1), (seq[:, 6:] + 2) % V, seq[:, 6:]])  # [4, 10]: k = 2
        try:
            inputs, index = pack_segments(model, torch.cat([other[:, :6], seq[:, :6]]), torch.ones_like(
                replies[:2, :6]), replies, torch.ones_like(replies, dtype=torch.bool), width=52)  # one row
            with torch.no_grad(), torch.autocast(device.type, enabled=False), torch.compiler.set_stance(
                    "force_eager"), model.get_decoder().register_forward_hook(lambda m, a, out: hidden.append(out[0])):
                for x in (dict(input_ids=seq, use_cache=False), inputs):  # eager: no graph for a check made once
                    model(**x, **last)
            tol = max(1e-4, 2 * torch.finfo(hidden[0].dtype).eps)  # bf16 weights: a bf16 forward, 2 units of rounding
            fails = not torch.allclose(hidden[1].flatten(0, 1)[index[3]], hidden[0][0, 5:15], rtol=tol, atol=tol)
        except Exception:  # no 4D mask taken, or no dict of them (or no such config): such a model runs padded
            fails = True
        checked["packs"] = bool(global_sum(torch.tensor(float(fails), device=device)) == 0)
    if checked["packs"]:
        return pack_segments(model, queries, query_mask, responses, valid)
    mask = torch.cat([query_mask.repeat_interleave(B // P, 0), valid], 1).long()  # [B, Lq + T]
    index = torch.arange(B, device=device)[:, None] * (Lq + T) + Lq - 1 + torch.arange(T, device=device)  # [B, T]
    return dict(input_ids=torch.cat([queries.repeat_interleave(B // P, 0), responses], 1), attention_mask=mask,
                position_ids=position_ids_from(mask), use_cache=False), index


def pack_segments(model, queries: torch.Tensor, query_mask: torch.Tensor, responses: torch.Tensor,
                  valid: torch.Tensor, width: int | None = None) -> tuple:
    """packed_inputs' packed layout: a group's prompt (its real tokens) then its k responses are one segment. Position
    ids go on from the prompt's end; a 4D mask shows a token its segment's prompt and its response's earlier tokens
    (within a sliding window, per layer type). Segments fill rows longest first (first fit) of `width`, or of the
    width of least cost: a position's layers, then its attention over the row (docs/benchmarks.md)."""
    config = model.config.get_text_config()  # a multimodal model's language model's
    (P, Lq), (B, T), device, qm = queries.shape, responses.shape, queries.device, query_mask.bool()
    n_q, n_r, k = query_mask.sum(1), valid.sum(1), B // P  # [P], [B]: real tokens; k responses per prompt
    lengths, per_position = (n_q + n_r.view(P, k).sum(1)).tolist(), 3 * config.hidden_size  # [P] segments' tokens

    def first_fit(W: int) -> tuple:  # (cost, W, rows, each segment's first flat position)
        widths, base = [], [0] * P
        for p in sorted(range(P), key=lambda p: -lengths[p]):  # longest first
            r = next((r for r, w in enumerate(widths) if w + lengths[p] <= W), len(widths))
            widths += [0] * (r == len(widths))
            base[p], widths[r] = r * W + widths[r], widths[r] + lengths[p]
        return len(widths) * W * (per_position + W), W, len(widths), base

    widths = [width] if width else {max(lengths) * (8 + i) // 8 for i in range(17)}  # 1 to 3 times the longest
    _, W, rows, base = min(first_fit(w) for w in widths if w >= max(lengths))  # no segment spills over
    base, t = torch.tensor(base, device=device), torch.arange(max(Lq, T, B), device=device)  # base [P]
    q_pos = t[:Lq] - (Lq - n_q)[:, None]  # [P, Lq] the prompts' position ids (negative on padding)
    r_pos = n_q.repeat_interleave(k)[:, None] + t[:T]  # [B, T] the responses', going on from the prompt's end
    before = (n_r.view(P, k).cumsum(1) - n_r.view(P, k)).flatten()  # [B] the group's earlier responses' tokens
    r_flat = (base.repeat_interleave(k) + before)[:, None] + r_pos  # [B, T] each response token's flat position
    q, r = ((base[:, None] + q_pos)[qm],), (r_flat[valid],)
    at = lambda fill, x, y: torch.full((rows * W,), fill, device=device).index_put(q, x[qm]).index_put(r, y[valid])
    ids, positions = at(0, queries, responses), at(0, q_pos, r_pos)
    # each token's part: segment p's prompt p (k + 1), its response j p (k + 1) + 1 + j (= b + p + 1), padding -1
    part = at(-1, t[:P, None].expand(P, Lq) * (k + 1), (t[:B] + t[:B] // k + 1)[:, None].expand(B, T))
    part, positions = part.view(rows, W, 1), positions.view(rows, W, 1)  # queries along dim 1, keys along dim 2
    seen = (part // (k + 1) == part.mT // (k + 1)) & ((part.mT % (k + 1) == 0) | (part == part.mT))  # [R, W, W]
    mask = seen & torch.ones(W, W, dtype=torch.bool, device=device).tril()  # its segment's prompt, its own response
    window = getattr(config, "sliding_window", None)  # a key seen within it: query position - key position < window
    form = lambda m: (m if model.config._attn_implementation == "sdpa" else torch.zeros(m.shape, device=device)
                      .masked_fill(~m, torch.finfo(torch.float32).min))[:, None]  # eager attention adds it to scores
    full = form(mask)
    sliding = form(mask & (positions.mT > positions - window)) if window and window < W else full
    # models with one mask per layer type take a dict; other types than these (chunks, recurrences) fail the check
    masks = {"full_attention": full, "sliding_attention": sliding} if getattr(config, "layer_types", None) else sliding
    index = torch.cat([(base + n_q - 1).repeat_interleave(k)[:, None], r_flat[:, :-1]], 1)  # [B, T]
    return dict(input_ids=ids.view(rows, W), position_ids=positions.view(rows, W), attention_mask=masks,
                use_cache=False), index.clamp(max=rows * W - 1)


def response_hidden(model, queries, query_mask, responses: torch.Tensor, valid: torch.Tensor, chunk: int) -> tuple:
    """(h [N, H], the output layer), or (logits [N, V], Identity), where the N valid response tokens are scored."""
    inputs, index = packed_inputs(model, queries, query_mask, responses, valid)
    return forward_to_head(model, index[valid], chunk, **inputs)


def response_logprobs(policy, queries, query_mask, responses: torch.Tensor, valid: torch.Tensor, temperature: float,
                      support: tuple = (0, 1.0, 0.0), with_entropy: bool = False, entropy_grad: bool = False,
                      chunk: int = 0) -> tuple:
    """token_logprobs' logprobs and entropy [B, T] of k = B / P responses per prompt (0 on padding), one forward
    (packed_inputs) and the output layer only where a response token is scored, `chunk` logits at a time."""
    h, head = response_hidden(policy, queries, query_mask, responses, valid, chunk)
    return over_logits([head], [h], responses, lambda x, t: token_logprobs(x, t, temperature, support, with_entropy,
                                                                              entropy_grad), chunk, valid)


def forward_to_head(model, index: torch.Tensor, chunk: int, **inputs) -> tuple:
    """(h, head) at the flat output positions `index` [*] of the model's forward, head(h) their logits, a forward hook
    narrowing the decoder's output to them (no logits elsewhere). chunk > 0: h [*, H] that output, head the output
    layer; chunk 0, or logits not that layer on it (a soft-cap; checked once, said once): h [*, V] logits, Identity."""
    head, checked, hidden = model.get_output_embeddings(), model.__dict__.setdefault("checks", {}), []
    plain = chunk > 0 and head is not None and checked.get("head", True)

    def narrow(module, args, output):  # the decoder's output [R, W, H] -> [1, N, H], as the model's head will see it
        output.last_hidden_state = output[0].flatten(0, 1)[index.flatten()][None]
        hidden.append(output.last_hidden_state)

    with model.get_decoder().register_forward_hook(narrow):
        logits = model(**inputs, logits_to_keep=int(plain)).logits  # [1, 1] (all the model runs: FSDP gathers), [1, N]
    if plain and "head" not in checked and index.numel():
        with torch.no_grad():
            ok = getattr(model.config, "final_logit_softcapping", None) is None and \
                torch.allclose(head(hidden[0][:, -1:]).float(), logits.float(), rtol=1e-4, atol=1e-5)
            checked["head"] = bool(global_sum(torch.tensor(float(not ok), device=logits.device)) == 0)  # everywhere
        if not checked["head"]:
            print_once(f"{type(model).__name__}'s logits are not its output layer on its last hidden state: the "
                       "logprob passes make the scored positions' logits at once (--logits-chunk does not apply)")
            return forward_to_head(model, index, chunk, **inputs)
    h = hidden[0] if plain else logits  # [1, N, H] or [1, N, V]
    return h.reshape(*index.shape, h.shape[-1]), head if plain else torch.nn.Identity()


def over_logits(heads: list, hs: list, tokens: torch.Tensor, fn: Callable, chunk: int, mask=None) -> tuple:
    """fn(*logits, tokens [B, T]) -> [B, T] tensors (or None), logits = head(h [B, T, *]), ~`chunk` a model at a time
    (recomputed in backward; at once if chunk 0 or Identity); mask [B, T]: hs [N, *] at its N positions, 0 off them."""
    B, T = tokens.shape
    if mask is not None:  # the masked positions alone, [1, N], scattered back
        keep = mask.flatten().nonzero()[:, 0]
        outs = over_logits(heads, [h[None] for h in hs], tokens.flatten()[keep][None], fn, chunk)
        return tuple(None if x is None else x.new_zeros(B * T).index_put((keep,), x[0]).view(B, T) for x in outs)
    whole = chunk <= 0 or any(isinstance(head, torch.nn.Identity) for head in heads)
    rows = B * T if whole else max(1, chunk // heads[0].weight.shape[0])
    if rows >= B * T:  # one chunk holds every position: nothing to recompute, no [B, T, V] above the chunk
        return fn(*(head(h) for head, h in zip(heads, hs)), tokens)
    flat = [h.reshape(B * T, h.shape[-1]) for h in hs]  # [B * T, H] each
    outs = [checkpoint(lambda t, *x: fn(*(head(y) for head, y in zip(heads, x)), t), tokens.reshape(B * T)[i:i + rows],
                       *(x[i:i + rows] for x in flat), use_reentrant=False, preserve_rng_state=False)
            for i in range(0, B * T, rows)]
    return tuple(None if parts[0] is None else torch.cat(parts).view(B, T) for parts in zip(*outs))


def logprobs_on_support(models: list[tuple], tokens: torch.Tensor, temperature: float, support: tuple,
                        chunk: int, mask: torch.Tensor | None = None) -> tuple:
    """token_logprobs of tokens [B, T] under each of `models`, (h, head) at the same positions (forward_to_head), each
    on the support the first one's sampler keeps: the policy's, then the reference's (over_logits: side by side)."""
    return over_logits([head for _, head in models], [h for h, _ in models], tokens, lambda *x: tuple(  # logits, tokens
        token_logprobs(y, x[-1], temperature, support, support_of=x[0])[0] for y in x[:-1]), chunk, mask)


def generation_configs(gen: GenArgs, tokenizer, temperature: float, top_k: int = 0, top_p: float = 1.0,
                       min_p: float = 0.0) -> tuple[GenerationConfig, GenerationConfig]:
    """The rollouts' sampling and evaluation's greedy GenerationConfig, every filter set; one line, once (rank 0),
    names the settings that make the update off-policy (a repetition penalty, a minimum length)."""
    flags = [f"--{name.replace('_', '-')} {getattr(gen, name)}" for name, off in (("min_new_tokens", 0),
             ("repetition_penalty", 1.0)) if getattr(gen, name) != off]
    if flags and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        print_once(f"note: {', '.join(flags)} change what is sampled, but the update's logprobs do not see them: it "
                   "is off-policy, and its ratios do not correct for that")
    common = dict(max_new_tokens=gen.max_new_tokens, min_new_tokens=gen.min_new_tokens or None, typical_p=1.0,
                  epsilon_cutoff=0.0, eta_cutoff=0.0, no_repeat_ngram_size=0, encoder_repetition_penalty=1.0,
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                  compact_below=gen.compact_below)
    sample = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repetition_penalty=gen.repetition_penalty, **common)
    return sample, GenerationConfig(do_sample=False, repetition_penalty=1.0, **common)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float,
                  keep: torch.Tensor | None = None) -> torch.Tensor:
    """logits [..., V], -inf outside what `generate`'s top-k, top-p, then min-p warpers keep; keep [...] stays in."""
    if not (top_k or top_p < 1.0 or min_p):
        return logits
    kept = logits.reshape(-1, logits.shape[-1])  # [N, V]: the warpers take rows
    for warper, value, on in ((TopKLogitsWarper, top_k, top_k > 0), (TopPLogitsWarper, top_p, top_p < 1.0),
                              (MinPLogitsWarper, min_p, min_p > 0)):  # each off where `generate` leaves it out
        kept = warper(value)(None, kept) if on else kept
    drop = kept.isneginf().view(logits.shape)
    if keep is not None:
        drop.scatter_(-1, keep.unsqueeze(-1), False)
    return logits.masked_fill(drop, -float("inf"))


def next_token(logits: torch.Tensor, seen: torch.Tensor | None, gen: GenerationConfig, step: int,
               u: torch.Tensor | None = None) -> tuple:
    """The next tokens [B] from logits [B, V] as `generate` picks them (repetition penalty on `seen`, no EOS before
    min_new_tokens, greedy or sampled at u [B, 1], torch.rand's) and their logprobs [B] as drawn (0 when greedy)."""
    logits = logits.float()
    if gen.repetition_penalty not in (None, 1.0):
        score = logits.gather(1, seen)
        logits.scatter_(1, seen, torch.where(score < 0, score * gen.repetition_penalty, score / gen.repetition_penalty))
    if step < (gen.min_new_tokens or 0):
        logits[:, gen.eos_token_id] = -float("inf")
    if not gen.do_sample:
        return logits.argmax(-1), torch.zeros(logits.shape[0], device=logits.device)
    probs = filter_logits(logits / (gen.temperature or 1.0), gen.top_k or 0, gen.top_p or 1.0, gen.min_p or 0.0
                          ).softmax(-1)  # [B, V]
    cdf = probs.cumsum(-1)  # inverse-CDF sampling: the distribution of torch.multinomial, far cheaper
    u = torch.rand(cdf.shape[0], 1, device=cdf.device) if u is None else u
    token = torch.searchsorted(cdf, (1 - u) * cdf[:, -1:])[:, 0]  # 1 - u in (0, 1]: never a token of p = 0
    return token, probs.gather(1, token[:, None])[:, 0].log()


def static_cache(model, batch_size: int, length: int) -> StaticCache:
    """The static cache of batch_size rows and length tokens, one per shape and dtype, kept (a CUDA graph each)."""
    device = model.device.type
    key = (batch_size, length, torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device))
    caches = model.__dict__.setdefault("decode_caches", {})
    if key not in caches:
        caches[key] = StaticCache(config=model.config, max_cache_len=length)  # allocated at its first use
    caches[key].reset()
    return caches[key]


@functools.cache
def decode_step(mode: str | None = None) -> Callable:
    """step(model, ids, position_ids [B, t], attention_mask, cache): the model's logits [B, V] at each row's last token,
    filling the cache; with a mode, compiled once per process: one whole graph for every batch size and cache length
    (dynamic: fixed shapes met dynamo's recompile limit, 8, within a run); "reduce-overhead": a CUDA graph a shape."""
    def step(model, ids, position_ids, attention_mask, cache) -> torch.Tensor:
        return model(input_ids=ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache,
                     use_cache=True, logits_to_keep=1).logits[:, -1]

    return step if mode is None else torch.compile(step, fullgraph=True, dynamic=True, mode=mode)


@torch.no_grad()
def decode_loop(model, queries: torch.Tensor, attention_mask: torch.Tensor, gen: GenerationConfig,
                stop: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Responses [B, T] to left-padded queries [B, Lq] sampled as `generate` does, each token's logprob [B, T] as drawn
    (0 after its row ended), the rows stepped: the prompts' forward fills the cache, then a token a step until EOS or
    stop(new_ids [B, t]) in every process's rows; below gen.compact_below live, finished rows leave the batch."""
    (B, Lq), T, compiled = queries.shape, gen.max_new_tokens, gen.compile_config is not None
    power = 1 << max(4, (Lq + T - 1).bit_length())  # a static cache holds prompt and response: a power of 2 or 3/4 of
    C = power * 3 // 4 if power * 3 // 4 >= Lq + T else power  # one, so a few lengths and <= 1.5x the tokens
    cache = static_cache(model, B, C) if compiled else DynamicCache(config=model.config)
    # a sliding-window layer's static cache counts tokens in a Python int, frozen in a compiled step: eager then
    if compiled and any(type(layer) is not StaticLayer for layer in cache.layers):
        print_once(f"--compile: {type(model).__name__} keeps a sliding window (or another cache than a plain static "
                   "one) in some layer, which the compiled decode step cannot take: it decodes eagerly")
        compiled, cache = False, DynamicCache(config=model.config)
    mask = torch.nn.functional.pad(attention_mask, (0, C - Lq), value=1)  # [B, C]: 0 on left padding only
    step = decode_step(gen.compile_config.mode if compiled else None)
    with torch.compiler.set_stance("force_eager"):  # compiled, the cache's first fill is unfit for CUDA graphs
        logits = step(model, queries, position_ids_from(attention_mask), mask[:, :C if compiled else Lq], cache)
    ids = torch.nn.functional.pad(queries, (0, T), value=gen.pad_token_id)  # [B, Lq + T]: prompts, then responses
    position = attention_mask.sum(1, keepdim=True)  # [B, 1]: each row's first new position
    done = torch.zeros(B, dtype=torch.bool, device=queries.device)
    logprobs = torch.zeros(B, T, device=queries.device)  # [B, T]: the sampler's logprob of each token
    rows, stepped = slice(None), B  # the batch's rows (all, or those left), and rows stepped in all
    penalty = gen.repetition_penalty not in (None, 1.0)  # on the tokens seen, left padding not (generate's way)
    for t in range(T):
        u = torch.rand(B, 1, device=queries.device)[rows] if gen.do_sample else None  # B drawn: as if no row left
        seen = ids[rows, :Lq + t].where(mask[rows, :Lq + t].bool(), ids[rows, Lq - 1:Lq]) if penalty else None
        token, logprob = next_token(logits, seen, gen, t, u)  # [b], [b]
        token = token.masked_fill(done[rows], gen.pad_token_id)
        ids[rows, Lq + t], logprobs[rows, t] = token, logprob.masked_fill(done[rows], 0.0)
        done[rows] |= token == gen.eos_token_id
        if stop is not None:
            done[rows] |= stop(ids[rows, Lq:Lq + t + 1])
        if t == T - 1 or global_sum((~done).sum()) == 0:  # all processes step on until all are done (FSDP: each
            break  # forward gathers the weights from every process)
        n, live = len(token), int((~done[rows]).sum())
        size = -(-n // 2) if compiled else max(live, 1)  # compiled: to half (a graph a size); one row stays (FSDP)
        if live < (getattr(gen, "compact_below", 0) or 0) * n and live <= size < n and (not compiled or 4 * size >= B):
            keep = torch.argsort(done[rows].int(), stable=True)[:size]  # the live rows first
            if compiled:  # copied, every slot, into a static cache of `size` rows (allocated at the first copy)
                small = static_cache(model, size, C)
                for old, new in zip(cache.layers, small.layers):
                    new.update(old.keys[keep], old.values[keep])
                    new.cumulative_length.copy_(old.cumulative_length)
                cache = small
            else:  # a growing cache selects them
                cache.batch_select_indices(keep)
            rows, token = torch.arange(B, device=queries.device)[rows][keep], token[keep]
        logits = step(model, token[:, None], position[rows] + t, mask[rows, :C if compiled else Lq + t + 1], cache)
        stepped += len(token)
    return ids[:, Lq:Lq + t + 1], logprobs[:, :t + 1], stepped


def stop_check(tokenizer, stop_strings: list[str]) -> Callable:
    """stop(new_ids [B, t]) -> [B] bool: a stop string shows in the decoded last (longest stop string + 1) tokens."""
    width = 1 + max(len(s.encode()) for s in stop_strings)
    return lambda new_ids: torch.tensor([any(s in text for s in stop_strings) for text in
                                         tokenizer.batch_decode(new_ids[:, -width:])], device=new_ids.device)


def check_scores_vary(scores: torch.Tensor, spreads: list, builtin_model: bool, rank: int, first: int = 3) -> None:
    """The spread of each of the first iterations' rewards (scores and process rewards): of the batch [B] over all
    processes (ppo.py), or the largest within a group [P, k] (rloo.py); where none varied, one line says so (rank 0):
    every advantage is 0, nothing is learnt (a reward that cannot fire; in groups, one that reads the prompt alone)."""
    if len(spreads) < first:
        x = average_metrics({"r/max": scores.max().item(), "r/min": scores.min().item(),  # over processes
                             "r/spread/max": (scores.amax(-1) - scores.amin(-1)).max().item()}, scores.device)
        spreads.append(x["r/max"] - x["r/min"] if scores.dim() == 1 else x["r/spread/max"])
        if len(spreads) == first and max(spreads) == 0 and rank == 0:
            same = f"all {x['r/max']:g}" if x["r/max"] == x["r/min"] else "equal within each group"
            tqdm.write(f"warning: the rewards of {first} iterations never varied (the last's {same}): nothing to learn "
                       "from; check that the reward can score what the model writes" + (" (the built-in model writes "
                       "digits and +-*= only)" if builtin_model else ""))


@functools.cache
def print_once(message: str) -> None:
    """Print a message the first time it comes in this process (functools.cache remembers it)."""
    print(message, flush=True)


@torch.no_grad()
def generate(policy, tokenizer, queries: torch.Tensor, gen: GenerationConfig, stop_strings: list[str]) -> tuple:
    """Responses to left-padded queries: cut_responses' triple, the sampler's logprobs [B, T] and the rows stepped, by
    decode_loop; a model whose forward takes no cache object by `generate` (said once; no logprobs)."""
    attention_mask = ((queries != tokenizer.pad_token_id).cumsum(1) > 0).long()  # left padding only
    Lq, stop = queries.shape[1], stop_check(tokenizer, stop_strings) if stop_strings else None
    base = policy.get_base_model() if isinstance(policy, peft.PeftModel) else policy  # inside peft's wrapper
    if "cache" in inspect.signature(type(base).forward).parameters:  # a forward that takes a cache (transformers')
        out, logprobs, stepped = decode_loop(policy, queries, attention_mask, gen, stop)
    else:
        print_once(f"generation through model.generate: {type(policy).__name__}'s forward takes no cache object, so "
                   "the sampler's logprobs are unknown: no sampling/* metrics, no --sampler-correction-cap")
        criteria = StoppingCriteriaList([lambda ids, scores, **kw: stop(ids[:, Lq:])]) if stop else None
        out = policy.generate(input_ids=queries, attention_mask=attention_mask, generation_config=gen,
                              stopping_criteria=criteria, synced_gpus=torch.distributed.is_initialized())[:, Lq:]
        logprobs, stepped = None, out.numel()
    return *cut_responses(tokenizer, out.cpu(), stop_strings), None if logprobs is None else logprobs.cpu(), stepped


def cut_responses(tokenizer, responses: torch.Tensor, stop_strings: list[str]) -> tuple:
    """Responses cut after their first EOS or stop string (bisected), padded: responses [B, T], lengths, ended [B]."""
    rows, lengths, ended = responses.tolist(), [], []
    holds_stop = lambda ids: any(s in tokenizer.decode(ids) for s in stop_strings)
    for row in rows:
        done = tokenizer.eos_token_id in row
        n = row.index(tokenizer.eos_token_id) + 1 if done else len(row)
        if stop_strings and holds_stop(row[:n]):
            n, done = bisect.bisect_left(range(n + 1), True, lo=1, key=lambda k: holds_stop(row[:k])), True
        row[n:] = [tokenizer.pad_token_id] * (len(row) - n)
        lengths.append(n)
        ended.append(done)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(lengths), torch.tensor(ended)


def call_reward_fns(reward_fns: list, weights: list[float], prompts: list, completions: list,
                    completion_ids: list, columns: dict, reward_model: bool = False) -> torch.Tensor:
    """Weighted sum [B] of TRL-style reward functions, each giving a finite number (numpy's, 0-d tensors too) or None
    (skipped, as in TRL) per completion; bad output, or a completion none scores (without a reward model), stops."""
    total, scored = torch.zeros(len(completions)), torch.zeros(len(completions), dtype=torch.bool)
    for (spec, fn), w in zip(reward_fns, weights):
        try:
            out = list(fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns))
        except Exception as e:  # any error in user code becomes one line
            fail("--reward-fn", spec, f"the function raised {type(e).__name__}: {e}; fix the function (called as "
                 "fn(prompts=, completions=, completion_ids=, **columns), -> a float each: take **kwargs)")
        if len(out) != len(completions):
            fail("--reward-fn", spec, f"returned {len(out)} scores for {len(completions)} completions; return one "
                                      "float per completion")
        out = [v.item() if getattr(v, "ndim", None) == 0 else v for v in out]  # numpy scalars, 0-d tensors
        for i, v in enumerate(out):
            if v is not None and not (isinstance(v, numbers.Real) and math.isfinite(v)):
                fail("--reward-fn", spec, f"returned {v!r} for completion {i}; return a finite number for each (or "
                                          "None where the function does not apply)")
        total += w * torch.tensor([0.0 if v is None else float(v) for v in out])
        scored |= torch.tensor([v is not None for v in out])
    if reward_fns and not reward_model and not scored.all():
        i = int((~scored).nonzero()[0])
        fail("--reward-fn", [spec for spec, _ in reward_fns], f"every function returned None for completion {i} "
             f"({str(completions[i])[:40]!r}); each completion needs a score from one function at least (or give "
             "a --reward-model)")
    return total


@torch.no_grad()
def reward_model_scores(reward_model, rm_tokenizer, prompts: list, texts: list[str]) -> torch.Tensor:
    """Scores [B] by a one-label sequence classifier: prompt + text, or chat messages through its chat template."""
    chat = not isinstance(prompts[0], str)
    if chat and not rm_tokenizer.chat_template:
        fail("--reward-model", rm_tokenizer.name_or_path, "the prompts are chat messages but its tokenizer has no "
                                                          "chat template; give it one, or string prompts")
    seqs = [rm_tokenizer.apply_chat_template([*p, {"role": "assistant", "content": t}], tokenize=False) if chat
            else p + t for p, t in zip(prompts, texts)]
    enc = rm_tokenizer(seqs, add_special_tokens=not chat, return_tensors="pt", padding=True, padding_side="right")
    return reward_model(**enc.to(reward_model.device)).logits[:, 0].float().cpu()


@torch.no_grad()
def process_rewards(prm, prm_tokenizer, tokenizer, prompts: list, completion_ids: list[list[int]],
                    separator: str) -> list[list[tuple[int, float]]]:
    """Per response, one (token index, p) per step: split at the separator, the PRM reads [BOS] prompt step sep step
    sep ... as in training, p is its P(step correct) at the step's last token, the index the token ending its text."""
    inputs, places = [], []
    sep_ids = prm_tokenizer(separator, add_special_tokens=False).input_ids
    bos = [prm_tokenizer.bos_token_id] if prm_tokenizer.bos_token_id is not None else []
    for prompt, ids in zip(prompts, completion_ids):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        ends = [len(tokenizer.decode(ids[:j + 1], skip_special_tokens=True)) for j in range(len(ids))]  # chars
        prompt_text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        seq = bos + prm_tokenizer(prompt_text, add_special_tokens=False).input_ids
        place, end = [], 0  # (the PRM's position, the response's token) of each step
        for step in text.split(separator):
            end = min(end + len(step) + len(separator), len(text))
            if step.strip():
                seq += prm_tokenizer(step, add_special_tokens=False).input_ids + sep_ids
                place.append((len(seq) - 1, next((j for j, e in enumerate(ends) if e >= end), len(ids) - 1)))
        inputs.append(seq)
        places.append(place)
    width = max(map(len, inputs))
    ids = torch.tensor([s + [prm_tokenizer.pad_token_id or 0] * (width - len(s)) for s in inputs], device=prm.device)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in inputs], device=prm.device)
    p_correct = prm(input_ids=ids, attention_mask=mask).logits.float().softmax(-1)[..., 1].cpu()  # [B, L]
    return [[(j, p_correct[b, i].item()) for i, j in place] for b, place in enumerate(places)]


def rollout(policy, tokenizer, rows: list[dict], gen: GenerationConfig, stop_strings: list[str], task: Task) -> dict:
    """Generate responses to prompt rows and score them: queries, responses, masks (1 on response tokens), sampler
    logprobs or None, scores, ended, prompts, texts, a PRM's step scores or None, and decode_live_frac."""
    prompts = [r["prompt"] for r in rows]
    ids = [render_prompt(tokenizer, p) for p in prompts]
    if not min(map(len, ids)):
        fail("--prompt-fn" if task.args.prompt_fn else "--dataset", prompts[[len(i) for i in ids].index(0)],
             "this prompt has no tokens (the tokenizer adds none to an empty text); give every prompt some text")
    if max(map(len, ids)) + gen.max_new_tokens > task.context:
        fail("--max-new-tokens", gen.max_new_tokens, f"a prompt of {max(map(len, ids))} tokens plus the new tokens "
             f"exceeds the model's context of {task.context}; shorten the prompts or lower --max-new-tokens")
    queries = left_pad(ids, tokenizer.pad_token_id)
    device = next(policy.parameters()).device
    responses, lengths, ended, logprobs, stepped = generate(policy, tokenizer, queries.to(device), gen, stop_strings)
    completion_ids = [row[:n] for row, n in zip(responses.tolist(), lengths.tolist())]
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    completions = texts if isinstance(prompts[0], str) else [[{"role": "assistant", "content": t}] for t in texts]
    scores = call_reward_fns(task.reward_fns, task.weights, prompts, completions, completion_ids,
                             {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}, task.reward_model is not None)
    if task.reward_model is not None:
        scores += task.args.reward_model_weight * reward_model_scores(task.reward_model, task.rm_tokenizer, prompts,
                                                                         texts)
    if task.args.missing_eos_penalty is not None:
        scores[~ended] -= task.args.missing_eos_penalty
    process = None if task.prm is None else process_rewards(
        task.prm, task.prm_tokenizer, tokenizer, prompts, completion_ids, task.args.prm_separator)
    masks = (torch.arange(responses.shape[1])[None] < lengths[:, None]).long()
    return {"queries": queries, "responses": responses, "masks": masks, "sampler_logprobs": logprobs,
            "scores": scores, "ended": ended, "prompts": prompts, "texts": texts, "process": process,
            "decode_live_frac": lengths.sum().item() / stepped}


def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k of n samples, c right (Chen et al. 2021, arXiv:2107.03374), unbiased: 1 - C(n - c, k) / C(n, k)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_right(answers: list, right: list[bool]) -> bool:
    """maj@N of one prompt: the answer most samples give (None does not vote; a tie goes to the first seen) is right
    when a sample that gives it is scored right (reaches --success-threshold); no answer at all is wrong."""
    given = [a for a in answers if a is not None]
    return bool(given) and any(r for a, r in zip(answers, right) if a == max(given, key=given.count))


def evaluate(policy, tokenizer, task: Task, sample: GenerationConfig, greedy: GenerationConfig,
             stop_strings: list[str], rank: int, world: int) -> tuple[dict, list]:
    """Greedy decoding of the evaluation rows (split over processes): eval/scores, task/accuracy (reaching
    --success-threshold), the completions in order; with --eval-num-samples N, N samples a row (a fork of torch's
    random stream) kept as its `samples`: eval/pass@k (k = 1, 2, 4, ... <= N), with an answer function eval/maj@N."""
    rows, n, threshold = task.eval_rows[rank::world], task.args.eval_num_samples, task.args.success_threshold
    device = next(policy.parameters()).device
    out = rollout(policy, tokenizer, rows, greedy, stop_strings, task)
    scores = out["scores"]  # [B]
    samples = [dict(prompt=p, completion=t, score=s) for p, t, s in zip(out["prompts"], out["texts"], scores.tolist())]
    ks, vote = [2 ** i for i in range(n.bit_length())], n > 0 and task.answer_fn is not None  # k = 1, 2, 4, ... <= N
    hits = torch.zeros(len(ks) + vote, dtype=torch.float64)  # summed over this process's rows: pass@k, maj@N
    if n:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            draws = [rollout(policy, tokenizer, rows, sample, stop_strings, task) for _ in range(n)]
        for i, s in enumerate(samples):
            texts, got = [d["texts"][i] for d in draws], [d["scores"][i].item() for d in draws]
            answers = [task.answer_fn(t) for t in texts] if vote else [None] * n
            s["samples"] = [{"completion": t, "score": x, "answer": a} for t, x, a in zip(texts, got, answers)]
            right = [x >= threshold for x in got]
            majority = [majority_right(answers, right)] if vote else []
            hits += torch.tensor([pass_at_k(n, sum(right), k) for k in ks] + majority, dtype=torch.float64)
    total = global_sum(torch.tensor([len(scores), scores.sum(), (scores >= threshold).sum(), *hits],
                                    dtype=torch.float64, device=device)).tolist()
    if world > 1:
        parts = [None] * world
        torch.distributed.all_gather_object(parts, samples)
        samples = [parts[j % world][j // world] for j in range(sum(map(len, parts)))]  # row j: rank j % world's
    names = ["eval/scores", "task/accuracy", *[f"eval/pass@{k}" for k in ks], *[f"eval/maj@{n}"] * vote]
    return {name: value / total[0] for name, value in zip(names, total[1:], strict=True)}, samples


# ---- Processes: autocast, data parallelism and FSDP2, dropout --------------------------------------------------------


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


def reference(policy, ref_policy) -> tuple:
    """The reference and the context it runs in: ref_policy under no_grad, or (None) the policy with adapters off."""
    if ref_policy is not None and ref_policy is not policy:
        return ref_policy, torch.no_grad()
    if not isinstance(policy, peft.PeftModel):
        raise ValueError("ref_policy None (or the policy) means the policy with its LoRA adapters off, and this policy "
                         "has none: pass a frozen copy of it as ref_policy")
    return policy, policy.disable_adapter()


def place(models: list, device: torch.device, fsdp: bool, world: int) -> None:
    """Move each model (None: absent) to the device with dropout off; under --fsdp, shard it over the processes with
    FSDP2: each decoder layer, then the rest (with LoRA: inside peft's wrapper)."""
    if fsdp and not torch.distributed.is_initialized():
        fail("--fsdp", True, "FSDP shards over processes: launch with torchrun --nproc_per_node N")
    for model in filter(None, models):
        disable_dropout(model.to(device))
        if fsdp:  # the layers: _no_split_modules, private, but device_map's list of layer classes
            layers, mesh = set(getattr(model, "_no_split_modules", None) or []), init_device_mesh(device.type, (world,))
            for module in model.modules():
                if type(module).__name__ in layers:
                    fully_shard(module, mesh=mesh)
            fully_shard(model.get_base_model() if isinstance(model, peft.PeftModel) else model, mesh=mesh)


def compile_models(enabled: bool, models: list, configs: list[GenerationConfig], device: torch.device) -> None:
    """--compile: the models' forwards and decode_loop's one-token step compiled, shapes dynamic (GPU: CUDA graphs)."""
    if not enabled:
        return
    for model in filter(None, models):
        model.forward = torch.compile(model.forward, dynamic=True)
    for config in configs:
        mode = "reduce-overhead" if device.type == "cuda" else "default"
        config.compile_config = CompileConfig(fullgraph=True, dynamic=True, mode=mode)


def full_state_dict(model: torch.nn.Module) -> dict:
    """All of a model's weights, whole, on the CPU of rank 0 (a collective under FSDP: every process calls it)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_state(optimizer) -> dict:
    """The optimizer's state dict with FSDP-sharded tensors gathered whole (a collective under FSDP)."""
    state = optimizer.state_dict()
    state["state"] = {i: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in s.items()}
                      for i, s in state["state"].items()}
    return state


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


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Every dropout probability to 0, in layers and in float `*dropout*` attributes (Llama's attention_dropout)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for name, value in list(vars(m).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(m, name, 0.0)
    return model


def refuse_dropout(**models: torch.nn.Module) -> None:
    """ValueError naming a model that would apply dropout in training mode (the rollout's and update's would differ)."""
    for name, model in models.items():
        if model is None:  # ref_policy None: the policy itself, with its LoRA adapters off
            continue
        active = [n or type(m).__name__ for n, m in model.named_modules() if m.training and (
            isinstance(m, torch.nn.Dropout) and m.p > 0
            or any("dropout" in k and isinstance(v, float) and v > 0 for k, v in vars(m).items()))]
        if active:
            raise ValueError(f"{name} applies dropout in training mode (in {', '.join(active[:3])}): call "
                             f"disable_dropout({name}) from ppo.py or rloo.py, or {name}.eval(), before the step")


def sampler_metrics(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> dict:
    """The sampler's logprobs [B, T] against the trainer's old ones on mask [B, T], as TRL logs them."""
    diff = (old_logprobs - sampler_logprobs)[mask] if mask.any() else torch.zeros(1, device=mask.device)  # [N]
    ratio = diff.exp()
    return {**{f"sampling/sampling_logp_difference/{f}": getattr(diff.abs(), f)().item() for f in ("mean", "max")},
            **{f"sampling/importance_sampling_ratio/{f}": getattr(ratio, f)().item() for f in ("min", "mean", "max")}}


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


def log_row(path: Path | None, run, row: dict, samples: list | None = None) -> None:
    """A row to metrics.jsonl, an evaluation's completions to samples.jsonl (3 printed), both to wandb. Rank 0 only."""
    if path is None:
        return
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    if samples:
        with (path.parent / "samples.jsonl").open("a") as f:
            f.writelines(json.dumps({"iteration": row["iteration"], **s}, default=str) + "\n" for s in samples)
        tqdm.write(f"iteration {row['iteration']}: {len(samples)} evaluation completions in samples.jsonl, first 3:")
        for s in samples[:3]:
            prompt = s["prompt"] if isinstance(s["prompt"], str) else s["prompt"][-1]["content"]  # chat: last message
            tqdm.write(f"  score {s['score']:+.3f} | {prompt!r} -> {s['completion']!r}")
    if run is not None:
        import wandb
        if samples:
            table = [[str(s["prompt"]), s["completion"], s["score"]] for s in samples[:16]]
            run.log({"samples": wandb.Table(columns=["prompt", "completion", "score"], data=table)}, commit=False)
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


def plan_run(args) -> tuple[int, Path, str, Path | None]:
    """Iterations, run folder, run name, and the checkpoint that --resume names (None for a new run)."""
    num_iterations = args.total_episodes // args.batch_size
    if num_iterations < 1:
        fail("--total-episodes", args.total_episodes, f"must be at least --batch-size ({args.batch_size})")
    if args.resume and args.resume != "latest" and args.output_dir is None:
        args.output_dir = str(Path(args.resume).parent.parent)
    stamp = int(time.time())  # a default folder of a run started in the same second: the next free second's name
    while args.output_dir is None and Path(f"runs/{args.exp_name}__{args.seed}__{stamp}").exists():
        stamp += 1
    run_name = f"{args.exp_name}__{args.seed}__{stamp}"
    output_dir = Path(args.output_dir or f"runs/{run_name}")
    return num_iterations, output_dir, run_name, find_checkpoint(args.resume, output_dir)


def resume_state(ckpt: Path | None, optimizer, seed: int, rank: int, run_name: str) -> tuple[dict, int]:
    """The loop's progress, its first iteration, and this process's random state: seeded per rank, or a checkpoint's."""
    random.seed(seed + rank)
    torch.manual_seed(seed + rank)
    if ckpt is None:
        return {"iteration": 0, "episode": 0, "elapsed": 0.0, "accuracy": None, "run_name": run_name,
                "prompt_state": {"epoch": 0, "pos": 0, "rng": random.Random(seed).getstate()}}, 1
    state = load_state(ckpt)
    load_optimizer_state(optimizer, state.pop("optimizer"))
    rngs = state.pop("rng")
    rng_states(rngs[rank % len(rngs)])
    return state, state["iteration"] + 1


def save_state(folder: Path, models: dict, tokenizer, optimizer, state: dict, keep: int, rank: int, world: int) -> None:
    """A checkpoint: models, optimizer, every process's random states, the loop's `state` (all call; rank 0 writes)."""
    rngs = [rng_states()] * world
    if world > 1:
        torch.distributed.all_gather_object(rngs, rng_states())
    full = {**state, "optimizer": optimizer_state(optimizer), "rng": rngs}
    weights = {name: full_state_dict(model) for name, model in models.items()}
    if rank == 0:
        save_checkpoint(folder, models, weights, tokenizer, full, keep)


def finish_run(policy, tokenizer, output_dir: Path, metrics_path: Path | None, run, rank: int) -> None:
    """Save the final model (save_model) and say where, close wandb, and leave the process group when all are done."""
    save_model(policy, tokenizer, output_dir / "model", output_dir / "adapter", rank)
    if rank == 0:
        final = json.loads(metrics_path.read_text().splitlines()[-1])
        print(f"final task/accuracy {final.get('task/accuracy')} eval/scores {final.get('eval/scores')} after "
              f"{final['episode']} episodes in {final['elapsed_s']:.0f}s; model in {output_dir / 'model'}")
    if run is not None:
        run.finish()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # no process tears the group down while another still uses it (saving)
        torch.distributed.destroy_process_group()


def save_model(model, tokenizer, folder: Path, adapter_folder: Path, rank: int) -> None:
    """Save a model whole with the tokenizer (gathered; rank 0 writes); with LoRA, first its adapters (and heads)."""
    if isinstance(model, peft.PeftModel):
        weights = full_state_dict(model)
        if rank == 0:
            model.save_pretrained(adapter_folder, state_dict=weights)
        model = model.merge_and_unload()
    weights = full_state_dict(model)
    if rank == 0:
        model.save_pretrained(folder, state_dict=weights)
        tokenizer.save_pretrained(folder)


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


def load_state(folder: Path) -> dict:
    """A checkpoint's state.pt by torch.load(weights_only=True): plain data, else the run stops (no code run)."""
    try:
        return torch.load(folder / "state.pt", weights_only=True)
    except pickle.UnpicklingError as e:
        found = str(e).partition("GLOBAL ")[2].split(" ")[0] or "an object"
        fail("--resume", str(folder), f"its state.pt holds {found}, not only tensors, numbers, strings, lists and "
             "dicts, and loading it could run code: refused; resume from a checkpoint that this script wrote")


def named_config(name: str) -> Args:
    """The Args of RECIPES[name]: its flags, and its name as --exp-name."""
    return tyro.cli(Args, args=[*shlex.split(RECIPES[name][1]), "--exp-name", name])


def parse_args(cls, recipes: dict, argv: list[str], description: str) -> Any:
    """The command line's config of cls: a named configuration (recipes: name -> (what it is, its config or its maker;
    the first the default)) wherever it stands, the other flags over it; --help lists them; a misspelt one: one line."""
    config = lambda name: recipes[name][1]() if callable(recipes[name][1]) else recipes[name][1]  # made when named
    description += "".join(f"\n  {name}: {text}" for name, (text, _) in recipes.items())
    default = config(next(iter(recipes))) if recipes else tyro.MISSING_NONPROP

    def left_over(words: list[str]) -> list[str] | None:  # the words no flag takes, --help aside (None: no parse)
        try:
            return tyro.cli(cls, args=[w for w in words if w not in ("-h", "--help")], default=default,
                            return_unknown_args=True, console_outputs=False)[1]
        except SystemExit:
            return None

    left = left_over(argv)
    if recipes and left and not any(w.startswith("-") for w in left):  # (a misspelt flag: tyro's own message)
        if len(left) > 1 or left[0] not in recipes:
            word = next((w for w in left if w not in recipes), left[-1])
            close = [] if word in recipes else difflib.get_close_matches(word.lower(), recipes, n=1 + 2 * (
                word.lower() not in recipes), cutoff=0.6)
            fail("the named configuration", word, f"{'did you mean ' + ' or '.join(close) + '? ' if close else ''}"
                 f"name one of {', '.join(recipes)}, before or after the flags")
        default = config(left[0])
        spots = [i for i, w in enumerate(argv) if w == left[0]]  # the one that no flag takes as its value
        argv = next((argv[:i] + argv[i + 1:] for i in spots if left_over(argv[:i] + argv[i + 1:]) == []), argv)
    for i, word in enumerate(argv if left == [] else []):  # no name given, but a list flag took one as an item
        if word in recipes and left_over(argv[:i] + argv[i + 1:]) == []:  # (--reward-fn f.py:g grpo): not guessed
            fail("the named configuration", word, f"{next(w for w in argv[i::-1] if w.startswith('-'))} took it as "
                 "one of its items; name the configuration before the flags")
    return tyro.cli(cls, args=argv, default=default, description=description)


if __name__ == "__main__":
    configs = {name: (text, functools.partial(named_config, name)) for name, (text, _) in RECIPES.items()}
    main(parse_args(Args, configs, sys.argv[1:], f"{Args.__doc__}\n\nMost runs set --model, --dataset or --prompt-fn, "
                    f"--reward-fn or --reward-model, --total-episodes (iterations = episodes / --batch-size: "
                    f"{10 * Args.batch_size} are 10) and --output-dir." + "\n\nNamed configurations (NAME [flags], the "
                    "flags over it):" * bool(RECIPES)))
    if "LOCAL_RANK" in os.environ:  # under torchrun: all is saved and the group torn down; skip interpreter
        sys.stdout.flush()          # teardown, where gloo's leftover threads can abort the process (SIGABRT)
        sys.stderr.flush()
        os._exit(0)
