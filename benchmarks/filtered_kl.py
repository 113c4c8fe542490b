"""The KL under sampling filters, measured (issue 36): ppo.py and rloo.py on the built-in task and tiny model.

1. At identical weights (the first iteration: the policy is still its reference), `objective/kl` for each filter
   (--top-k 3, --top-p 0.9, --min-p 0.1) and each estimator: k1 and k3 in the reward (both scripts), k2 and k3 in the
   loss (rloo.py's --no-kl-in-reward). Every figure must be 0 within float noise. At --temperature 0.3
   (--kl-temperature): the random-weight model's next-token distribution is nearly flat, and at 1.0 min-p 0.1 would
   drop nothing.
2. A reward that is always 0, with and without --top-k 3, at the default learning rate (1e-3) and at 1e-4: the mean
   response length over the first and the last 5 of 30 iterations. A KL that is not 0 at identical weights penalises
   every token and shortens the responses; with a KL of 0 rloo.py's policy does not move (every advantage is 0), and
   ppo.py's moves only by its value model's noise.

    python benchmarks/filtered_kl.py                 # this checkout (about 8 minutes on 2 cores)
    python benchmarks/filtered_kl.py --root ../old   # the same runs on another checkout's scripts (before a change)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FILTERS = {"--top-k 3": ["--top-k", "3"], "--top-p 0.9": ["--top-p", "0.9"], "--min-p 0.1": ["--min-p", "0.1"]}
ESTIMATORS = {"ppo.py": [("k1 (reward)", ["--kl-estimator", "k1"]), ("k3 (reward)", ["--kl-estimator", "k3"])],
              "rloo.py": [("k1 (reward)", ["--kl-estimator", "k1"]), ("k3 (reward)", ["--kl-estimator", "k3"]),
                          ("k2 (loss)", ["--no-kl-in-reward", "--kl-estimator", "k2"]),
                          ("k3 (loss)", ["--no-kl-in-reward", "--kl-estimator", "k3"])]}
ZERO = "def score(prompts, completions, **kwargs):\n    return [0.0] * len(completions)\n"


def run(root: Path, script: str, flags: list[str], work: Path, name: str) -> list[dict]:
    """One run of a script with flags; its metrics.jsonl rows (iteration >= 1)."""
    out = work / name
    cmd = [sys.executable, str(root / script), "--max-new-tokens", "16", "--eval-every", "1000",
           "--output-dir", str(out), *flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(root)}
    result = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{script} {' '.join(flags)} failed:\n{result.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["iteration"] >= 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the checkout whose ppo.py and rloo.py run")
    parser.add_argument("--iterations", type=int, default=30, help="iterations of the zero-reward runs")
    parser.add_argument("--kl-temperature", default="0.3", help="--temperature of the identical-weights runs")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="filtered_kl_"))
    (work / "zero.py").write_text(ZERO)
    one = ["--total-episodes", "64", "--batch-size", "64", "--temperature", args.kl_temperature]
    print(f"objective/kl at identical weights (iteration 1), --temperature {args.kl_temperature}\n")
    print("| script | estimator | " + " | ".join(FILTERS) + " |")
    print("| --- | --- |" + " --- |" * len(FILTERS))
    for script, estimators in ESTIMATORS.items():
        for label, est in estimators:
            kls = [run(args.root, script, [*one, *f, *est], work, f"{script}{label}{name}".replace(" ", ""))[0]
                   ["objective/kl"] for name, f in FILTERS.items()]
            print(f"| {script} | {label} | " + " | ".join(f"{kl:.2e}" for kl in kls) + " |", flush=True)
    print(f"\nval/response_length with a reward of 0, {args.iterations} iterations of 64 responses "
          "(--max-new-tokens 16)\n")
    print("| script | filter | --learning-rate | first 5 iterations | last 5 | objective/kl, last 5 |")
    print("| --- | --- | --- | --- | --- | --- |")
    many = ["--total-episodes", str(64 * args.iterations), "--batch-size", "64", "--reward-fn", "zero.py:score"]
    for script in ESTIMATORS:
        for lr in ("1e-3", "1e-4"):
            for label, f in (("none", []), ("--top-k 3", FILTERS["--top-k 3"])):
                name = f"{script}{lr}{label}".replace(" ", "")
                rows = run(args.root, script, [*many, *f, "--learning-rate", lr], work, name)
                first, last = rows[:5], rows[-5:]
                mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
                print(f"| {script} | {label} | {lr} | {mean(first, 'val/response_length'):.2f} | "
                      f"{mean(last, 'val/response_length'):.2f} | {mean(last, 'objective/kl'):.3f} |", flush=True)


if __name__ == "__main__":
    main()
