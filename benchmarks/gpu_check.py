"""One command for a GPU machine: generation speed, PPO and RLOO iterations, and both scripts under torchrun, on a
Qwen2.5-0.5B-shaped model built from config (random weights), in bf16. It prints one table.

    python benchmarks/gpu_check.py           # CUDA: the full size (planned to take under 8 minutes on one H200)
    python benchmarks/gpu_check.py --tiny    # a tiny size; what runs on a machine without CUDA, and in the tests

On a GPU machine that lacks tyro and datasets, carry the wheels that benchmarks/gpu_wheels.py downloads and run
(docs/benchmarks.md, "On a GPU"):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site benchmarks/.wheels/*.whl &&
        PYTHONPATH=/tmp/site python3 benchmarks/gpu_check.py

Full size: Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 attention heads of which 2 key/value heads, intermediate
4,864, tied embeddings, a vocabulary of 151,936 in the config); the BPE tokenizer is trained offline on generated
text and has 8,192 tokens, so ids past it (most of what a random model samples) decode to nothing, which changes no
shape and no cost. Batch 64, prompts of 128 tokens, 256 new tokens. Weights are fp32 and forward passes run under
bf16 autocast, as the scripts' `--dtype bf16` runs them.

Rows: generation tokens/s (64 x 256 sampled tokens, EOS blocked so that every row runs to the end; median of 2 calls
after one warm-up) for `model.generate`, for the scripts' decode loop (`ppo.generate`) and for that loop as
`--compile` runs it; then `ppo.py` and `rloo.py` for 2 iterations in one process (s/iter of the second; the first
holds the warm-up; peak GPU memory by torch.cuda.max_memory_allocated at the process's exit), the same with
`--logits-chunk 0` (the whole [B, T, V] logits in every pass, for the memory the chunked default saves), and each for
2 iterations under `torchrun --nproc_per_node 1` (nccl on CUDA, gloo on CPU), and each for 12 iterations under
`--compile` (inductor) over prompts of 3 to 128 tokens with 24 new tokens, its status giving the decode shapes met
(`sampling/decode_shapes`; on CPU only with --cpu-compile). A row that fails says so and the rest still run; the
command then exits non-zero after the table and the failures' last lines.

Then two tables at uneven lengths (a stop string ends a response at a random token, some run to the cap): one decode
step at the batch size, a half, a quarter and an eighth of it (what dropping finished rows from the decode loop saves
on this device), and `ppo.py` and `rloo.py grpo` at the batch size and 4 times it (the tiny size: the batch size
alone, which runs the same code), 5 iterations each, with each iteration split into its parts as
benchmarks/real_model.py --real-lengths splits it (the median of steps 2-4).
"""

import argparse
import copy
import gc
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve()
# runs a script as `python script args...` (or `python -c code args...`) would, and prints the process's peak
# memory at exit: the CUDA caching allocator's peak (max_memory_allocated) on a GPU, the peak resident set
# (VmHWM) on CPU
PEAK = ("import atexit, runpy, sys, torch; atexit.register(lambda: print('PEAK_MIB', torch.cuda.max_memory_allocated()"
        " / 2**20 if torch.cuda.is_available() else next(int(l.split()[1]) for l in open('/proc/self/status') if "
        "l.startswith('VmHWM:')) / 1024, flush=True)); sys.argv = sys.argv[1:]; "
        "code = sys.argv.pop(1) if sys.argv[0] == '-c' else None; "
        "exec(code, {'__name__': '__main__'}) if code else runpy.run_path(sys.argv[0], run_name='__main__')")


@dataclass
class Size:
    """Model, tokenizer and workload sizes of one table."""

    hidden: int
    """the model's hidden size"""
    layers: int
    """decoder layers"""
    heads: int
    """attention heads"""
    kv_heads: int
    """key/value heads (grouped-query attention)"""
    intermediate: int
    """the MLP's intermediate size"""
    vocab: int
    """the config's vocabulary size (embedding and output rows)"""
    tokenizer_vocab: int
    """tokens of the BPE tokenizer trained offline (at most `vocab`)"""
    corpus_lines: int
    """generated lines the tokenizer is trained on"""
    batch: int
    """sequences per generation call, responses per PPO/RLOO iteration"""
    prompt_len: int
    """tokens per prompt, BOS included"""
    new_tokens: int
    """tokens generated per response"""
    repeats: int
    """timed generation calls per row (after one warm-up call)"""
    timeout_s: int
    """longest a script run may take before its row is marked failed"""


FULL = Size(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151_936, tokenizer_vocab=8192,
            corpus_lines=20_000, batch=64, prompt_len=128, new_tokens=256, repeats=2, timeout_s=240)
TINY = Size(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=1024, tokenizer_vocab=512,
            corpus_lines=2_000, batch=8, prompt_len=16, new_tokens=8, repeats=2, timeout_s=180)


def length_reward(prompts, completions, **kwargs) -> list[float]:
    """The runs' reward function (--reward-fn benchmarks/gpu_check.py:length_reward): completion characters / 100,
    capped at 1. Anything that varies will do: the runs measure time and memory, not learning."""
    return [min(len(c), 100) / 100 for c in completions]


def build(folder: Path, size: Size) -> None:
    """Write the tokenizer, the random-weight model and prompts.jsonl (prompts of exactly size.prompt_len tokens)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import artifacts
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

    rng = random.Random(0)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size.tokenizer_vocab, special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(artifacts.corpus(rng, size.corpus_lines), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                        unk_token="<unk>", padding_side="left")
    config = Qwen2Config(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
                         num_hidden_layers=size.layers, num_attention_heads=size.heads,
                         num_key_value_heads=size.kv_heads, max_position_embeddings=32768, rope_theta=1e6,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)  # as the scripts load it (for a qwen2 folder, Qwen2Tokenizer)
    prompts = []
    for _ in range(100 * size.batch):  # text that tokenizes back to exactly prompt_len tokens
        if len(prompts) == 4 * size.batch:
            break
        ids = tokenizer(" ".join(artifacts.corpus(rng, size.prompt_len))).input_ids[:size.prompt_len]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if len(tokenizer(text).input_ids) == size.prompt_len:
            prompts.append(text)
    if len(prompts) < 4 * size.batch:
        raise RuntimeError(f"only {len(prompts)} of {4 * size.batch} prompts tokenize back to {size.prompt_len} tokens")
    with (folder / "prompts.jsonl").open("w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    with (folder / "uneven.jsonl").open("w") as f:  # the compiled runs' prompts: 3 to prompt_len tokens
        f.writelines(json.dumps({"prompt": tokenizer.decode(tokenizer(p).input_ids[1:rng.randint(3, size.prompt_len)])})
                     + "\n" for p in prompts)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (timings on CUDA would otherwise measure only the launches)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compiled_decode(ppo, policy, gen, device: torch.device):
    """The decode loop as the scripts run it under --compile, through their own path (ppo.compile_models, as main()
    calls it): the forward of a copy of the policy under torch.compile(dynamic=True) (the prefill goes through it) and
    the generation config's compile_config, with which decode_loop compiles its one-token step (fullgraph, fixed
    shapes; CUDA graphs on a GPU). The copy leaves the eager rows' policy as it is."""
    compiled, gen = copy.deepcopy(policy), copy.deepcopy(gen)
    ppo.compile_models(True, [compiled], [gen], device)
    return lambda queries, tokenizer: ppo.generate(compiled, tokenizer, queries, gen, [])


def generation_rows(folder: Path, size: Size, device: torch.device, cpu_compile: bool,
                    failures: list[str]) -> list[list[str]]:
    """Rows: tokens/s of model.generate, of the decode loop, and of the decode loop as --compile runs it (on CPU
    only with cpu_compile)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import ppo

    tokenizer = AutoTokenizer.from_pretrained(folder)
    policy = ppo.disable_dropout(AutoModelForCausalLM.from_pretrained(folder).to(device)).eval()
    generator = torch.Generator().manual_seed(0)
    queries = torch.randint(4, size.tokenizer_vocab, (size.batch, size.prompt_len), generator=generator).to(device)
    mask = torch.ones_like(queries)
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=size.new_tokens,
                           min_new_tokens=size.new_tokens, pad_token_id=tokenizer.pad_token_id,
                           eos_token_id=tokenizer.eos_token_id)
    tokens = size.batch * size.new_tokens
    decode_compiled = compiled_decode(ppo, policy, gen, device)
    calls = [
        ("generation: model.generate", lambda: policy.generate(input_ids=queries, attention_mask=mask,
                                                               generation_config=gen)),
        ("generation: decode loop (ppo.generate)", lambda: ppo.generate(policy, tokenizer, queries, gen, [])),
        ("generation: decode loop, --compile", lambda: decode_compiled(queries, tokenizer)),
    ]
    rows, base = [], None
    for name, call in calls:
        if "--compile" in name and device.type == "cpu" and not cpu_compile:
            rows.append([name, "", "", "", "", "skipped on CPU: compiling takes minutes on a small CPU "
                                               "(--cpu-compile runs it)"])
            continue
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            with torch.no_grad(), ppo.autocast("bf16", device):
                times = []
                for _ in range(1 + size.repeats):
                    sync(device)
                    start = time.perf_counter()
                    call()
                    sync(device)
                    times.append(time.perf_counter() - start)
        except Exception as e:  # one failed row must not cost the rest of a scarce GPU run
            failures.append(f"--- {name}\n{traceback.format_exc()[-2500:]}")
            rows.append([name, "", "", "", "", f"failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}"])
            continue
        seconds = statistics.median(times[1:])
        base = seconds if name.endswith("model.generate") else base
        ratio = f", {base / seconds:.2f}x generate" if base else ""
        peak = f"{torch.cuda.max_memory_allocated(device) / 2**20:,.0f}" if device.type == "cuda" else "–"
        rows.append([name, f"{tokens / seconds:,.0f} tokens/s ({seconds:.3f} s{ratio})", f"{times[0]:.1f}", peak,
                     f"{sum(times):.1f}", "ok"])
    return rows


def script_row(name: str, cmd: list[str], out: Path, timeout_s: float, failures: list[str]) -> list[str]:
    """Run one script to completion and make its row: s/iter of its second iteration from metrics.jsonl, the first
    iteration's seconds, the peak memory the PEAK wrapper printed (single-process runs), the wall time."""
    start = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                         os.environ.get("PYTHONPATH")]))}
    try:
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        code, stderr, stdout = result.returncode, result.stderr, result.stdout
    except subprocess.TimeoutExpired as e:
        code, stderr, stdout = f"timed out after {timeout_s:.0f} s", str(e.stderr or ""), str(e.stdout or "")
    wall = time.perf_counter() - start
    if code != 0:
        failures.append(f"--- {name}: exit {code}\n{stderr[-2500:]}")
        lines = stderr.strip().splitlines() or ["(no output)"]
        last = next((x for x in reversed(lines) if re.search(r"Error|Exception|^error:", x)), lines[-1])
        return [name, "", "", "", f"{wall:.1f}", f"failed ({code}): {last.removeprefix('[rank0]: ')[:150]}"]
    rows = {r["iteration"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    first, per_iter = rows[1]["elapsed_s"], rows[2]["elapsed_s"] - rows[1]["elapsed_s"]
    peak = f"{float(stdout.split('PEAK_MIB')[-1].split()[0]):,.0f}" if "PEAK_MIB" in stdout else "–"
    return [name, f"{per_iter:.2f} s/iter", f"{first:.1f}", peak, f"{wall:.1f}", "ok"]


def step_times(folder: Path, size: Size, device: torch.device) -> str:
    """One decode step (eager, bf16 autocast) over a cache of the prompt and half the new tokens, median of 5, at the
    batch size and at a half, a quarter and an eighth of it."""
    from transformers import AutoModelForCausalLM, DynamicCache

    import ppo

    policy = ppo.disable_dropout(AutoModelForCausalLM.from_pretrained(folder).to(device)).eval()
    context, cells = size.prompt_len + size.new_tokens // 2, []
    for rows in (size.batch, size.batch // 2, size.batch // 4, max(size.batch // 8, 1)):
        ids = torch.randint(4, size.tokenizer_vocab, (rows, context), device=device)
        with torch.no_grad(), ppo.autocast("bf16", device):
            cache = DynamicCache(config=policy.config)
            policy(input_ids=ids, cache=cache, use_cache=True)
            times = []
            for _ in range(6):
                sync(device)
                start = time.perf_counter()
                policy(input_ids=ids[:, -1:], cache=cache, use_cache=True,
                       position_ids=torch.full((rows, 1), context, device=device))
                sync(device)
                times.append(time.perf_counter() - start)
                cache.crop(-1)  # back to `context` tokens
        cells.append(f"{rows} rows {1000 * statistics.median(times[1:]):.1f} ms")
    return f"one decode step over {context} tokens, bf16: " + ", ".join(cells)


def split_rows(folder: Path, size: Size, deadline: float, failures: list[str]) -> list[str]:
    """ppo.py and rloo.py grpo at the batch size and 4 times it (tiny: the batch size), 5 iterations each at uneven
    lengths (--stop-strings e: a random model's token holds an "e" now and then), under real_model.py's PROFILE: one
    row each."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import real_model

    rows = ["| run | s/iter | generation | scoring | no-grad passes | update: forward + backward | optimizer | rest | "
            "rest: output layer / step's other / loop's other | padded: decode / update | mean length | "
            "s per 1,000 tokens | peak memory (MB) |", "| --- " * 13 + "|"]
    for script, recipe in (("ppo.py", []), ("rloo.py", ["grpo"])):
        for batch in (size.batch, 4 * size.batch) if size != TINY else (size.batch,):
            out = Path(tempfile.mkdtemp(prefix=f"gpu_check_split_{script[:-3]}_"))
            cmd = [sys.executable, "-c", real_model.PROFILE, script, *recipe, "--model", str(folder), "--dataset",
                   str(folder / "prompts.jsonl"), "--reward-fn", f"{THIS}:length_reward", "--batch-size", str(batch),
                   "--total-episodes", str(5 * batch), "--max-new-tokens", str(size.new_tokens), "--stop-strings",
                   "e", "--dtype", "bf16", "--learning-rate", "1e-6", "--num-eval-prompts", "1", "--eval-every",
                   "100000", "--num-mini-batches", "1", *(["--num-ppo-epochs", "1"] if script == "ppo.py" else []),
                   "--output-dir", str(out)]
            name, left = f"{script}{' grpo' if recipe else ''}, batch {batch}", deadline - time.perf_counter()
            if left < 10:
                rows.append(f"| {name} | skipped: past the time budget (--budget-s) |")
                continue
            row = script_row(name, [sys.executable, "-c", PEAK, *cmd[1:]], out, min(size.timeout_s, left), failures)
            if row[-1] != "ok":
                rows.append(f"| {name} | {row[-1]} |")
                continue
            peak = float(row[3].replace(",", "")) if row[3] != "–" else 0.0
            rows.append(real_model.split_row(name, out / "splits.jsonl", peak))
    return rows


def script_rows(folder: Path, size: Size, device: torch.device, deadline: float, cpu_compile: bool,
                failures: list[str]) -> list[list[str]]:
    """Rows: ppo.py and rloo.py for 2 iterations in one process, then each under torchrun --nproc_per_node 1, then
    (on CPU only with cpu_compile) 12 iterations under --compile over prompts of 3 to prompt_len tokens, 24 new
    tokens, its status saying the decode shapes met; a run still going at `deadline` (time.perf_counter()) is
    stopped, and runs not started by then are skipped."""
    common = ["--model", folder, "--dataset", folder / "prompts.jsonl", "--reward-fn",
              f"{THIS}:length_reward", "--batch-size", size.batch, "--total-episodes", 2 * size.batch,
              "--max-new-tokens", size.new_tokens, "--dtype", "bf16", "--learning-rate", "1e-6",
              "--num-eval-prompts", "1", "--eval-every", "100000"]
    backend = "nccl" if device.type == "cuda" else "gloo"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    rows = []
    for script in ("ppo.py", "rloo.py"):
        for launcher, name, extra in [([sys.executable, "-c", PEAK], f"{script}, 1 process", []),
                                      ([sys.executable, "-c", PEAK], f"{script}, 1 process, --logits-chunk 0",
                                       ["--logits-chunk", "0"]),
                                      (torchrun, f"{script}, torchrun --nproc_per_node 1 ({backend})", []),
                                      ([sys.executable, "-c", PEAK], f"{script}, --compile, uneven prompts, 12 its",
                                       ["--compile", "--dataset", folder / "uneven.jsonl", "--max-new-tokens", "24",
                                        "--total-episodes", 12 * size.batch])]:
            if "--compile" in extra and device.type == "cpu" and not cpu_compile:
                rows.append([name, "", "", "", "", "skipped on CPU: compiling takes minutes (--cpu-compile runs it)"])
                continue
            out = Path(tempfile.mkdtemp(prefix=f"gpu_check_{script[:-3]}_"))
            cmd = [*launcher, script, *map(str, [*common, *extra]), "--output-dir", str(out)]
            left = deadline - time.perf_counter()
            if left < 10:
                rows.append([name, "", "", "", "", "skipped: past the time budget (--budget-s)"])
                continue
            rows.append(script_row(name, cmd, out, min(size.timeout_s * (3 if extra[:1] == ["--compile"] else 1), left),
                                   failures))
            if rows[-1][-1] == "ok" and "--compile" in extra:  # seconds of iterations 3-12: the compiling is done
                logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
                rows[-1][1] = f"{(logged[-1]['elapsed_s'] - logged[2]['elapsed_s']) / 10:.2f} s/iter (3-12)"
                rows[-1][-1] = f"ok, {logged[-1]['sampling/decode_shapes']:.0f} decode shapes"
            print(f"gpu_check: {' | '.join(rows[-1])}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    """Build the model, run every row, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny size, also on CUDA")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the model and prompts go (a temp folder)")
    parser.add_argument("--budget-s", type=float, default=460, help="script runs stop by this many seconds from the "
                        "start, so that the table prints within the GPU machine's 10-minute command limit")
    parser.add_argument("--cpu-compile", action="store_true", help="on CPU, run the --compile row too (minutes)")
    parser.add_argument("--only", choices=["generation", "scripts", "lengths"], help="only the generation rows, the "
                        "script runs, or the uneven-length tables (e.g. to rerun one part within a GPU lease)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import transformers

    transformers.utils.logging.disable_progress_bar()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        print("gpu_check: no CUDA device here, so the table below is the tiny size on CPU, not the GPU check",
              flush=True)
    size = TINY if args.tiny or device.type == "cpu" else FULL
    folder = args.work_dir or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    folder.mkdir(parents=True, exist_ok=True)
    start, failures = time.perf_counter(), []
    build(folder, size)
    built = time.perf_counter() - start
    print(f"gpu_check: model and prompts built in {built:.1f} s in {folder}", file=sys.stderr, flush=True)
    rows = generation_rows(folder, size, device, args.cpu_compile, failures) if args.only in (None, "generation") \
        else []
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the generation rows' cached blocks back: the script runs are other processes
    if args.only in (None, "scripts"):
        rows += script_rows(folder, size, device, start + args.budget_s, args.cpu_compile, failures)
    lengths = [step_times(folder, size, device), *split_rows(folder, size, start + args.budget_s, failures)] \
        if args.only in (None, "lengths") else []

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    memory = "peak GPU memory (MiB)" if device.type == "cuda" else "peak RSS (MiB)"
    print(f"\n{name}; torch {torch.__version__}, transformers {transformers.__version__}; Qwen2-shaped, hidden "
          f"{size.hidden}, {size.layers} layers, {size.heads} heads ({size.kv_heads} key/value), intermediate "
          f"{size.intermediate}, vocab {size.vocab:,} (tokenizer {size.tokenizer_vocab:,}); bf16 autocast; batch "
          f"{size.batch}, prompts of {size.prompt_len} tokens, {size.new_tokens} new tokens; "
          f"{time.perf_counter() - start:.0f} s in all\n")
    lines = [f"| run | speed | first call / iteration (s) | {memory} | wall (s) | status |",
             "| --- | --- | --- | --- | --- | --- |", *(f"| {' | '.join(r)} |" for r in rows)]
    print("\n".join(lines), flush=True)
    print("\n" + "\n".join(lengths), flush=True)
    failed = [r for r in rows if not r[-1].startswith(("ok", "skipped on CPU"))] + [r for r in lengths if "failed" in r]
    if failed:
        print("\n" + "\n".join(failures), file=sys.stderr)
        raise SystemExit(f"gpu_check: {len(failed)} of {len(rows)} rows failed")


if __name__ == "__main__":
    main()
