"""Seconds of one training forward + backward of the update's layouts on one batch of real-length shapes, and the
positions each computes: padded rows (each prompt k times), each response packed after its own prompt copy (the
layout before), and each group's prompt once with its k responses after it, in rows of 1-3x the longest group (the
width packed_inputs picks marked, or added). SmolLM2-135M-Instruct (real_model.py's folder) or the built-in tiny
model, random tokens.

    python benchmarks/pack_widths.py --model benchmarks/.cache/real_model/SmolLM2-135M-Instruct
    python benchmarks/pack_widths.py --model benchmarks/.cache/real_model/SmolLM2-135M-Instruct --prompt 150 250 \
        --reply 256 --groups 2 --k 8
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ppo  # noqa: E402


def timed(model, inputs: dict, index: torch.Tensor, turns: int) -> float:
    """Median seconds of the model's forward to the scored positions' hidden states and a backward from their sum."""
    times = []
    for _ in range(turns):
        start = time.perf_counter()
        h, _ = ppo.forward_to_head(model, index, 1, **inputs)
        h.float().pow(2).mean().backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin", help="a model folder (default: the built-in tiny model)")
    parser.add_argument("--prompt", type=int, nargs=2, default=[40, 70], help="prompt tokens, from and to")
    parser.add_argument("--reply", type=int, default=128, help="the longest reply: replies of 10 to this many tokens")
    parser.add_argument("--groups", type=int, default=8, help="prompts")
    parser.add_argument("--k", type=int, default=4, help="replies a prompt")
    parser.add_argument("--turns", type=int, default=3, help="timings a layout (median)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    _, model = ppo.load_policy(args.model, False)
    model = ppo.disable_dropout(model).train()
    V, P, k, T = model.config.vocab_size, args.groups, args.k, args.reply
    n_q = torch.randint(args.prompt[0], args.prompt[1] + 1, (P,))
    n_r = torch.randint(10, T + 1, (P * k,))
    Lq = int(n_q.max())
    query_mask = torch.arange(Lq)[None] >= (Lq - n_q)[:, None]
    valid = torch.arange(T)[None] < n_r[:, None]
    queries, responses = torch.randint(3, V, (P, Lq)) * query_mask, torch.randint(3, V, (P * k, T)) * valid
    real = int(n_q.sum() + n_r.sum())
    print(f"{P} prompts of {args.prompt[0]}-{args.prompt[1]} tokens x {k} replies of 10-{T} (mean "
          f"{n_r.float().mean():.0f}); real tokens, each prompt once: {real}; hidden {model.config.hidden_size}")
    print("| layout | rows x width | positions / real | attention (sum of rows' width^2) | seconds |")
    print("| --- | --- | --- | --- | --- |")
    vars(model).setdefault("checks", {})["packs"] = False
    inputs, index = ppo.packed_inputs(model, queries, query_mask, responses, valid)
    rows = [("padded", inputs, index)]
    repeated = torch.cat([queries.repeat_interleave(k, 0), responses], 1)  # before: each reply after its prompt
    lengths = (query_mask.sum(1).repeat_interleave(k) + n_r).tolist()
    W, widths, base = max(lengths), [], []
    for b in sorted(range(P * k), key=lambda b: -lengths[b]):
        r = next((r for r, w in enumerate(widths) if w + lengths[b] <= W), len(widths))
        widths += [0] * (r == len(widths))
        base.append((b, r * W + widths[r]))
        widths[r] += lengths[b]
    ids, pos = torch.zeros(len(widths) * W, dtype=torch.long), torch.zeros(len(widths) * W, dtype=torch.long)
    idx = torch.zeros(P * k, T, dtype=torch.long)
    mask = torch.cat([query_mask.repeat_interleave(k, 0), valid], 1)
    for b, start in base:
        seq = repeated[b][mask[b]]
        ids[start:start + len(seq)], pos[start:start + len(seq)] = seq, torch.arange(len(seq))
        idx[b] = start + (lengths[b] - n_r[b] - 1 + torch.arange(T)).clamp(max=lengths[b] - 1)
    rows.append(("each reply after its own prompt (before)", dict(input_ids=ids.view(-1, W),
                 position_ids=pos.view(-1, W), use_cache=False), idx))
    vars(model)["checks"]["packs"] = True
    chosen = ppo.packed_inputs(model, queries, query_mask, responses, valid)
    longest = max((query_mask.sum(1) + n_r.view(P, k).sum(1)).tolist())
    for f in (8, 9, 10, 12, 16, 24):
        inputs, index = ppo.pack_segments(model, queries, query_mask, responses, valid, width=longest * f // 8)
        mark = " (chosen)" if inputs["input_ids"].shape == chosen[0]["input_ids"].shape else ""
        rows.append((f"each prompt once, width {f / 8:g}x the longest group{mark}", inputs, index))
    if not any("(chosen)" in name for name, _, _ in rows):
        rows.append(("the layout packed_inputs picks (its segments may hold fewer replies, each after a prompt copy)",
                     *chosen))
    for name, inputs, index in rows:
        R, W = inputs["input_ids"].shape
        seconds = timed(model, inputs, index[valid], args.turns)
        print(f"| {name} | {R} x {W} | {R * W / real:.2f} | {R * W * W:,} | {seconds:.2f} |", flush=True)


if __name__ == "__main__":
    main()
