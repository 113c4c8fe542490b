"""TRL's side of benchmarks/vs_trl.py. Runs inside the TRL virtual environment (TRL 1.12.0 is never a dependency of
this project): trains TRL's PPOTrainer, RLOOTrainer or PRMTrainer on the shared artifacts with the benchmark's
settings and prints one JSON line: per-iteration seconds, peak resident memory and, for the PRM, non-pad tokens.

    benchmarks/.trl-venv/bin/python benchmarks/trl_side.py ppo|rloo|prm ITERATIONS ARTIFACTS [--bf16] [--lora-r R]
        [--gradient-checkpointing | --no-gradient-checkpointing]

Activation checkpointing is left at TRL's default unless a flag says otherwise. TRL 1.12's configs default it on, and
RLOOTrainer and PRMTrainer (through transformers' Trainer) then checkpoint; PPOTrainer's own loop never turns it on.

--lora-r R gives TRL a peft_config (LoRA rank R, alpha 2R, dropout 0, every linear layer), as our --lora-r does:
TRL then uses the policy with its adapters off as the reference. TRL's PPOTrainer puts peft_config on the policy
only and would train the value model whole; here the value model gets the same adapters (peft's in-place injection,
its head trained whole), so that both sides train the same parameters.
    benchmarks/.trl-venv/bin/python benchmarks/trl_side.py rloo-learn EPISODES MODEL_FOLDER SEED
    benchmarks/.trl-venv/bin/python benchmarks/trl_side.py grpo-real EPISODES MODEL_FOLDER TASK_FOLDER OUT EVAL_EVERY

grpo-real is benchmarks/real_model.py --vs-trl's TRL side: TRL's GRPOTrainer on that benchmark's task folder (train
and test splits, reward.py) with `rloo.py grpo`'s settings, evaluated by ppo.py's own `evaluate` (greedy, the 200
held-out sums) before training and every EVAL_EVERY steps, writing OUT/metrics.jsonl rows as our scripts write them.

    benchmarks/.trl116-venv/bin/python benchmarks/trl_side.py grpo-gym EPISODES MODEL_FOLDER TASK_FOLDER OUT N_EVERY N \
        [--save-every S]

grpo-gym is the same for docs/custom.md's reasoning-gym run: a folder written by examples/reasoning_gym.py, its reward
`score`, up to 256 new tokens, N held-out rows evaluated every N_EVERY steps, a step's 32 completions in micro-batches
of 8 (at 32, TRL's logits over 49,152 tokens went past this machine's 24 GiB and the process was killed). With
--save-every S, TRL writes a checkpoint into OUT/trl every S steps, and the same command run again goes on from it.

    benchmarks/.trl116-venv/bin/python benchmarks/trl_side.py grpo-lengths EPISODES MODEL_FOLDER TASK_FOLDER OUT N
    benchmarks/.trl-venv/bin/python benchmarks/trl_side.py ppo-lengths EPISODES MODEL_FOLDER TASK_FOLDER OUT N

grpo-lengths (TRL 1.16's GRPOTrainer) and ppo-lengths (TRL 1.12's PPOTrainer, scoring with OUT/../reward-model) are
real_model.py --real-lengths' TRL sides: replies of up to 128 tokens, 32 a step, each step's seconds split into its
parts in OUT/splits.jsonl, in the keys of real_model.py's PROFILE (N is not used).

    benchmarks/.trl116-venv/bin/python benchmarks/trl_side.py grpo-losses FOLDER

grpo-losses is tests/test_grpo_losses.py's TRL 1.16 side: GRPOTrainer's own loss on the test's batch (grpo_losses).
"""

import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    TrainerCallback,
)


class Timer(TrainerCallback):
    """Seconds between optimizer updates (TRL calls on_step_end once per update)."""

    def __init__(self):
        self.stamps = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append(time.perf_counter())


def common(out: str, iterations: int, bf16: bool) -> dict:
    return dict(output_dir=out, report_to=[], logging_steps=10**6, save_strategy="no", bf16=bf16, use_cpu=True,
                seed=1, dataloader_num_workers=0, disable_tqdm=True, **checkpointing())


def checkpointing() -> dict:
    """gradient_checkpointing as the flags say, or nothing (TRL's default)."""
    if "--gradient-checkpointing" in sys.argv:
        return {"gradient_checkpointing": True}
    if "--no-gradient-checkpointing" in sys.argv:
        return {"gradient_checkpointing": False}
    return {}


def lora_config(task_type: str):
    """Our --lora-r's adapters as a peft LoraConfig (None without --lora-r)."""
    if "--lora-r" not in sys.argv:
        return None
    from peft import LoraConfig

    r = int(sys.argv[sys.argv.index("--lora-r") + 1])
    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear", task_type=task_type)


def learn(episodes: int, folder: Path, seed: int) -> None:
    """TRL's RLOOTrainer on the built-in addition task, with ppo.py's prompts, reward function and evaluation set
    (imported from ppo.py, so the two sides cannot drift apart); prints greedy accuracy on the 100 fixed sums."""
    import functools
    import random

    from trl import RLOOConfig, RLOOTrainer

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import ppo

    tokenizer = AutoTokenizer.from_pretrained(folder)
    rng = random.Random(seed)
    ds = Dataset.from_list([ppo.addition_prompt(rng) for _ in range(episodes // 4)])
    reward = functools.partial(ppo.addition_reward, tokenizer=tokenizer)
    reward.__name__ = "addition_reward"
    config = RLOOConfig(output_dir=f"/tmp/trl_learn_{seed}", report_to=[], logging_steps=10**6, save_strategy="no",
                        use_cpu=True, seed=seed, dataloader_num_workers=0, disable_tqdm=True,
                        per_device_train_batch_size=256, num_generations=4, max_completion_length=4,
                        temperature=1.0, top_k=0, learning_rate=1e-3, lr_scheduler_type="linear", adam_epsilon=1e-5,
                        weight_decay=0.0, max_grad_norm=1.0, beta=0.05, num_iterations=1, num_train_epochs=1)
    trainer = RLOOTrainer(model=str(folder), reward_funcs=reward, args=config, train_dataset=ds,
                          processing_class=tokenizer)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    model, rows = trainer.model.eval(), ppo.addition_eval_rows()
    tokenizer.padding_side = "left"
    batch = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=4, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)[:, batch["input_ids"].shape[1]:]
    ids = [[t for t in row.tolist() if t != tokenizer.pad_token_id] for row in out]
    ids = [row[:row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row for row in ids]
    scores = ppo.addition_reward(None, tokenizer.batch_decode(ids, skip_special_tokens=True), ids,
                                 [r["answer"] for r in rows], tokenizer)
    print(json.dumps({"accuracy": sum(s == 1.0 for s in scores) / len(rows), "seconds": seconds}))


def grpo_config(out: Path, episodes: int, completion_tokens: int, micro: int = 32, save_every: int = 0):
    """GRPOConfig with rloo.py grpo's settings (grpo_real's docstring lists them) for `episodes` completions, 32 a step
    in micro-batches of `micro` (gradients accumulated: the same update, in less memory); a checkpoint in OUT/trl every
    `save_every` steps, the newest kept (0: none)."""
    from trl import GRPOConfig

    saving = dict(save_strategy="steps", save_steps=save_every, save_total_limit=1) if save_every else dict(
        save_strategy="no")
    return GRPOConfig(output_dir=str(out / "trl"), report_to=[], logging_steps=10**6, use_cpu=True, **saving,
                      seed=1, dataloader_num_workers=0, disable_tqdm=True, bf16=False, gradient_checkpointing=False,
                      per_device_train_batch_size=micro, gradient_accumulation_steps=32 // micro, num_generations=4,
                      max_completion_length=completion_tokens, temperature=1.0, top_p=1.0, learning_rate=2e-5,
                      lr_scheduler_type="linear", adam_epsilon=1e-5,
                      weight_decay=0.0, max_grad_norm=1.0, beta=0.04, use_bias_correction_kl=False, loss_type="grpo",
                      scale_rewards="group", num_iterations=1, max_steps=episodes // 32)


def grpo_real(episodes: int, model: Path, data: Path, out: Path, eval_every: int, reward_spec: str = "",
              completion_tokens: int = 16, num_eval: int = 200) -> None:
    """TRL's GRPOTrainer with rloo.py grpo's settings on real_model.py's task: 32 completions a step as 8 prompts x 4,
    16 new tokens, temperature 1, lr 2e-5 decaying linearly, AdamW (eps 1e-5, no weight decay, as ours), beta 0.04
    with k3 in the loss (use_bias_correction_kl off: TRL 1.12's default multiplies the k3 term by the importance
    ratio, whose gradient makes it rloo.py's --kl-estimator k2), group std scaling, loss_type grpo, one update per
    generation, fp32, no checkpointing. One metrics row per step (iteration, episode, elapsed_s: seconds since
    training began, evaluations included, as ours); evaluations add eval/scores and task/accuracy from ppo.py's
    evaluate on the model being trained. grpo-gym passes reasoning-gym's reward (examples/reasoning_gym.py:score, its
    task's `entry` column reaching it as TRL passes a dataset's columns), 256 new tokens and the test split's rows."""
    from trl import GRPOTrainer

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import ppo

    tokenizer = AutoTokenizer.from_pretrained(model)
    spec = reward_spec or f"{data / 'reward.py'}:score"
    reward = ppo.load_callable(spec, "--reward-fn")
    task_args = ppo.TaskArgs(dataset=str(data), dataset_split="train", eval_split="test", num_eval_prompts=num_eval,
                             reward_fn=[spec])
    eval_tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    eval_tokenizer.pad_token = eval_tokenizer.pad_token or eval_tokenizer.eos_token
    task = ppo.load_task(task_args, eval_tokenizer, 10**9, completion_tokens)
    greedy = ppo.generation_configs(ppo.GenArgs(max_new_tokens=completion_tokens), eval_tokenizer, 1.0)[1]
    out.mkdir(parents=True, exist_ok=True)
    save_every = int(sys.argv[sys.argv.index("--save-every") + 1]) if "--save-every" in sys.argv else 0
    states = (out / "trl").glob("checkpoint-*/trainer_state.json") if save_every else []  # a checkpoint's last file
    whole = sorted((int(p.parent.name.split("-")[1]), p.parent) for p in states)
    resume = str(whole[-1][1]) if whole else None  # on from TRL's newest whole checkpoint

    class Evaluate(TrainerCallback):
        """A metrics row per step; ppo.py's greedy evaluation at step 0, every eval_every steps and at the end; resumed,
        the rows up to the checkpoint's step kept (swapped in whole) and elapsed_s going on from there."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            rows = (out / "metrics.jsonl").read_text().splitlines() if resume else []
            kept = [r for r in rows if r.endswith("}") and json.loads(r)["iteration"] <= state.global_step]
            (out / "metrics.tmp").write_text("".join(r + "\n" for r in kept))
            os.replace(out / "metrics.tmp", out / "metrics.jsonl")
            self.log = (out / "metrics.jsonl").open("a")
            if not kept:
                self.row(0, model, state.max_steps)
            self.start = time.perf_counter() - (json.loads(kept[-1])["elapsed_s"] if kept else 0.0)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.row(state.global_step, model, state.max_steps)

        def row(self, step: int, model, max_steps: int) -> None:
            row = {"iteration": step, "episode": 32 * step,
                   "elapsed_s": round(time.perf_counter() - self.start, 3) if step else 0.0}
            if step % eval_every == 0 or step == max_steps:
                model.eval()
                with torch.no_grad():
                    metrics, _ = ppo.evaluate(model, eval_tokenizer, task, greedy, greedy, [], 0, 1)
                model.train()
                row.update(metrics)
            self.log.write(json.dumps(row) + "\n")
            self.log.flush()

    ds = Dataset.from_json(str(data / "train.jsonl"))
    config = grpo_config(out, episodes, completion_tokens, 32 if completion_tokens <= 16 else 8, save_every)
    trainer = GRPOTrainer(model=str(model), reward_funcs=reward, args=config, train_dataset=ds,
                          processing_class=tokenizer, callbacks=[evaluate := Evaluate()])
    ref = trainer.ref_model.dtype if trainer.ref_model is not None else None
    print(f"TRL GRPOTrainer: policy {trainer.model.dtype}, reference {ref}, {config.max_steps} steps"
          + f" (from {resume})" * bool(resume), flush=True)
    trainer.train(resume_from_checkpoint=resume)
    evaluate.log.close()
    print(f"rows in {out / 'metrics.jsonl'}")


class Splits(TrainerCallback):
    """real_model.py --real-lengths' parts of each TRL step, in PROFILE's keys, one JSON row per step (and a row 0):
    forwards of the trained models timed by grad mode, their real and computed positions (attention masks), backward
    passes, optimizer steps; `timed` wraps what generates and what scores."""

    def __init__(self, out: Path, models: list):
        self.now, self.file, self.clock = {}, (out / "splits.jsonl").open("w"), time.perf_counter()
        self.file.write(json.dumps({"iteration": 0}) + "\n")
        for model in filter(None, models):
            model.register_forward_pre_hook(self.pre, with_kwargs=True)
            model.register_forward_hook(self.post, with_kwargs=True)
        backward = torch.Tensor.backward
        torch.Tensor.backward = lambda tensor, *a, **kw: self.timed("backward", backward)(tensor, *a, **kw)
        register_optimizer_step_pre_hook(lambda *a: self.now.update(started=time.perf_counter()))
        register_optimizer_step_post_hook(
            lambda *a: self.add("optimizer", time.perf_counter() - self.now.pop("started")))

    def add(self, key: str, value: float) -> None:
        self.now[key] = self.now.get(key, 0.0) + value

    def timed(self, part: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(part, time.perf_counter() - start)
        return wrapper

    def generated(self, lengths: list[int], width: int) -> None:
        self.add("responses", len(lengths))
        self.add("generated_tokens", sum(lengths))
        self.add("decode_row_steps", len(lengths) * width)  # transformers' generate steps every row to the longest

    def pre(self, module, args, kwargs):
        module.started = time.perf_counter()
        mask, ids = kwargs.get("attention_mask"), kwargs.get("input_ids")
        if mask is not None and ids is not None and not getattr(self, "generating", False):
            self.add("real_positions", mask[:, -ids.shape[1]:].sum().item())
            self.add("computed_positions", ids.numel())

    def post(self, module, args, kwargs, output):
        if not getattr(self, "generating", False):
            key = "grad_forward" if torch.is_grad_enabled() else "nograd_forward"
            self.add(key, time.perf_counter() - module.started)

    def on_step_end(self, args, state, control, **kwargs):
        self.now["iteration_s"], self.clock = time.perf_counter() - self.clock, time.perf_counter()
        self.file.write(json.dumps({"iteration": state.global_step, **self.now}) + "\n")
        self.file.flush()
        self.now = {}


def grpo_lengths(episodes: int, model: Path, data: Path, out: Path) -> None:
    """TRL's GRPOTrainer (the newest release, 1.16) with rloo.py grpo's settings at replies of up to 128 tokens: 32
    completions a step as 8 prompts x 4, temperature 1, lr 2e-5, beta 0.04 with k3 in the loss, group std scaling,
    loss_type grpo, fp32, no checkpointing; each step's parts in OUT/splits.jsonl."""
    from trl import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import ppo

    reward = ppo.load_callable(f"{data / 'reward.py'}:score", "--reward-fn")
    out.mkdir(parents=True, exist_ok=True)
    config = grpo_config(out, episodes, 128)
    trainer = GRPOTrainer(model=str(model), reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_json(str(data / "train.jsonl")), processing_class=tokenizer)
    splits = Splits(out, [trainer.model, trainer.ref_model])
    trainer.add_callback(splits)
    generate = trainer._generate  # private: the one place that generates, whose output the benchmark counts

    def generating(prompts):
        splits.generating = True
        try:
            return splits.timed("generation", generate)(prompts)
        finally:
            splits.generating = False

    def scoring(inputs, prompts, completions, completion_ids_list):
        lengths = [len(ids) for ids in completion_ids_list]
        splits.generated(lengths, max(lengths))
        return splits.timed("scoring", calculate)(inputs, prompts, completions, completion_ids_list)

    calculate, trainer._generate, trainer._calculate_rewards = trainer._calculate_rewards, generating, scoring
    trainer.train()


def ppo_lengths(episodes: int, model: Path, data: Path, out: Path) -> None:
    """TRL 1.12's PPOTrainer (the last with one) at replies of up to 128 tokens: 32 a step, one PPO epoch of one
    mini-batch, temperature 1, lr 2e-5, kl_coef 0.05, fp32, scored by OUT/../reward-model (SmolLM2 under a fresh
    one-label head), the value model a copy of it, as ppo.py --reward-model; each step's parts in OUT/splits.jsonl."""
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as module

    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    chats = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    ds = Dataset.from_dict({"input_ids": tokenizer(chats[:episodes], add_special_tokens=False).input_ids})
    reward_folder = out.parent / "reward-model"
    out.mkdir(parents=True, exist_ok=True)
    config = PPOConfig(output_dir=str(out / "trl"), report_to=[], logging_steps=10**6, save_strategy="no",
                       use_cpu=True, seed=1, dataloader_num_workers=0, disable_tqdm=True, bf16=False,
                       per_device_train_batch_size=32, gradient_accumulation_steps=1, num_mini_batches=1,
                       num_ppo_epochs=1, local_rollout_forward_batch_size=32, response_length=128, temperature=1.0,
                       total_episodes=episodes, learning_rate=2e-5, kl_coef=0.05, missing_eos_penalty=None,
                       stop_token="eos", num_sample_generations=0)
    policy = AutoModelForCausalLM.from_pretrained(model)
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_folder)
    value_model = AutoModelForSequenceClassification.from_pretrained(reward_folder)
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy,
                         ref_model=AutoModelForCausalLM.from_pretrained(model), reward_model=reward_model,
                         value_model=value_model, train_dataset=ds)
    backbone = getattr(value_model, value_model.base_model_prefix)  # what TRL calls for values (get_reward, training)
    splits = Splits(out, [trainer.model.policy, trainer.ref_model, backbone])
    trainer.add_callback(splits)
    batch_generation, get_reward = module.batch_generation, module.get_reward

    def generating(model, queries, *args):
        splits.generating = True
        try:
            query_responses, logits = splits.timed("generation", batch_generation)(model, queries, *args)
        finally:
            splits.generating = False
        responses = query_responses[:, queries.shape[1]:]
        ended = responses == tokenizer.eos_token_id
        lengths = torch.where(ended.any(1), ended.int().argmax(1) + 1, responses.shape[1])
        splits.generated(lengths.tolist(), responses.shape[1])
        return query_responses, logits

    def scoring(scorer, *args):  # the reward model's scores; the value model's values are a no-grad pass
        return (splits.timed("scoring", get_reward) if scorer is reward_model else get_reward)(scorer, *args)

    module.batch_generation, module.get_reward = generating, scoring
    trainer.train()


def grpo_losses(folder: Path) -> None:
    """TRL 1.16 GRPOTrainer's own `_compute_loss` on the batch of folder/batch.pt (prompts, completions, their mask,
    advantages, the sampler's logprobs), for each case of folder/cases.json: a GRPOConfig's loss settings, trained
    with SGD at lr 1 over mini-batches of prompts in the given order, the old logprobs those of the model before, the
    reference's of folder/ref. Writes each case's parameter change to folder/<case>.pt. num_items_in_batch is each
    mini-batch's token count times steps_per_generation: TRL's token sums then divide by the mini-batch's own count."""
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import add_fused_lm_head

    batch, cases = torch.load(folder / "batch.pt"), json.loads((folder / "cases.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([torch.ones_like(batch["prompt_ids"]), batch["completion_mask"].long()], 1)
    T, K, minis = batch["completion_ids"].shape[1], cases.pop("num_generations"), cases.pop("order")
    for name, config in cases.items():
        model = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32)
        ref = AutoModelForCausalLM.from_pretrained(folder / "ref", dtype=torch.float32)
        add_fused_lm_head(ref, temperature=1.0)  # as GRPOTrainer makes its own reference
        args = GRPOConfig(output_dir=str(folder / "trl"), report_to=[], use_cpu=True, bf16=False, num_generations=K,
                          per_device_train_batch_size=len(ids) // len(minis), steps_per_generation=len(minis),
                          max_completion_length=T, use_bias_correction_kl=False, **config)
        trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                              train_dataset=Dataset.from_dict({"prompt": ["1+1="] * K}), processing_class=tokenizer)
        trainer.current_gradient_accumulation_steps = 1
        model, before = trainer.model.train(), torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        with torch.no_grad():
            old = trainer._get_per_token_logps_and_entropies(model, ids, attention, T)[0]
            ref_logps = trainer._get_per_token_logps_and_entropies(ref, ids, attention, T)[0]
        for prompts in minis:
            rows = torch.tensor([p * K + j for p in prompts for j in range(K)])
            mask = batch["completion_mask"][rows]
            prompt_ids = batch["prompt_ids"][rows]
            inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
                      "completion_ids": batch["completion_ids"][rows], "completion_mask": mask,
                      "advantages": batch["advantages"][rows], "old_per_token_logps": old[rows],
                      "ref_per_token_logps": ref_logps[rows], "sampling_per_token_logps": batch["sampler"][rows],
                      "num_items_in_batch": mask.sum() * len(minis)}
            model.zero_grad()
            trainer._compute_loss(model, inputs).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(p.grad)
        torch.save(torch.cat([p.detach().flatten() for p in model.parameters()]) - before, folder / f"{name}.pt")


def main() -> None:
    if sys.argv[1] == "grpo-losses":
        return grpo_losses(Path(sys.argv[2]))
    if sys.argv[1] in ("grpo-lengths", "ppo-lengths"):
        side = grpo_lengths if sys.argv[1] == "grpo-lengths" else ppo_lengths
        return side(int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
    if sys.argv[1] == "grpo-real":
        return grpo_real(int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]), int(sys.argv[6]))
    if sys.argv[1] == "grpo-gym":
        return grpo_real(int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]), int(sys.argv[6]),
                         "examples/reasoning_gym.py:score", 256, int(sys.argv[7]))
    if sys.argv[1] == "rloo-learn":
        return learn(int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
    algo, iterations, art = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    bf16 = "--bf16" in sys.argv
    out = f"/tmp/trl_{algo}"
    timer = Timer()
    tokenizer = AutoTokenizer.from_pretrained(art / "policy")
    tokenizer.padding_side = "left"
    prompts = [json.loads(line)["prompt"] for line in (art / "prompts.jsonl").read_text().splitlines()]
    extra = {}
    if algo == "ppo":
        from trl.experimental.ppo import PPOConfig, PPOTrainer

        ds = Dataset.from_dict({"input_ids": [tokenizer(p).input_ids for p in prompts]})
        config = PPOConfig(**common(out, iterations, bf16), per_device_train_batch_size=32,
                           gradient_accumulation_steps=1, num_mini_batches=1, num_ppo_epochs=4,
                           local_rollout_forward_batch_size=32, response_length=32, temperature=1.0,
                           total_episodes=32 * iterations, learning_rate=3e-6,
                           kl_coef=0.05, missing_eos_penalty=None, stop_token=None, num_sample_generations=0)
        value_model = AutoModelForSequenceClassification.from_pretrained(art / "reward")
        peft_config = lora_config("CAUSAL_LM")
        if peft_config is not None:
            from peft import get_peft_model

            value_model = get_peft_model(value_model, lora_config("SEQ_CLS")).base_model.model  # adapters in place
        trainer = PPOTrainer(args=config, processing_class=tokenizer,
                             model=AutoModelForCausalLM.from_pretrained(art / "policy"),
                             ref_model=None if peft_config else AutoModelForCausalLM.from_pretrained(art / "policy"),
                             reward_model=AutoModelForSequenceClassification.from_pretrained(art / "reward"),
                             value_model=value_model, train_dataset=ds, callbacks=[timer], peft_config=peft_config)
    elif algo == "rloo":
        from trl import RLOOConfig, RLOOTrainer

        ds = Dataset.from_dict({"prompt": prompts * 4})
        config = RLOOConfig(**common(out, iterations, bf16), per_device_train_batch_size=32, num_generations=4,
                            gradient_accumulation_steps=1, max_completion_length=32, temperature=1.0, top_k=0,
                            learning_rate=3e-6, beta=0.05, num_iterations=1, max_steps=iterations,
                            generation_kwargs={"min_new_tokens": 32})
        trainer = RLOOTrainer(model=str(art / "policy"), reward_funcs=str(art / "reward"), args=config,
                              train_dataset=ds, processing_class=tokenizer, callbacks=[timer],
                              peft_config=lora_config("CAUSAL_LM"))
    else:
        from trl.experimental.prm import PRMConfig, PRMTrainer

        rows = [json.loads(line) for line in (art / "prm.jsonl").read_text().splitlines()]
        ds = Dataset.from_list(rows)
        tokenizer.padding_side = "right"
        config = PRMConfig(**common(out, iterations, bf16), per_device_train_batch_size=16, max_length=256,
                           max_steps=iterations, learning_rate=1e-5, step_separator="\n")
        model = AutoModelForTokenClassification.from_pretrained(art / "policy", num_labels=2)
        trainer = PRMTrainer(model=model, args=config, processing_class=tokenizer, train_dataset=ds,
                             callbacks=[timer])
        # the rows TRL trains on, in its own order: count their non-pad tokens
        extra["tokens"] = [len(x) for x in trainer.train_dataset["input_ids"]]
    gc.collect()
    trainer.train()
    times = [b - a for a, b in zip(timer.stamps, timer.stamps[1:])]
    # VmHWM: this process image's peak resident set. (getrusage's ru_maxrss also keeps the peak of the process
    # before exec, here the benchmark's parent with its models loaded, copied by fork.)
    peak = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmHWM:")) / 1024
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    print(json.dumps({"times": times, "peak_rss_mb": peak, "torch_threads": torch.get_num_threads(),
                      "trained_parameters": trained, **extra}))


if __name__ == "__main__":
    main()
