"""Learning with LoRA adapters on the built-in addition task (issue 16): ppo.py and rloo.py with --lora-r, from random
weights and from a short SFT warm start, beside full fine-tuning from the same warm start.

The warm start is `interleave.py --phases sft --total-steps N` (full SFT on the task's demonstrations, a few seconds);
its model/ is then the --model of the RL run. Every run uses the scripts' defaults for the built-in task (learning
rate 1e-3, given explicitly because a --model folder would otherwise get the pretrained default 3e-6), but for
rloo.py's episodes: 256,000, its default when the figures in docs/ppo.md were taken (512,000 since). Runs go two at
a time, one thread each. Prints one markdown row per run: greedy accuracy on the task's 100 sums at the start and the
end, and the run's seconds.

    python benchmarks/lora_learning.py                          # PPO and RLOO, seeds 1 2, LoRA r 16 (~30 minutes)
    python benchmarks/lora_learning.py --algos rloo --seeds 1
"""

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}


def run(args: list[str], out: Path) -> list[dict]:
    """Run a script of this repo into `out`; its metrics rows."""
    result = subprocess.run([sys.executable, *args, "--output-dir", str(out)], capture_output=True, text=True,
                            env=ENV, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:6])}... failed:\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def warm_start(seed: int, steps: int, folder: Path) -> float:
    """Full SFT for `steps` steps from random weights; the greedy accuracy it reached."""
    rows = run(["interleave.py", "--phases", "sft", "--total-steps", str(steps), "--eval-every", str(steps),
                "--seed", str(seed)], folder)
    return rows[-1]["task/accuracy"]


def rl(algo: str, seed: int, model: str, lora_r: int, out: Path) -> dict:
    """One RL run of `algo` from `model` ('builtin': random weights); accuracy at the start and end, seconds."""
    extra = ["--lora-r", str(lora_r)] if lora_r else []
    if algo == "rloo":
        extra += ["--total-episodes", "256000"]
    rows = run([f"{algo}.py", "--model", model, "--learning-rate", "1e-3", "--seed", str(seed), *extra], out)
    evals = [r for r in rows if "task/accuracy" in r]
    return {"start": evals[0]["task/accuracy"], "end": evals[-1]["task/accuracy"],
            "best": max(r["task/accuracy"] for r in evals), "seconds": rows[-1]["elapsed_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algos", nargs="+", default=["ppo", "rloo"], choices=["ppo", "rloo"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--sft-steps", type=int, default=60, help="steps of the SFT warm start")
    parser.add_argument("--out", default="/tmp/lora_learning", help="folder of the runs")
    args = parser.parse_args()
    out = Path(args.out)
    warm = {s: warm_start(s, args.sft_steps, out / f"warm_{s}") for s in args.seeds}
    jobs = [(algo, seed, start, r) for algo in args.algos for seed in args.seeds
            for start, r in [("random weights", args.lora_r), ("SFT warm start", args.lora_r), ("SFT warm start", 0)]]

    def one(job: tuple) -> str:
        algo, seed, start, r = job
        model = "builtin" if start == "random weights" else str(out / f"warm_{seed}" / "model")
        res = rl(algo, seed, model, r, out / f"{algo}_{seed}_{start.split()[0]}_{r}")
        row = (f"| {algo}.py | {start} | {f'LoRA r {r}' if r else 'full'} | {seed} | {res['start']:.2f} | "
               f"{res['end']:.2f} | {res['best']:.2f} | {res['seconds']:.0f} |")
        print(row, flush=True)
        return row

    print(f"SFT warm start ({args.sft_steps} steps) reached greedy accuracy "
          + ", ".join(f"{warm[s]:.2f} (seed {s})" for s in args.seeds))
    print("| script | from | trains | seed | accuracy at start | at end | best eval | seconds |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    with ThreadPoolExecutor(2) as pool:
        rows = list(pool.map(one, jobs))
    print("\nin job order:\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
