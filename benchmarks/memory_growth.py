"""Does a long run grow? Runs a script with its tiny default settings for 1,000 iterations and samples the resident
memory (VmRSS) of the process each time metrics.jsonl gains a row; reports it after iteration 50 and at the end.

    python benchmarks/memory_growth.py                 # ppo.py, 1,000 iterations
    python benchmarks/memory_growth.py --script rloo.py --iterations 1000
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status")
    for line in status.read_text().splitlines() if status.exists() else []:
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--script", default="ppo.py")
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp()) / "run"
    cmd = [sys.executable, str(ROOT / args.script), "--total-episodes", str(args.iterations * args.batch_size),
           "--batch-size", str(args.batch_size), "--eval-every", "50", "--output-dir", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples = {}
    while proc.poll() is None:
        rows = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
        rss = rss_mb(proc.pid)
        if rows and rss == rss:  # NaN once the process is gone
            samples[json.loads(rows[-1])["iteration"]] = rss
        time.sleep(0.05)
    assert proc.returncode == 0, f"{args.script} failed"
    at_50 = next(v for k, v in sorted(samples.items()) if k >= 50)
    last = samples[max(samples)]
    print(f"{args.script}: RSS {at_50:.1f} MB after iteration 50, {last:.1f} MB at iteration {max(samples)} "
          f"({100 * (last / at_50 - 1):+.1f}%); peak sampled {max(samples.values()):.1f} MB")


if __name__ == "__main__":
    main()
