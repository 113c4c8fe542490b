"""Where bf16 costs rloo.py's learning on the built-in task: whole runs with every forward pass in bf16, and with one
part of the iteration moved back to fp32 (the sampling, or the update), against fp32 throughout.

Each run is `rloo.py --dtype bf16 --seed S` with its defaults (512,000 episodes), in this process, with the chosen
part wrapped to run in fp32 (`generate` outside autocast, which also decodes the greedy evaluations: they read the
weights alike in both dtypes; or `rloo_step` with dtype fp32); the figure is the final greedy task/accuracy. A
second table compares the sampler's logprob of each sampled token with the update's for the same tokens, both in
bf16, on a run's model: if the two passes disagreed, the update would follow samples from another policy than the
one it scores.

    python benchmarks/bf16_parts.py --seeds 1 2            # 8 runs, 3-4 minutes each on one core
    python benchmarks/bf16_parts.py --seeds 1 --episodes 25600 --parts bf16 fp32
    python benchmarks/bf16_parts.py --seeds $(seq 1 15) --parts fp32 bf16   # 30 runs: is bf16's cost more than seeds'?
"""

import argparse
import dataclasses
import functools
import json
import random
import sys
from pathlib import Path

import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import rloo  # noqa: E402

PARTS = ["fp32", "bf16", "bf16, sampling in fp32", "bf16, update in fp32"]


def without_autocast(fn):
    """fn run outside autocast (for generate, which opens no autocast of its own)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.autocast("cpu", enabled=False):
            return fn(*args, **kwargs)
    return wrapper


def in_fp32(step):
    """rloo_step with --dtype fp32 (it opens its own autocast from hp.dtype)."""
    @functools.wraps(step)
    def wrapper(*args, hp, **kwargs):
        return step(*args, hp=dataclasses.replace(hp, dtype="fp32"), **kwargs)
    return wrapper


def run(part: str, seed: int, episodes: int, out: Path) -> float:
    """One rloo.py run with `part` in fp32 (the rest in bf16); its final greedy accuracy."""
    saved = rloo.generate, rloo.rloo_step
    if part == "bf16, sampling in fp32":
        rloo.generate = without_autocast(rloo.generate)
    if part == "bf16, update in fp32":
        rloo.rloo_step = in_fp32(rloo.rloo_step)
    dtype = "fp32" if part == "fp32" else "bf16"
    try:
        rloo.main(tyro.cli(rloo.Args, args=["--dtype", dtype, "--seed", str(seed), "--total-episodes", str(episodes),
                                            "--output-dir", str(out)]))
    finally:
        rloo.generate, rloo.rloo_step = saved
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]["task/accuracy"]


def sampler_against_update(model_dir: Path) -> str:
    """Mean and max |sampler logprob - update logprob| over 256 sampled responses, in bf16 and in fp32."""
    tokenizer, policy = rloo.load_policy(str(model_dir), False)
    policy.eval()
    rows = [rloo.addition_prompt(random.Random(i)) for i in range(256)]
    queries = rloo.left_pad([rloo.render_prompt(tokenizer, r["prompt"]) for r in rows], tokenizer.pad_token_id)
    mask = ((queries != tokenizer.pad_token_id).cumsum(1) > 0).long()
    gen, _ = rloo.generation_configs(rloo.GenArgs(max_new_tokens=4), tokenizer, 1.0)
    picked, sampled = [], rloo.next_token

    def recording(logits, seen, g, step):  # the sampler's logprob of the token it picks
        token = sampled(logits, seen, g, step)
        picked.append(logits.float().log_softmax(-1).gather(1, token[:, None])[:, 0])
        return token

    cells = []
    rloo.next_token = recording
    try:
        for dtype in ("bf16", "fp32"):
            torch.manual_seed(0)
            picked.clear()
            with torch.no_grad(), rloo.autocast(dtype, queries.device):
                responses = rloo.decode_loop(policy, queries, mask, gen)
                eos = (responses == tokenizer.eos_token_id).long()
                valid = (eos.cumsum(1) - eos) == 0  # up to and with the first EOS
                update, _ = rloo.shared_prefix_logprobs(policy, queries, responses, valid, tokenizer.pad_token_id, 1.0)
            diff = (update - torch.stack(picked, 1)[:, :responses.shape[1]])[valid].abs()
            cells.append(f"{diff.mean():.1e} / {diff.max():.1e}")
    finally:
        rloo.next_token = sampled
    return " | ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--episodes", type=int, default=512_000)
    parser.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS)
    parser.add_argument("--out", default="runs/bf16_parts", help="run folders go below it")
    args = parser.parse_args()
    torch.set_num_threads(1)
    accuracy = {(p, s): run(p, s, args.episodes, Path(args.out) / f"{p.replace(', ', '_').replace(' ', '_')}_s{s}")
                for p in args.parts for s in args.seeds}
    print("| forward passes | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean |")
    print("| --- |" + " --- |" * (len(args.seeds) + 1))
    for p in args.parts:
        values = [accuracy[p, s] for s in args.seeds]
        print(f"| {p} | " + " | ".join(f"{v:.2f}" for v in values) + f" | {sum(values) / len(values):.3f} |")
    print("\n| model | sampler vs update in bf16: mean / max abs logprob difference | the same in fp32 |")
    print("| --- | --- | --- |")
    for p in args.parts:
        folder = Path(args.out) / f"{p.replace(', ', '_').replace(' ', '_')}_s{args.seeds[0]}" / "model"
        print(f"| {p}, seed {args.seeds[0]} | {sampler_against_update(folder)} |")


if __name__ == "__main__":
    main()
