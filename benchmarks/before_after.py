"""Our PPO and RLOO iterations before and after a change, on vs_trl.py's settings, iteration by iteration in turn.

The scripts of an earlier commit (checked out with `git worktree` into a temporary folder) and of this checkout run
as two processes at once that take turns: one runs an iteration while the other waits at its last `log_row`, then
the other runs one, and so on. So each pair of iterations is seconds apart and the machine's drift, which moves a
whole run by 10-20% on this project's shared CPU, hits both sides alike. Each side's figure is the median of its
iterations' seconds after warm-up (waits not counted); "paired" is the median of the after / before ratios of the
iterations taken in turn. Used for issue 14's "no slower than before" (before: c120fc9).

    python benchmarks/before_after.py --before c120fc9
    python benchmarks/before_after.py --before HEAD~3 --only rloo --iterations 40
    python benchmarks/before_after.py --before 28ab30d --dtype bf16 --only ppo --only prm   # bf16's attention kernel
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import artifacts  # noqa: E402
import vs_trl  # noqa: E402

# Run the script (its path first in sys.argv) with its log_row made a turn: after each row, say "done" on one pipe
# and wait for "go" on another; the seconds from one go to the next done are that iteration's time.
TURNS = """
import importlib, json, os, sys, time
import tyro
sys.argv = sys.argv[1:]
sys.path.insert(0, os.getcwd())
script = importlib.import_module(os.path.basename(sys.argv[0])[:-3])
done, go, times, started = int(os.environ["TURN_DONE_FD"]), int(os.environ["TURN_GO_FD"]), [], []
log_row = script.log_row
def turn(*args, **kwargs):
    log_row(*args, **kwargs)
    if started:
        times.append(time.perf_counter() - started.pop())
    os.write(done, b".")
    os.read(go, 1)
    started.append(time.perf_counter())
script.log_row = turn
script.main(tyro.cli(script.Args))
print("TURN_TIMES", json.dumps(times))
"""


def in_turn(commands: list[tuple[list[str], Path]], folder: Path) -> list[list[float]]:
    """Start the commands at once and let them run one iteration at a time, in turn; each one's iteration seconds."""
    procs = []
    for i, (args, cwd) in enumerate(commands):
        done_r, done_w = os.pipe()
        go_r, go_w = os.pipe()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TURN_DONE_FD": str(done_w), "TURN_GO_FD": str(go_r)}
        stdout, stderr = open(folder / f"{i}.out", "w+"), open(folder / f"{i}.err", "w+")
        proc = subprocess.Popen([sys.executable, "-c", TURNS, *args], cwd=cwd, env=env, pass_fds=(done_w, go_r),
                                stdout=stdout, stderr=stderr)
        os.close(done_w)
        os.close(go_r)
        procs.append((proc, done_r, go_w, stdout, stderr))
    live = [p for p in procs if os.read(p[1], 1)]  # each one at its first row (the evaluation before training)
    while live:
        for p in list(live):
            os.write(p[2], b".")
            if not os.read(p[1], 1):  # the pipe closed: that run has ended
                live.remove(p)
    times = []
    for proc, done_r, go_w, stdout, stderr in procs:
        proc.wait()
        os.close(done_r)
        os.close(go_w)
        stdout.seek(0)
        stderr.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"{commands[len(times)][0][0]} failed:\n{stderr.read()[-3000:]}")
        times.append(json.loads(stdout.read().split("TURN_TIMES")[-1]))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="c120fc9", help="the earlier commit")
    parser.add_argument("--only", choices=["ppo", "rloo", "prm"], action="append",
                        help="these rows only (default PPO and RLOO; PRM: seconds per step)")
    parser.add_argument("--iterations", type=int, default=20, help="iterations per side, taken in turn")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="both sides in this dtype")
    args = parser.parse_args()
    art = artifacts.build()
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before], check=True,
                       capture_output=True)
        try:
            print(f"| {args.dtype} | before ({args.before}) s/iter | after (this checkout) s/iter | after / before "
                  "| paired after / before (quartiles) |")
            print("| --- | --- | --- | --- | --- |")
            for algo in args.only or ["ppo", "rloo"]:
                commands = []
                for side in ("before", "after"):
                    cmd, _ = vs_trl.our_command(algo, args.iterations, art, args.dtype, False)
                    cmd[cmd.index("--output-dir") + 1] = str(Path(tmp) / f"{algo}_{side}")
                    commands.append((cmd, before if side == "before" else ROOT))
                b, a = (t[vs_trl.WARMUP:-1] for t in in_turn(commands, Path(tmp)))  # the last one evaluates
                ratios = [y / x for x, y in zip(b, a)]
                q1, q2, q3 = statistics.quantiles(ratios, n=4)
                print(f"| {algo.upper()} | {statistics.median(b):.3f} | {statistics.median(a):.3f} | "
                      f"{statistics.median(a) / statistics.median(b):.3f} | {q2:.3f} ({q1:.3f}-{q3:.3f}) |",
                      flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=True)


if __name__ == "__main__":
    main()
