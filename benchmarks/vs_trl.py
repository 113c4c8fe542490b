"""Side by side with TRL 1.12.0 on identical work, the bare compute underneath, and learning at equal episodes.

Settings: a Llama-shaped policy (4 layers, hidden 256, 4 heads, intermediate 1024) with a 4,096-token BPE
tokenizer trained offline; reward and value models of the same shape; 32 responses per iteration of exactly 32 new
tokens, temperature 1.0; PPO 4 epochs, 1 mini-batch, forward chunks of 32; RLOO 8 prompts x 4 samples, 1 epoch;
PRM batches of 16 rows of 3-4 arithmetic steps, max length 256. TRL is installed by this script into its own
virtual environment (benchmarks/.trl-venv), never into the project's.

    python benchmarks/vs_trl.py                         # the whole table, fp32 (about 5 minutes on 2 cores)
    python benchmarks/vs_trl.py --only ppo --dtype bf16 --rounds 1
    python benchmarks/vs_trl.py --learning --seeds 1 2   # RLOO on the built-in task against TRL's RLOOTrainer
    python benchmarks/vs_trl.py --only generation        # the generation line alone
    python benchmarks/vs_trl.py --only generation --prompt-tokens 16   # after 16-token prompts
    python benchmarks/vs_trl.py --lora-r 16 --rounds 1   # PPO and RLOO, both sides: full, LoRA r 16, + checkpointing
    python benchmarks/vs_trl.py --bf16-gain              # ours only: fp32 and bf16 taking turns, the bf16 speed gain

Each pair runs alternately (ours, TRL, ours, TRL, ...) so that machine noise hits both; per-iteration seconds are
medians after warm-up; peak memory is the peak resident set (VmHWM) of each side's training process.
"""

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import artifacts  # noqa: E402

import ppo  # noqa: E402

TRL_VENV = ROOT / "benchmarks" / ".trl-venv"
# peak resident set of the script's own process image (VmHWM); getrusage's ru_maxrss would also keep the peak of
# the process before exec: this benchmark's parent, models loaded, copied by fork
PEAK = ("import atexit, runpy, sys; atexit.register(lambda: print('PEAK_RSS_MB', next(int(l.split()[1]) for l in "
        "open('/proc/self/status') if l.startswith('VmHWM:')) / 1024)); sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')")
WARMUP = 2  # iterations dropped from each run before taking the median


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


def trl_python() -> str:
    """The TRL venv's python, created on first use."""
    python = TRL_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
        # requests: TRL 1.12's RLOO trainer imports it (its vLLM client) undeclared; tyro, peft: trl_side imports ppo.py
        subprocess.run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0", "trl==1.12.0", "requests",
                        "tyro==1.0.17", "peft==0.21.2"],
                       check=True)
    return str(python)


def run(cmd: list[str], env: dict | None = None, cwd: Path = ROOT) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=cwd)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])}... failed:\n{result.stderr[-3000:]}")
    return result.stdout


def our_command(algo: str, iterations: int, art: Path, dtype: str, compile_: bool, extra: tuple = ()) -> tuple:
    """Our script's arguments on the benchmark settings (plus `extra` flags), and the folder it writes to."""
    out = Path(f"/tmp/bench_ours_{algo}")
    common = ["--output-dir", str(out), "--learning-rate", "3e-6" if algo != "prm" else "1e-5", "--dtype", dtype]
    common += ["--compile"] if compile_ and algo != "prm" else []  # stepwise_prm.py takes no --compile
    rl = ["--model", art / "policy", "--reward-model", art / "reward", "--dataset", art / "prompts.jsonl",
          "--batch-size", "32", "--forward-batch-size", "32", "--max-new-tokens", "32", "--min-new-tokens", "32",
          "--temperature", "1.0", "--total-episodes", str(32 * iterations), "--eval-every", "100000",
          "--num-eval-prompts", "1"]
    if algo == "ppo":
        args = ["ppo.py", *rl, "--num-mini-batches", "1", "--num-ppo-epochs", "4"]
    elif algo == "rloo":
        args = ["rloo.py", *rl, "--rloo-k", "4", "--num-ppo-epochs", "1"]
    else:
        args = ["stepwise_prm.py", "--model", art / "policy", "--dataset", art / "prm.jsonl", "--batch-size", "16",
                "--max-length", "256", "--total-steps", str(iterations), "--eval-every", "100000",
                "--num-eval-rows", "16"]
    return [*map(str, args), *common, *extra], out


def ours(algo: str, iterations: int, art: Path, dtype: str, compile_: bool, extra: tuple = (),
         root: Path = ROOT) -> dict:
    """Run our script (the one in `root`: another checkout for before/after figures) on the benchmark settings (plus
    `extra` flags); per-iteration seconds from its metrics.jsonl."""
    args, out = our_command(algo, iterations, art, dtype, compile_, extra)
    shutil.rmtree(out, ignore_errors=True)  # a new run refuses a folder holding another's rows
    text = run([sys.executable, "-c", PEAK, *args], env={"HF_HUB_OFFLINE": "1"}, cwd=root)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:-1]  # no eval rows
    times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:])]
    tokens = [r["train/tokens"] for r in rows] if algo == "prm" else []
    return {"times": times, "peak_rss_mb": float(text.split("PEAK_RSS_MB")[-1]), "tokens": tokens}


def theirs(algo: str, iterations: int, art: Path, dtype: str, extra: tuple = ()) -> dict:
    """Run TRL's trainer (trl_side.py, in TRL's venv) on the benchmark settings, plus `extra` (--lora-r R,
    --gradient-checkpointing)."""
    cmd = [trl_python(), str(ROOT / "benchmarks" / "trl_side.py"), algo, str(iterations), str(art), *extra]
    text = run(cmd + (["--bf16"] if dtype == "bf16" else []))
    return json.loads(text.strip().splitlines()[-1])


def bare_compute(algo: str, art: Path, repeats: int = 5) -> float:
    """Seconds per iteration of the computation alone, in plain PyTorch: `generate` plus the forward and backward
    passes (and optimizer steps) the algorithm needs at the benchmark sizes."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    torch.manual_seed(0)
    policy = ppo.disable_dropout(AutoModelForCausalLM.from_pretrained(art / "policy"))
    ref = AutoModelForCausalLM.from_pretrained(art / "policy").eval()
    reward = AutoModelForSequenceClassification.from_pretrained(art / "reward").eval()
    value = ppo.disable_dropout(AutoModelForSequenceClassification.from_pretrained(art / "reward"))
    queries = torch.randint(3, 4096, (32, 8))
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=32, min_new_tokens=32,
                           pad_token_id=0, eos_token_id=2)
    params = [*policy.parameters(), *value.parameters()] if algo == "ppo" else list(policy.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-6)

    def iteration() -> None:
        if algo == "prm":
            ids = torch.randint(3, 4096, (16, 45))
            policy.model(input_ids=ids).last_hidden_state.sum().backward()
        else:
            with torch.no_grad():
                ids = policy.generate(input_ids=queries, attention_mask=torch.ones_like(queries),
                                      generation_config=gen)
                for model in ([policy, ref, value, reward] if algo == "ppo" else [policy, ref, reward]):
                    model(input_ids=ids)
            for _ in range(4 if algo == "ppo" else 1):
                loss = policy(input_ids=ids).logits.float().logsumexp(-1).mean()
                if algo == "ppo":
                    loss = loss + value(input_ids=ids).logits.mean()
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    iteration()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        iteration()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def generation_speed(art: Path, prompt_tokens: int = 8, repeats: int = 9) -> tuple[dict[str, float], float]:
    """Seconds for 32 x 32 sampled tokens after prompts of `prompt_tokens`, the same sampling on every path, medians of
    `repeats` runs taken in turn: model.generate; ppo.decode_loop eagerly, as ppo.generate runs it; and that loop as
    --compile runs it (the forward under torch.compile(dynamic=True), the one-token step compiled once, fullgraph and
    fixed shapes, over a static cache). Also the seconds that first compile took."""
    from transformers import AutoModelForCausalLM, CompileConfig, GenerationConfig

    policy = ppo.disable_dropout(AutoModelForCausalLM.from_pretrained(art / "policy"))
    compiled_policy = copy.deepcopy(policy)
    compiled_policy.forward = torch.compile(compiled_policy.forward, dynamic=True)
    queries = torch.randint(3, 4096, (32, prompt_tokens))
    mask = torch.ones_like(queries)
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=32, min_new_tokens=32,
                           pad_token_id=0, eos_token_id=2)
    compiled = copy.deepcopy(gen)
    compiled.compile_config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
    paths = {"model.generate": lambda: policy.generate(input_ids=queries, attention_mask=mask, generation_config=gen),
             "decode loop": lambda: ppo.decode_loop(policy, queries, mask, gen),
             "decode loop compiled": lambda: ppo.decode_loop(compiled_policy, queries, mask, compiled)}
    times = {name: [] for name in paths}
    with torch.no_grad():
        start = time.perf_counter()
        paths["decode loop compiled"]()
        compile_s = time.perf_counter() - start
        for fn in paths.values():
            fn()
        for _ in range(repeats):
            for name, fn in paths.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, compile_s


def learning(seeds: list[int], episodes: int) -> list[str]:
    """rloo.py against TRL's RLOOTrainer on the built-in addition task: the same random-init tiny model, prompts,
    reward function (ppo.addition_reward), k = 4, 256 responses per update, learning rate 1e-3 annealed linearly,
    KL coefficient 0.05 in the reward, 4 new tokens; greedy accuracy on the 100 fixed sums after `episodes`."""
    folder = artifacts.CACHE / "builtin_policy"
    if not (folder / "config.json").exists():
        tokenizer = ppo.build_tokenizer()
        torch.manual_seed(0)
        ppo.build_tiny_model(tokenizer).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    lines = ["| seed | episodes | rloo.py greedy accuracy | rloo.py seconds | TRL RLOOTrainer greedy accuracy | "
             "TRL seconds |", "| --- | --- | --- | --- | --- | --- |"]
    for seed in seeds:
        out = Path(f"/tmp/learn_ours_{seed}")
        shutil.rmtree(out, ignore_errors=True)
        run([sys.executable, "rloo.py", "--model", str(folder), "--learning-rate", "1e-3", "--max-new-tokens", "4",
             "--total-episodes", str(episodes), "--seed", str(seed), "--eval-every", "100000", "--output-dir",
             str(out)], env={"HF_HUB_OFFLINE": "1"})
        final = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        theirs_ = json.loads(run([trl_python(), str(ROOT / "benchmarks" / "trl_side.py"), "rloo-learn",
                                  str(episodes), str(folder), str(seed)]).strip().splitlines()[-1])
        lines.append(f"| {seed} | {episodes:,} | {final['task/accuracy']:.2f} | {final['elapsed_s']:.0f} | "
                     f"{theirs_['accuracy']:.2f} | {theirs_['seconds']:.0f} |")
        print(lines[-1], flush=True)
    return lines


def median_after_warmup(times_lists: list[list[float]]) -> float:
    return statistics.median([t for times in times_lists for t in times[WARMUP:]])


def lora_table(r: int, iterations: int, rounds: int) -> list[str]:
    """Our PPO and RLOO on the benchmark settings, and TRL's trainers with the same adapters (trl_side.py --lora-r):
    full fine-tuning, LoRA rank r, and LoRA rank r with activation checkpointing, all runs of a round in turn;
    s/iter (median after warm-up) and peak resident set (MB), each side's peak against its own full fine-tuning.
    TRL's configs default activation checkpointing on: here it is off but in the checkpointing column, as ours."""
    art = artifacts.build()
    variants = {"full": (), f"LoRA r {r}": ("--lora-r", str(r)),
                f"LoRA r {r} + checkpointing": ("--lora-r", str(r), "--gradient-checkpointing")}
    lines = ["| | " + " | ".join(f"{v} s/iter, peak MB" for v in variants) + " |", "| --- " * 4 + "|"]
    for algo in ("ppo", "rloo"):
        runs = {(side, v): [] for side in ("this repo", "TRL 1.12") for v in variants}
        for _ in range(rounds):
            for v, extra in variants.items():
                runs["this repo", v].append(ours(algo, iterations, art, "fp32", False, extra))
                trl_extra = extra if "--gradient-checkpointing" in extra else (*extra, "--no-gradient-checkpointing")
                runs["TRL 1.12", v].append(theirs(algo, iterations, art, "fp32", trl_extra))
        for side in ("this repo", "TRL 1.12"):
            cells, full_peak = [], max(m["peak_rss_mb"] for m in runs[side, "full"])
            for v in variants:
                seconds = median_after_warmup([m["times"] for m in runs[side, v]])
                peak = max(m["peak_rss_mb"] for m in runs[side, v])
                cells.append(f"{seconds:.3f}, {peak:.0f} ({peak / full_peak:.2f}x)")
            lines.append(f"| {algo.upper()}, {side} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    return lines


def bf16_gain(algos: list[str], iterations: int) -> list[str]:
    """Our scripts in fp32 and in bf16 (--dtype bf16) as two processes taking turns iteration by iteration (in_turn),
    so that the machine's drift hits both alike; s/iter medians after warm-up (PRM: s/step), the gain of the medians,
    and the median (quartiles) of the paired gains, fp32 / bf16 over each pair of iterations taken in turn."""
    art = artifacts.build()
    lines = ["| | fp32 s/iter | bf16 s/iter | bf16 gain (fp32 / bf16) | paired gain (quartiles) |",
             "| --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory() as tmp:
        for algo in algos:
            commands = []
            for dtype in ("fp32", "bf16"):
                cmd, _ = our_command(algo, iterations, art, dtype, False)
                cmd[cmd.index("--output-dir") + 1] = str(Path(tmp) / f"{algo}_{dtype}")
                commands.append((cmd, ROOT))
            a, b = (t[WARMUP:-1] for t in in_turn(commands, Path(tmp)))  # the last iteration evaluates
            q1, q2, q3 = statistics.quantiles([x / y for x, y in zip(a, b)], n=4)
            a_s, b_s = statistics.median(a), statistics.median(b)
            lines.append(f"| {algo.upper()} | {a_s:.3f} | {b_s:.3f} | {a_s / b_s:.2f}x | {q2:.2f}x ({q1:.2f}-{q3:.2f})"
                         " |")
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["ppo", "rloo", "prm", "generation"], action="append",
                        help="these rows only (the generation line always comes last)")
    parser.add_argument("--iterations", type=int, default=10, help="iterations per run")
    parser.add_argument("--prompt-tokens", type=int, default=8, help="the generation line's prompt length")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each side")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--compile", action="store_true", help="our scripts with --compile")
    parser.add_argument("--learning", action="store_true", help="only the learning comparison (RLOO, built-in task)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="seeds of the learning comparison")
    parser.add_argument("--episodes", type=int, default=64_000, help="episodes of the learning comparison")
    parser.add_argument("--bf16-gain", action="store_true",
                        help="only our scripts, fp32 and bf16 taking turns iteration by iteration (iterations x rounds "
                             "each): the bf16 speed gain")
    parser.add_argument("--lora-r", type=int, default=0,
                        help="only PPO and RLOO, both sides: full fine-tuning against LoRA adapters of this rank")
    args = parser.parse_args()
    if args.bf16_gain:
        print("\n".join(bf16_gain([a for a in args.only or ["ppo", "rloo", "prm"] if a != "generation"],
                                   args.iterations * args.rounds)))
        return
    if args.lora_r:
        print("\n".join(lora_table(args.lora_r, args.iterations, args.rounds)))
        return
    if args.learning:
        print("\n".join(learning(args.seeds, args.episodes)))
        return
    art = artifacts.build()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype}"
          f"{', --compile' if args.compile else ''}; artifacts in {art}")
    lines = ["| | this repo s/iter | TRL 1.12 s/iter | TRL / this | peak RSS this / TRL (MB) | bare compute s/iter "
             "| this / bare |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for algo in [algo for algo in args.only or ["ppo", "rloo", "prm"] if algo != "generation"]:
        mine, trl = [], []
        for _ in range(args.rounds):
            mine.append(ours(algo, args.iterations, art, args.dtype, args.compile))
            trl.append(theirs(algo, args.iterations, art, args.dtype))
        a, b = median_after_warmup([m["times"] for m in mine]), median_after_warmup([t["times"] for t in trl])
        bare = bare_compute(algo, art)
        rss = f"{max(m['peak_rss_mb'] for m in mine):.0f} / {max(t['peak_rss_mb'] for t in trl):.0f}"
        if algo == "prm":
            ours_tps = statistics.mean(x for m in mine for x in m["tokens"]) / a
            trl_tps = 16 * statistics.mean(trl[0]["tokens"]) / b
            lines.append(f"| PRM (non-pad tokens/s) | {ours_tps:,.0f} ({a:.3f} s/step) | {trl_tps:,.0f} ({b:.3f} "
                         f"s/step) | {ours_tps / trl_tps:.2f}x tokens/s | {rss} | {bare:.3f} | {a / bare:.2f} |")
        else:
            lines.append(f"| {algo.upper()} | {a:.3f} | {b:.3f} | {b / a:.2f}x | {rss} | {bare:.3f} | "
                         f"{a / bare:.2f} |")
        print(lines[-1], flush=True)
    seconds, compile_s = generation_speed(art, args.prompt_tokens)
    if len(lines) > 2:
        print("\n".join(lines))
    hf = seconds["model.generate"]
    print(f"\ngeneration, 32 x 32 sampled tokens after {args.prompt_tokens}-token prompts: " + "; ".join(
        f"{name} {s:.3f} s ({1024 / s:,.0f} tokens/s, {hf / s:.2f}x)" for name, s in seconds.items())
        + f"; compiling took {compile_s:.0f} s")


if __name__ == "__main__":
    main()
