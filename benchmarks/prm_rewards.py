"""PPO with process rewards from a PRM against PPO with the outcome reward alone, on the built-in multi-step
arithmetic task (running sums, stepwise_prm.py's data), same seeds and episodes.

1. stepwise_prm.py with no arguments trains the PRM (and saves its warm-started LM).
2. A weaker policy to improve on: stepwise_prm.py's causal-LM warm start cut to 300 steps (its warmup_lm/).
3. ppo.py from that policy on --prompt-fn stepwise_prm:multistep_prompt --reward-fn
   stepwise_prm:multistep_reward, with and without --prm-model; greedy accuracy on 100 fixed problems.

    python benchmarks/prm_rewards.py                    # 2 seeds, about 20 minutes on 2 cores
    python benchmarks/prm_rewards.py --seeds 1 --episodes 12800
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(args: list[str]) -> None:
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--episodes", type=int, default=25_600)
    parser.add_argument("--prm-weight", type=float, default=1.0)
    parser.add_argument("--out", default="runs/prm_rewards")
    args = parser.parse_args()
    out = ROOT / args.out
    if not (out / "prm" / "model").exists():
        run(["stepwise_prm.py", "--output-dir", str(out / "prm")])
    if not (out / "weak" / "warmup_lm").exists():
        run(["stepwise_prm.py", "--warmup-steps", "300", "--total-steps", "1", "--output-dir", str(out / "weak")])
    print(f"| seed | reward | greedy accuracy at start | after {args.episodes} episodes | wall time |")
    print("| --- | --- | --- | --- | --- |")
    for seed in args.seeds:
        for name, extra in [("outcome", []), (f"outcome + PRM (weight {args.prm_weight})",
                                               ["--prm-model", str(out / "prm" / "model"),
                                                "--prm-weight", str(args.prm_weight)])]:
            folder = out / f"{name.split()[0]}{'_prm' if extra else ''}_{seed}"
            run(["ppo.py", "--model", str(out / "weak" / "warmup_lm"), "--prompt-fn", "stepwise_prm:multistep_prompt",
                 "--reward-fn", "stepwise_prm:multistep_reward", "--max-new-tokens", "40", "--learning-rate", "3e-4",
                 "--total-episodes", str(args.episodes), "--eval-every", "20", "--seed", str(seed),
                 "--output-dir", str(folder), *extra])
            rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
            evals = [r for r in rows if "task/accuracy" in r]
            print(f"| {seed} | {name} | {evals[0]['task/accuracy']:.2f} | {evals[-1]['task/accuracy']:.2f} | "
                  f"{rows[-1]['elapsed_s']:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
