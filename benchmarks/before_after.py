"""Our PPO and RLOO iterations before and after a change, on vs_trl.py's settings, paired in one run.

The scripts of an earlier commit (checked out with `git worktree` into a temporary folder) and of this checkout run
in turn, round after round, so that the machine's drift hits both; each side's figure is the median seconds per
iteration after warm-up over all its rounds. Used for issue 14's "no slower than before" (before: c120fc9).

    python benchmarks/before_after.py --before c120fc9
    python benchmarks/before_after.py --before HEAD~3 --only rloo --rounds 5
    python benchmarks/before_after.py --before 28ab30d --dtype bf16 --only ppo --only prm   # bf16's attention kernel
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import artifacts  # noqa: E402
import vs_trl  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="c120fc9", help="the earlier commit")
    parser.add_argument("--only", choices=["ppo", "rloo", "prm"], action="append",
                        help="these rows only (default PPO and RLOO; PRM: seconds per step)")
    parser.add_argument("--iterations", type=int, default=10, help="iterations per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side, in turn")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="both sides in this dtype")
    args = parser.parse_args()
    art = artifacts.build()
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before], check=True,
                       capture_output=True)
        try:
            print(f"| {args.dtype} | before ({args.before}) s/iter | after (this checkout) s/iter | after / before |")
            print("| --- | --- | --- | --- |")
            for algo in args.only or ["ppo", "rloo"]:
                times = {"before": [], "after": []}
                for _ in range(args.rounds):
                    for side, root in (("before", before), ("after", ROOT)):
                        run = vs_trl.ours(algo, args.iterations, art, args.dtype, False, root=root)
                        times[side].append(run["times"])
                b, a = (vs_trl.median_after_warmup(times[side]) for side in ("before", "after"))
                print(f"| {algo.upper()} | {b:.3f} | {a:.3f} | {a / b:.3f} |", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=True)


if __name__ == "__main__":
    main()
