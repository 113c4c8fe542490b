"""The GRPO family, measured: each named configuration of rloo.py (RECIPES: rloo, trl_rloo, grpo, dr_grpo, dapo,
gspo, cispo, sapo, vespo, luspo) on the built-in task at several seeds, on the real pretrained model of
benchmarks/real_model.py, and the sampler-trainer logprob difference of filtered sampling in fp32 and bf16.

    python benchmarks/grpo_family.py --part builtin     # 10 configurations x 3 seeds, two runs at a time (~35 min)
    python benchmarks/grpo_family.py --part real        # 10 configurations on SmolLM2-135M-Instruct, one seed (~65 min)
    python benchmarks/grpo_family.py --part sampling    # rloo.py --top-k 3 --top-p 0.9, fp32 and bf16 (~3 min)

builtin prints the final greedy accuracy per seed, the episodes each seed took to reach 0.9 (the first evaluation
at or above it) and the last iteration's policy/entropy_avg and val/truncated_frac (means over seeds), and draws the
mean accuracy per configuration against episodes to docs/img/grpo_family.png. real prints the held-out accuracy
before and after and the minutes of each run. sampling prints, for each dtype, the mean
over iterations of the logged sampling/sampling_logp_difference/mean and the largest /max; and, on the final model's
samples, the difference the update would see if it took its logprobs from the full softmax (as before the filters
were made on-policy).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
NAMES = ["rloo", "trl_rloo", "grpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo", "vespo", "luspo"]


def run_script(args: list[str], out: Path, threads: int = 1, reuse: bool = False) -> list[dict]:
    """python <args> --output-dir out, its output to out/log.txt; the metrics rows (stops on a failure). reuse: a
    folder that already holds the run's final model is read, not run again."""
    if not (reuse and (out / "model").is_dir()):
        shutil.rmtree(out, ignore_errors=True)  # a new run refuses a folder holding another's rows
        out.mkdir(parents=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(out / "log.txt", "w") as log:
            code = subprocess.run([sys.executable, *args, "--output-dir", str(out)], cwd=ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT).returncode
        if code != 0:
            sys.exit(f"{' '.join(args)} failed; see {out / 'log.txt'}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def evals(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "task/accuracy" in r]


def builtin(args) -> None:
    jobs = [(name, seed) for name in args.names for seed in args.seeds]
    with ThreadPoolExecutor(args.parallel) as pool:
        results = dict(zip(jobs, pool.map(lambda job: run_script(
            ["rloo.py", job[0], "--seed", str(job[1]), "--total-episodes", str(args.episodes), "--eval-every", "10"],
            args.out / f"{job[0]}-{job[1]}", reuse=args.reuse), jobs)))
    print(f"\nbuilt-in task, {args.episodes:,} episodes, seeds {args.seeds}")
    print("| configuration | final accuracy per seed | mean | episodes to 0.9 per seed | final entropy, truncated |")
    print("| --- | --- | --- | --- | --- |")
    for name in args.names:
        finals = [evals(results[name, s])[-1]["task/accuracy"] for s in args.seeds]
        reached = [next((r["episode"] for r in evals(results[name, s]) if r["task/accuracy"] >= 0.9), None)
                   for s in args.seeds]
        last = [[r for r in results[name, s] if "policy/entropy_avg" in r][-1] for s in args.seeds]
        print(f"| `{name}` | {' / '.join(f'{a:.2f}' for a in finals)} | {statistics.mean(finals):.2f} | "
              f"{' / '.join(f'{e:,}' if e else 'not reached' for e in reached)} | "
              f"{statistics.mean(r['policy/entropy_avg'] for r in last):.2f}, "
              f"{statistics.mean(r['val/truncated_frac'] for r in last):.2f} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name in args.names:
        curves = [evals(results[name, s]) for s in args.seeds]
        n = min(map(len, curves))
        ax.plot([curves[0][i]["episode"] for i in range(n)],
                [statistics.mean(c[i]["task/accuracy"] for c in curves) for i in range(n)], label=name)
    ax.set_xlabel("episodes")
    ax.set_ylabel(f"greedy accuracy, mean of {len(args.seeds)} seeds")
    ax.set_title("rloo.py's named configurations on the built-in task", fontsize=10)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print(f"curves in {args.plot}")


def real(args) -> None:
    import real_model

    model = real_model.make_model_folder(real_model.CACHE / "SmolLM2-135M-Instruct")
    data = real_model.write_task(args.out / "data")
    print(f"\nSmolLM2-135M-Instruct, {args.real_episodes} episodes (batch 32, lr 2e-5), held-out accuracy, one seed")
    print("| configuration | before | after | minutes |")
    print("| --- | --- | --- | --- |")
    for name in args.names:
        rows = run_script(["rloo.py", name, "--model", str(model), "--dataset", str(data), "--dataset-split", "train",
                           "--eval-split", "test", "--num-eval-prompts", str(real_model.NUM_TEST), "--reward-fn",
                           f"{data / 'reward.py'}:score", "--max-new-tokens", str(real_model.MAX_NEW_TOKENS),
                           "--total-episodes", str(args.real_episodes), "--batch-size", "32", "--learning-rate", "2e-5",
                           "--eval-every", "1000"], args.out / f"real-{name}", threads=2, reuse=args.reuse)
        first, last = evals(rows)[0], evals(rows)[-1]
        print(f"| `{name}` | {first['task/accuracy']:.3f} | {last['task/accuracy']:.3f} | "
              f"{last['elapsed_s'] / 60:.1f} |", flush=True)


def sampling(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rloo

    print("\nrloo.py --top-k 3 --top-p 0.9 on the built-in task, 100 iterations of 256 responses")
    print("| dtype | logged difference, mean over iterations | largest logged max | full softmax instead: mean | max |")
    print("| --- | --- | --- | --- | --- |")
    for dtype in ("fp32", "bf16"):
        out = args.out / f"sampling-{dtype}"
        rows = run_script(["rloo.py", "--top-k", "3", "--top-p", "0.9", "--dtype", dtype, "--total-episodes", "25600",
                           "--eval-every", "100"], out, threads=2)[1:]
        mean = statistics.mean(r["sampling/sampling_logp_difference/mean"] for r in rows)
        largest = max(r["sampling/sampling_logp_difference/max"] for r in rows)
        # the trained model's samples: their logprobs on the sampler's support and on the full softmax
        tokenizer = AutoTokenizer.from_pretrained(out / "model")
        model = AutoModelForCausalLM.from_pretrained(out / "model")
        prompts = [rloo.render_prompt(tokenizer, r["prompt"]) for r in rloo.addition_eval_rows()]
        queries = rloo.left_pad(prompts, tokenizer.pad_token_id)
        sample, _ = rloo.generation_configs(rloo.GenArgs(max_new_tokens=4), tokenizer, 1.0, top_k=3, top_p=0.9)
        torch.manual_seed(0)
        with rloo.autocast(dtype, torch.device("cpu")), torch.no_grad():
            responses, lengths, _, sampler, _ = rloo.generate(model, tokenizer, queries, sample, [])
            valid = torch.arange(responses.shape[1])[None] < lengths[:, None]
            query_mask = (queries != tokenizer.pad_token_id).cumsum(1) > 0
            full, _ = rloo.response_logprobs(model, queries, query_mask, responses, valid, 1.0)
        gap = (full - sampler).abs()[valid]
        print(f"| {dtype} | {mean:.2e} | {largest:.2e} | {gap.mean():.3f} | {gap.max():.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["builtin", "real", "sampling"], required=True)
    parser.add_argument("--names", nargs="+", default=NAMES, choices=NAMES)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--episodes", type=int, default=256_000, help="built-in task: episodes per run")
    parser.add_argument("--real-episodes", type=int, default=640, help="real model: episodes per run")
    parser.add_argument("--parallel", type=int, default=2, help="built-in runs at a time (one thread each)")
    parser.add_argument("--reuse", action="store_true", help="read the runs already finished in --out")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "grpo_family")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "grpo_family.png")
    args = parser.parse_args()
    {"builtin": builtin, "real": real, "sampling": sampling}[args.part](args)


if __name__ == "__main__":
    main()
