"""Where one step of the decode loop spends its time, on vs_trl.py's generation line (its 4-layer policy, 32 prompts
of 8 tokens, 32 sampled tokens): the prefill, one step of the model's forward (eager with a growing cache, compiled
with a static one, as ppo.decode_loop runs each), next_token's sampling, and the operators of the steps under
torch.profiler. The steps run as ppo.generate runs them: the linear layers through oneDNN (ppo.onednn_linears),
the compiled step's attention fused (ppo.fused_attention).
Also the matmuls of one step alone, through BLAS and through oneDNN (weights as they are, and packed in oneDNN's
layout as ppo.onednn_linears packs them): the floor that no decoding around the model's forward goes below.

    python benchmarks/decode_steps.py                 # eager and compiled, about a minute
    python benchmarks/decode_steps.py --no-compile --steps 8
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import artifacts  # noqa: E402

import ppo  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def profile(policy, queries: torch.Tensor, mask: torch.Tensor, steps: int, compiled: bool) -> tuple[list, float, str]:
    """Rows of milliseconds per part of a decode, as ppo.decode_loop takes it; the first decode's seconds (it
    compiles, when compiled); and the top operators of one decode's steps."""
    B, Lq = queries.shape
    C = ppo.cache_length(Lq, steps) if compiled else Lq + steps
    full = torch.nn.functional.pad(mask, (0, C - Lq), value=1)
    step = ppo.compiled_decode_step("default") if compiled else ppo.decode_step

    def prefill():
        cache = ppo.static_cache(policy, B, C) if compiled else DynamicCache(config=policy.config)
        with torch.compiler.set_stance("force_eager"):
            logits = policy(input_ids=queries, attention_mask=full[:, :C if compiled else Lq], use_cache=True,
                            position_ids=ppo.position_ids_from(mask), logits_to_keep=1,
                            **{ppo.CACHE_KWARG: cache}).logits[:, -1]
        return logits, cache

    def decode(cache, token, record=None):
        for t in range(steps - 1):
            if record is not None:
                start = time.perf_counter()
            with torch.compiler.set_stance(skip_guard_eval_unsafe=compiled and t > 0):  # as ppo.decode_loop steps
                logits = step(policy, token, mask.sum(1, keepdim=True) + t, full[:, :C if compiled else Lq + t + 1],
                              cache)
            if record is not None:
                record.append(time.perf_counter() - start)
        return logits

    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=2)
    logits, cache = prefill()
    token = ppo.next_token(logits, queries, gen, 0)[:, None]
    start = time.perf_counter()
    decode(cache, token)
    first = time.perf_counter() - start
    step_times = []
    for _ in range(3):
        logits, cache = prefill()
        decode(cache, token, step_times)
    seen = torch.cat([queries, token.expand(B, steps)], 1)
    rows = [f"| prefill | {median_ms(prefill, 5):.2f} |",
            f"| one step of the model's forward | {1000 * statistics.median(step_times):.2f} |",
            f"| next_token (sampling) | {median_ms(lambda: ppo.next_token(logits, seen, gen, 1), 20):.3f} |"]
    logits, cache = prefill()
    with torch.profiler.profile() as prof:
        decode(cache, token)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)
    return rows, first, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32, help="new tokens per decode")
    parser.add_argument("--no-compile", action="store_true", help="the eager loop only")
    args = parser.parse_args()
    torch.manual_seed(0)
    policy = ppo.disable_dropout(AutoModelForCausalLM.from_pretrained(artifacts.build() / "policy"))
    queries, mask = torch.randint(3, 4096, (32, 8)), torch.ones(32, 8, dtype=torch.long)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; 32 prompts of 8 tokens, {args.steps} steps")
    with torch.no_grad():
        for compiled in [False] if args.no_compile else [False, True]:
            # as ppo.generate runs the loop: oneDNN's matmuls on a CPU, compiled steps with the fused attention
            with ppo.onednn_linears(policy), ppo.fused_attention(policy, compiled):
                rows, first, table = profile(policy, queries, mask, args.steps, compiled)
            print(f"\n{'compiled (--compile)' if compiled else 'eager'}: first decode {first:.1f} s")
            print("| part | ms |\n| --- | --- |\n" + "\n".join(rows))
            print(f"operators of {args.steps - 1} steps:\n{table}")
        linears = [(torch.randn(32, m.in_features), m.weight) for m in policy.modules()
                   if isinstance(m, torch.nn.Linear)]

        def matmuls():  # every linear layer once on a [32, in] input, the output layer included: BLAS's kernel
            for x, weight in linears:
                torch.nn.functional.linear(x, weight)

        def onednn_matmuls(packed: bool):  # the same through oneDNN's; packed, as ppo.onednn_linears runs them
            for (x, weight), packed_weight in zip(linears, packed_weights):
                torch.ops.mkldnn._linear_pointwise(x, packed_weight if packed else weight, None, "none", [], "")

        start = time.perf_counter()
        packed_weights = [torch.ops.mkldnn._reorder_linear_weight(weight) for _, weight in linears]
        pack_ms = 1000 * (time.perf_counter() - start)
        print(f"the matmuls of one step alone ({len(linears)} linear layers): {median_ms(matmuls, 20):.2f} ms "
              f"through BLAS (torch.nn.functional.linear), {median_ms(lambda: onednn_matmuls(False), 20):.2f} ms "
              f"through oneDNN with the weights as they are, {median_ms(lambda: onednn_matmuls(True), 20):.2f} ms "
              f"with them packed in oneDNN's layout (packing them took {pack_ms:.1f} ms, once per decode)")


if __name__ == "__main__":
    main()
