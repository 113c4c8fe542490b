"""Peak memory at a real vocabulary: ppo.py and rloo.py's `grpo` recipe against TRL 1.12.0's PPOTrainer and
GRPOTrainer on the same work, with the logits made chunk by chunk (--logits-chunk, the default) and whole
(--logits-chunk 0, the former path), without and with activation checkpointing.

Models: (a) SmolLM2-135M-Instruct (vocabulary 49,152), the folder benchmarks/real_model.py builds, 32 responses of
exactly 16 new tokens to its two-digit sums; (b) a Qwen2.5-0.5B-shaped model built from config (hidden 896, 24
layers, vocabulary 151,936; random weights and gpu_check.py's 8,192-token tokenizer), 16 responses of exactly 128
new tokens to prompts of 32 tokens. PPO: 4 epochs of 1 mini-batch, forward chunks of 32, a reward model and a value
model of the policy's shape (the policy's weights under a fresh one-label head). GRPO: groups of 4, one epoch, k3
KL at 0.04 in the loss, rewards from gpu_check.length_reward on both sides. Everything fp32 on the CPU.

Each run is its own process for 2 iterations: s/iter is the second's (the first holds the warm-up), peak memory
the process's peak resident set (VmHWM), which includes some 0.5 GB of Python, torch and transformers. The floor is
the bytes of the weights, gradients and AdamW moments of what trains (16 per parameter) plus the weights of the
frozen models (4 per parameter): each peak reads as floor + activations and the logits. TRL runs inside its own
virtual environment (benchmarks/.trl-venv, made by vs_trl.py), never the project's.

    python benchmarks/memory.py                          # every row (about 1.5 hours on 2 CPU cores)
    python benchmarks/memory.py --models smollm2 --algos grpo --checkpointing off
    python benchmarks/memory.py --breakdown              # what one training forward saves, per model (minutes)

A row whose floor alone is over 80% of the machine's memory is not run and says so (PPO at the Qwen shape: 18.8 GB
of floor on a 24 GB machine).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
CACHE = ROOT / "benchmarks" / ".cache" / "memory"
ENV = {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
SIZES = {"smollm2": (32, 16), "qwen0.5b-shape": (16, 128)}  # responses per iteration, new tokens per response
PEAK = ("import atexit, runpy, sys; atexit.register(lambda: print('PEAK_MIB', next(int(l.split()[1]) for l in "
        "open('/proc/self/status') if l.startswith('VmHWM:')) / 1024, flush=True)); sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')")


def folders(model: str) -> Path:
    """The model's folder with policy/, reward/ (policy + a fresh one-label head) and prompts.jsonl, made once."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    art = CACHE / model
    if (art / "prompts.jsonl").exists():
        return art
    art.mkdir(parents=True, exist_ok=True)
    if model == "smollm2":
        import real_model

        policy = real_model.make_model_folder(ROOT / "benchmarks" / ".cache" / "real_model" / "SmolLM2-135M-Instruct")
        train = real_model.write_task(art / "data") / "train.jsonl"
        rows = [json.loads(line) for line in train.read_text().splitlines()]
        (art / "policy").symlink_to(policy)
        prompts = [r["prompt"] for r in rows[:256]]
    else:
        import gpu_check

        size = gpu_check.Size(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151_936,
                              tokenizer_vocab=8192, corpus_lines=20_000, batch=16, prompt_len=32, new_tokens=128,
                              repeats=1, timeout_s=0)
        gpu_check.build(art / "policy", size)
        prompts = [json.loads(line)["prompt"] for line in (art / "policy" / "prompts.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(art / "policy")
    torch.manual_seed(0)
    reward = AutoModelForSequenceClassification.from_pretrained(art / "policy", num_labels=1)
    reward.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    reward.save_pretrained(art / "reward")
    tokenizer.save_pretrained(art / "reward")
    with (art / "prompts.jsonl").open("w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    return art


def floor_mb(art: Path, algo: str) -> dict:
    """Bytes (MB) of what must be resident: trained weights x 16 (weight, gradient, two AdamW moments), frozen x 4."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with __import__("torch").device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(art / "policy"))
                .parameters())  # tied embeddings counted once
    trained, frozen = (2 * n, 2 * n) if algo == "ppo" else (n, n)  # ppo: policy + value; ref + reward
    return {"params_m": n / 1e6, "floor_mb": (16 * trained + 4 * frozen) / 2**20}


def saved_mb(art: Path, model: str) -> dict:
    """What autograd keeps for one training forward of the whole batch (PPO's fused first epoch does this): MB of the
    distinct tensors saved for the backward pass by the policy's logprob pass (chunked and whole logits) and by the
    value model's pass, on prompts as long as the runs' longest."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    import ppo

    B, T = SIZES[model]
    tokenizer = AutoTokenizer.from_pretrained(art / "policy")
    prompts = [json.loads(line)["prompt"] for line in (art / "prompts.jsonl").read_text().splitlines()]
    Lq = max(len(ppo.render_prompt(tokenizer, p)) for p in prompts[:B])
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (B, Lq + T))
    queries, query_mask, responses = ids[:, :Lq], torch.ones_like(ids[:, :Lq]), ids[:, Lq:]
    valid = torch.ones_like(responses, dtype=torch.bool)
    policy = ppo.fp32_output_layer(AutoModelForCausalLM.from_pretrained(art / "policy"))
    value = AutoModelForTokenClassification.from_pretrained(art / "policy", num_labels=1)

    def saved(fn) -> float:
        seen = {}

        def pack(x):
            seen[(x.untyped_storage().data_ptr(), x.dtype)] = x.untyped_storage().nbytes()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            fn()
        return sum(seen.values()) / 2**20

    return {f"saved_policy_{name}_mb": saved(lambda c=chunk: ppo.response_logprobs(
        policy, queries, query_mask, responses, valid, 1.0, with_entropy=True, chunk=c)[0].sum())
        for name, chunk in (("chunked", 2**24), ("whole", 0))} | {
        "saved_value_mb": saved(lambda: ppo.response_values(value, queries, query_mask, responses, valid).sum())}


def ours(art: Path, model: str, algo: str, chunk: int, ckpt: bool) -> dict:
    B, T = SIZES[model]
    out = Path(tempfile.mkdtemp(prefix=f"mem_{algo}_"))
    common = ["--model", art / "policy", "--dataset", art / "prompts.jsonl", "--batch-size", B, "--max-new-tokens", T,
              "--min-new-tokens", T, "--temperature", "1.0", "--total-episodes", 2 * B, "--eval-every", "100000",
              "--num-eval-prompts", "1", "--learning-rate", "1e-6", "--logits-chunk", chunk, "--output-dir", out,
              "--forward-batch-size", "32", *(["--gradient-checkpointing"] if ckpt else [])]
    if algo == "ppo":
        args = ["ppo.py", *common, "--reward-model", art / "reward", "--num-mini-batches", "1", "--num-ppo-epochs", "4"]
    else:
        args = ["rloo.py", "grpo", *common, "--reward-fn", f"{ROOT / 'benchmarks' / 'gpu_check.py'}:length_reward",
                "--rloo-k", "4"]
    import vs_trl

    text = vs_trl.run([sys.executable, "-c", PEAK, *map(str, args)], env=ENV)
    rows = [row for line in (out / "metrics.jsonl").read_text().splitlines() if "lr" in (row := json.loads(line))]
    return {"s_iter": rows[-1]["elapsed_s"] - rows[-2]["elapsed_s"], "peak_mb": float(text.split("PEAK_MIB")[-1])}


def theirs(art: Path, model: str, algo: str, ckpt: bool) -> dict:
    import vs_trl

    cmd = [vs_trl.trl_python(), __file__, "--trl-side", algo, str(art), model, *(["--ckpt"] if ckpt else [])]
    text = vs_trl.run(cmd, env=ENV)
    return json.loads(text.strip().splitlines()[-1])


def trl_side(algo: str, art: Path, model: str, ckpt: bool) -> None:
    """Inside TRL's venv: 2 iterations of TRL's trainer; prints s/iter (the second update) and VmHWM."""
    import gpu_check
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    import ppo

    B, T = SIZES[model]
    stamps = [time.perf_counter()]

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    tokenizer = AutoTokenizer.from_pretrained(art / "policy")
    tokenizer.padding_side = "left"
    prompts = [json.loads(line)["prompt"] for line in (art / "prompts.jsonl").read_text().splitlines()]
    common = dict(output_dir=tempfile.mkdtemp(), report_to=[], logging_steps=10**6, save_strategy="no", use_cpu=True,
                  seed=1, dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=ckpt,
                  learning_rate=1e-6, per_device_train_batch_size=B, gradient_accumulation_steps=1)
    if algo == "ppo":
        from trl.experimental.ppo import PPOConfig, PPOTrainer

        ds = Dataset.from_dict({"input_ids": [ppo.render_prompt(tokenizer, p) for p in prompts]})
        config = PPOConfig(**common, num_mini_batches=1, num_ppo_epochs=4, local_rollout_forward_batch_size=32,
                           response_length=T, temperature=1.0, total_episodes=2 * B, kl_coef=0.05,
                           missing_eos_penalty=None, stop_token=None, num_sample_generations=0)
        policy = AutoModelForCausalLM.from_pretrained(art / "policy")
        value = AutoModelForSequenceClassification.from_pretrained(art / "reward")
        if ckpt:  # PPOTrainer's own loop never turns the config's flag on: the models are asked directly
            policy.gradient_checkpointing_enable()
            value.gradient_checkpointing_enable()
        trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy,
                             ref_model=AutoModelForCausalLM.from_pretrained(art / "policy"),
                             reward_model=AutoModelForSequenceClassification.from_pretrained(art / "reward"),
                             value_model=value, train_dataset=ds, callbacks=[Timer()])
    else:
        from trl import GRPOConfig, GRPOTrainer

        ds = Dataset.from_dict({"prompt": prompts})
        config = GRPOConfig(**common, num_generations=4, max_completion_length=T, temperature=1.0, top_k=0,
                            beta=0.04, loss_type="grpo", scale_rewards="group", num_iterations=1, max_steps=2,
                            generation_kwargs={"min_new_tokens": T})
        trainer = GRPOTrainer(model=str(art / "policy"), reward_funcs=gpu_check.length_reward, args=config,
                              train_dataset=ds, processing_class=tokenizer, callbacks=[Timer()])
    trainer.train()
    peak = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmHWM:")) / 1024
    print(json.dumps({"s_iter": stamps[-1] - stamps[-2], "peak_mb": peak, "threads": torch.get_num_threads()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--algos", nargs="+", default=["ppo", "grpo"], choices=["ppo", "grpo"])
    parser.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--sides", nargs="+", default=["chunked", "whole", "trl"], choices=["chunked", "whole", "trl"])
    parser.add_argument("--results", default=str(CACHE / "results.jsonl"), help="rows are appended here as they come")
    parser.add_argument("--breakdown", action="store_true", help="only what one training forward saves, per model")
    parser.add_argument("--trl-side", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_side:
        return trl_side(args.trl_side[0], Path(args.trl_side[1]), args.trl_side[2], args.ckpt)
    if args.breakdown:
        for model in args.models:
            art = folders(model)
            print(json.dumps({"model": model, **floor_mb(art, "ppo"), **saved_mb(art, model)}), flush=True)
        return
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    total_mb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                    if line.startswith("MemTotal:")) / 1024
    for model in args.models:
        art = folders(model)
        for algo in args.algos:
            floor = floor_mb(art, algo)
            for ckpt in args.checkpointing:
                for side in args.sides:
                    try:
                        if floor["floor_mb"] > 0.8 * total_mb:
                            raise RuntimeError(f"not run: its floor of {floor['floor_mb']:,.0f} MB alone is over 80% "
                                               f"of this machine's {total_mb:,.0f} MB")
                        if side == "trl":
                            row = theirs(art, model, algo, ckpt == "on")
                        else:
                            row = ours(art, model, algo, 2**24 if side == "chunked" else 0, ckpt == "on")
                    except RuntimeError as e:
                        row = {"error": str(e).splitlines()[-1][:200]}
                    row = {"model": model, "algo": algo, "checkpointing": ckpt, "side": side, **floor, **row,
                           "date": time.strftime("%Y-%m-%d")}
                    print(json.dumps(row), flush=True)
                    with open(args.results, "a") as f:
                        f.write(json.dumps(row) + "\n")
    print(table([json.loads(line) for line in Path(args.results).read_text().splitlines()]))


def table(rows: list[dict]) -> str:
    """One markdown row per (model, algorithm, checkpointing): each side's peak MB and s/iter, the floor, and the
    ratios the issue asks for (ours chunked / TRL; ours chunked above the floor / whole above the floor)."""
    keyed = {}
    for r in rows:
        keyed.setdefault((r["model"], r["algo"], r["checkpointing"]), {})[r["side"]] = r
    lines = ["| model | algorithm | checkpointing | floor (MB) | ours, chunked: peak MB, s/iter | ours, whole logits "
             "| TRL 1.12 | chunked / TRL | chunked / whole, above the floor |", "|" + "---|" * 9]
    for (model, algo, ckpt), sides in keyed.items():
        floor = next(iter(sides.values()))["floor_mb"]

        def cell(side, sides=sides):
            r = sides.get(side)
            if r is None or "error" in r:
                return "–" if r is None else f"failed: {r['error'][:60]}"
            return f"{r['peak_mb']:,.0f}, {r['s_iter']:.1f}"

        ok = {s: r for s, r in sides.items() if "peak_mb" in r}
        vs_trl = f"{ok['chunked']['peak_mb'] / ok['trl']['peak_mb']:.2f}x" if {"chunked", "trl"} <= set(ok) else "–"
        above = (f"{(ok['chunked']['peak_mb'] - floor) / (ok['whole']['peak_mb'] - floor):.2f}x"
                 if {"chunked", "whole"} <= set(ok) else "–")
        lines.append(f"| {model} | {algo} | {ckpt} | {floor:,.0f} | {cell('chunked')} | {cell('whole')} | "
                     f"{cell('trl')} | {vs_trl} | {above} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
