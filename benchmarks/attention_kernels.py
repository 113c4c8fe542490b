"""Why short bf16 update passes on a CPU take PyTorch's math attention kernel (ppo.autocast): the forward and backward
pass of causal scaled_dot_product_attention at several lengths, with the flash kernel in fp32 and in bf16 and with
the math kernel in bf16, and with each kernel the attention's gradients' distance from fp32's.

    python benchmarks/attention_kernels.py                 # batch 8, 14 heads of 64 (Qwen2.5-0.5B's), about a minute
    python benchmarks/attention_kernels.py --batch 32 --heads 4 --lengths 40   # the vs_trl.py benchmark's PPO update
"""

import argparse
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS = {"fp32 flash": (torch.float32, SDPBackend.FLASH_ATTENTION),
           "bf16 flash": (torch.bfloat16, SDPBackend.FLASH_ATTENTION),
           "bf16 math": (torch.bfloat16, SDPBackend.MATH)}


def forward_backward(q, k, v, grad, backend) -> list[torch.Tensor]:
    """One causal attention pass and its backward pass with the given kernel; the gradients of q, k and v."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(backend):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(grad)
    return [x.grad.float() for x in (q, k, v)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 160, 192, 256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per cell, after one untimed")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {args.batch}, {args.heads} heads of 64")
    print("| tokens | " + " | ".join(f"{name} ms" for name in KERNELS) + " | bf16 flash / math | gradient error "
          "flash, math |\n| --- |" + " --- |" * (len(KERNELS) + 2))
    for length in args.lengths:
        torch.manual_seed(0)
        q, k, v, grad = (torch.randn(args.batch, args.heads, length, 64) for _ in range(4))
        exact = forward_backward(q, k, v, grad, SDPBackend.FLASH_ATTENTION)
        ms, errors = {}, {}
        for name, (dtype, backend) in KERNELS.items():
            inputs = [x.to(dtype) for x in (q, k, v, grad)]
            grads = forward_backward(*inputs, backend)
            errors[name] = max(((g - e).norm() / e.norm()).item() for g, e in zip(grads, exact))
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                forward_backward(*inputs, backend)
                times.append(time.perf_counter() - start)
            ms[name] = 1000 * statistics.median(times)
        ratio = ms["bf16 flash"] / ms["bf16 math"]
        print(f"| {length} | " + " | ".join(f"{ms[name]:.1f}" for name in KERNELS)
              + f" | {ratio:.2f}x | {errors['bf16 flash']:.4f}, {errors['bf16 math']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
