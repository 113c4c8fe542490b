"""Why a model on a CPU computes its attention in fp32 under bf16 autocast (ppo.fp32_sdpa): causal
scaled_dot_product_attention's forward and backward pass at several lengths, from the dtypes it gets there (queries and
keys in fp32, as RoPE leaves them; values in bf16, out of their bf16 projection), computed the way fp32_sdpa does
(values cast up, SDPA's flash kernel in fp32) and the two ways autocast does (all cast down, SDPA's bf16 flash kernel,
or its math kernel, which the scripts took for short update passes until fp32_sdpa); each one's gradients' distance
from fp32's on the same inputs; and one decode step's attention (one query over the tokens so far, no gradient).

    python benchmarks/attention_kernels.py                 # batch 8, 14 heads of 64 (Qwen2.5-0.5B's), about a minute
    python benchmarks/attention_kernels.py --batch 32 --heads 4 --lengths 44   # the vs_trl.py benchmark's PPO update
"""

import argparse
import functools

import torch
from decode_steps import median_ms  # benchmarks/decode_steps.py: median milliseconds of fn()
from torch.nn.attention import SDPBackend, sdpa_kernel

WAYS = {"fp32 (fp32_sdpa)": (torch.float32, SDPBackend.FLASH_ATTENTION),
        "bf16 flash (autocast)": (torch.bfloat16, SDPBackend.FLASH_ATTENTION),
        "bf16 math": (torch.bfloat16, SDPBackend.MATH)}


def attention(q, k, v, dtype, backend, is_causal: bool = True) -> torch.Tensor:
    """SDPA on q, k, v cast to dtype (the cast is part of the pass, as in the scripts) with the given kernel."""
    with sdpa_kernel(backend):
        return torch.nn.functional.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype),
                                                                is_causal=is_causal)


def forward_backward(q, k, v, grad, dtype, backend) -> list[torch.Tensor]:
    """One causal attention pass and its backward pass; the gradients of q, k and v in fp32."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    attention(q, k, v, dtype, backend).backward(grad.to(dtype))
    return [x.grad.float() for x in (q, k, v)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 160, 192, 256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per cell, after an untimed one")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {args.batch}, {args.heads} heads of 64")
    print("| tokens | " + " | ".join(f"{name} ms" for name in WAYS) + " | fp32 / bf16 flash | gradient error "
          + ", ".join(WAYS) + " | decode step fp32 / bf16 flash ms |\n| --- |" + " --- |" * (len(WAYS) + 3))
    for length in args.lengths:
        torch.manual_seed(0)
        q, k, grad = (torch.randn(args.batch, args.heads, length, 64) for _ in range(3))
        v = torch.randn(args.batch, args.heads, length, 64).bfloat16()  # values come out of a bf16 projection
        exact = forward_backward(q.double(), k.double(), v.double(), grad, torch.float64, SDPBackend.MATH)
        ms, errors = {}, []
        for name, (dtype, backend) in WAYS.items():
            grads = forward_backward(q, k, v, grad, dtype, backend)
            errors.append(max(((g - e).norm() / e.norm()).item() for g, e in zip(grads, exact)))
            ms[name] = median_ms(functools.partial(forward_backward, q, k, v, grad, dtype, backend), args.repeats)
        decode = []
        for dtype in (torch.float32, torch.bfloat16):
            step = functools.partial(attention, q[:, :, -1:], k, v, dtype, SDPBackend.FLASH_ATTENTION, False)
            step()  # untimed
            decode.append(median_ms(step, args.repeats * 4))
        ratio = ms["fp32 (fp32_sdpa)"] / ms["bf16 flash (autocast)"]
        print(f"| {length} | " + " | ".join(f"{ms[name]:.1f}" for name in WAYS) + f" | {ratio:.2f}x | "
              + ", ".join(f"{e:.4f}" for e in errors) + f" | {decode[0]:.2f} / {decode[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
