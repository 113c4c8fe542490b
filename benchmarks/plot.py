"""Learning curves from runs' metrics.jsonl: chosen metrics against episode, iteration or elapsed_s, one panel per
metric and one line per run; runs that share a label (the seeds of one setting) share a colour.

    python benchmarks/plot.py runs/measure/ppo-*/metrics.jsonl --keys task/accuracy objective/scores objective/kl \
        --out docs/img/ppo_curves.png
    python benchmarks/plot.py a/metrics.jsonl b/metrics.jsonl --labels PPO RLOO --x elapsed_s --keys task/accuracy \
        --out curves.png

matplotlib is a development dependency (requirements-dev.txt); the training scripts never import it.
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

X_LABELS = {"episode": "episodes (responses trained on)", "iteration": "iteration (optimizer updates)",
            "elapsed_s": "seconds of training"}


def read_rows(path: Path) -> list[dict]:
    """The rows of one metrics.jsonl."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over `window` points (1: unchanged)."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1):i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def window(key: str, smoothing: int) -> int:
    """Evaluations on the fixed held-out set (task/*, eval/*) are drawn as they are; training metrics smoothed."""
    return 1 if key.startswith(("task/", "eval/")) else smoothing


def phase_changes(rows: list[dict], x: str) -> list[tuple[float, str]]:
    """Where the logged `phase` changes: (x, new phase), the evaluation-only rows left out."""
    changes, last = [], None
    for r in rows:
        phase = r.get("phase")
        if phase in (None, "eval") or x not in r:
            continue
        if phase != last and last is not None:
            changes.append((r[x], phase))
        last = phase
    return changes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="metrics.jsonl files, one line each")
    parser.add_argument("--keys", nargs="+", required=True, help="metrics to plot, one panel each")
    parser.add_argument("--x", default="episode", help="x axis: episode, iteration or elapsed_s")
    parser.add_argument("--labels", nargs="+", help="one legend label per file (default: the run folder's name)")
    parser.add_argument("--smooth", type=int, default=1,
                        help="moving-average window over logged points (not for task/* and eval/*)")
    parser.add_argument("--log-y", nargs="*", default=[], help="keys to draw on a log scale")
    parser.add_argument("--mark-phases", action="store_true", help="dotted lines where a run's phase changes")
    parser.add_argument("--title", default=None)
    parser.add_argument("--out", type=Path, required=True, help="PNG file to write")
    parser.add_argument("--dpi", type=int, default=100)
    args = parser.parse_args()
    labels = args.labels or [f.parent.name for f in args.files]
    if len(labels) != len(args.files):
        parser.error(f"--labels: give one label per file ({len(args.files)}), not {len(labels)}")

    colours = {label: f"C{i}" for i, label in enumerate(dict.fromkeys(labels))}
    fig, axes = plt.subplots(1, len(args.keys), figsize=(4.2 * len(args.keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], args.keys):
        seen = set()
        for path, label in zip(args.files, labels):
            rows = [r for r in read_rows(path) if key in r and args.x in r]
            if not rows:
                continue
            ys = smooth([r[key] for r in rows], window(key, args.smooth))
            ax.plot([r[args.x] for r in rows], ys, color=colours[label], alpha=0.8, lw=1.2,
                    label=None if label in seen else label)
            seen.add(label)
            if args.mark_phases:
                for x, _ in phase_changes(read_rows(path), args.x):
                    ax.axvline(x, color=colours[label], ls=":", lw=0.8)
        ax.set_title(key + (f" (moving average of {args.smooth})" if window(key, args.smooth) > 1 else ""), fontsize=10)
        ax.set_xlabel(X_LABELS.get(args.x, args.x), fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if key in args.log_y:
            ax.set_yscale("log")
    handles, names = axes[0][0].get_legend_handles_labels()
    if len(names) > 1:
        axes[0][0].legend(handles, names, fontsize=8)
    if args.title:
        fig.suptitle(args.title, fontsize=11)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=args.dpi)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
