"""Our PPO and RLOO iterations before and after a change, on vs_trl.py's settings, iteration by iteration in turn.

The scripts of an earlier commit (checked out with `git worktree` into a temporary folder) and of this checkout run
as two processes at once that take turns: one runs an iteration while the other waits at its last `log_row`, then
the other runs one, and so on. So each pair of iterations is seconds apart and the machine's drift, which moves a
whole run by 10-20% on this project's shared CPU, hits both sides alike. Each side's figure is the median of its
iterations' seconds after warm-up (waits not counted); "paired" is the median of the after / before ratios of the
iterations taken in turn. Used for "no slower than before" checks. With --bf16-gain, four
processes take turns (each commit in fp32 and in bf16), and the figure compared is the bf16 gain, fp32 / bf16 s/iter:
"paired" is then the median of after's gain / before's gain at each turn.

    python benchmarks/before_after.py --before c120fc9
    python benchmarks/before_after.py --before HEAD~3 --only rloo --iterations 40
    python benchmarks/before_after.py --before 28ab30d --dtype bf16 --only ppo --only prm   # bf16's attention kernel
    python benchmarks/before_after.py --before c120fc9 --bf16-gain --only ppo   # fp32 / bf16, before and after
    python benchmarks/before_after.py --before e91594c --real-lengths benchmarks/.cache/real_model/SmolLM2-135M-Instruct
    python benchmarks/before_after.py --before caea705 --decode 8   # the decode loop alone, eager and compiled
    python benchmarks/before_after.py --before cd90045 --shape reasoning \
        --real-lengths benchmarks/.cache/real_model/SmolLM2-135M-Instruct   # 150-250 prompt tokens, 8 x 256 new

--real-lengths times one process's generation and update on the same batch at real lengths instead: SmolLM2's 32
replies of up to 128 tokens to "Think step by step" sums (real_model.py --real-lengths' task), sampled by each
commit's decode_loop from the same seed, then one update on the same batch (before's samples) from the same weights,
both commits' functions in turn: rloo_step with the grpo settings (default), or with --only ppo, ppo_step with one
epoch of one mini-batch.
"""

import argparse
import dataclasses
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import artifacts  # noqa: E402
import vs_trl  # noqa: E402


def times_in_turn(algo: str, sides: list[tuple[str, str, Path]], iterations: int, art: Path, tmp: str) -> list:
    """Each side's (a name, its dtype, its checkout) iteration seconds after warm-up, all sides taking turns."""
    commands = []
    for name, dtype, root in sides:
        cmd, _ = vs_trl.our_command(algo, iterations, art, dtype, False)
        cmd[cmd.index("--output-dir") + 1] = str(Path(tmp) / f"{algo}_{name}")
        commands.append((cmd, root))
    return [t[vs_trl.WARMUP:-1] for t in vs_trl.in_turn(commands, Path(tmp))]  # the last iteration evaluates


def both_sides(before: Path, algo: str) -> list:
    """The script `algo` of the earlier commit and of this checkout, imported side by side in this process."""
    import importlib.util

    modules = []
    for name, root in (("before", before), ("after", ROOT)):
        spec = importlib.util.spec_from_file_location(f"{algo}_{name}", root / f"{algo}.py")
        modules.append(importlib.util.module_from_spec(spec))
        sys.modules[spec.name] = modules[-1]  # dataclasses look their module up
        spec.loader.exec_module(modules[-1])
    return modules


def decode_in_turn(before: Path, art: Path, prompt_tokens: int, turns: int = 15) -> None:
    """--decode: seconds of each commit's decode loop on the small preset (32 x 32 sampled tokens after prompts of
    `prompt_tokens`, EOS banned), eager and as --compile runs it (compile_models on a copy of the policy), the four
    paths in turn after a warm-up each; medians, and the median of the after / before ratios of each turn."""
    import copy
    import time

    import torch

    torch.set_num_threads(2)
    sides = both_sides(before, "ppo")
    policy = sides[1].disable_dropout(sides[1].AutoModelForCausalLM.from_pretrained(art / "policy"))
    queries = torch.randint(3, 4096, (32, prompt_tokens), generator=torch.Generator().manual_seed(0))
    paths = {}
    for side, module in zip(("before", "after"), sides):
        gen = module.GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=32,
                                      min_new_tokens=32, pad_token_id=0, eos_token_id=2)
        compiled, compiled_gen = copy.deepcopy(policy), copy.deepcopy(gen)
        module.compile_models(True, [compiled], [compiled_gen], torch.device("cpu"))
        paths[side, "eager"] = lambda m=module, g=gen: m.decode_loop(policy, queries, torch.ones_like(queries), g)
        paths[side, "compiled"] = lambda m=module, c=compiled, g=compiled_gen: m.decode_loop(
            c, queries, torch.ones_like(queries), g)
    times = {key: [] for key in paths}
    for fn in paths.values():
        torch.manual_seed(0)
        fn()  # warm-up (compiled: the compiling)
    for _ in range(turns):
        for key, fn in paths.items():
            torch.manual_seed(0)
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    print(f"decode loop, 32 x 32 sampled tokens after {prompt_tokens}-token prompts; seconds, medians of {turns} "
          "turns\n| path | before | after | after / before | paired after / before (quartiles) |\n"
          "| --- | --- | --- | --- | --- |")
    for path in ("eager", "compiled"):
        b, a = times["before", path], times["after", path]
        q1, q2, q3 = statistics.quantiles([y / x for x, y in zip(b, a)], n=4)
        print(f"| {path} | {statistics.median(b):.3f} | {statistics.median(a):.3f} | "
              f"{statistics.median(a) / statistics.median(b):.3f} | {q2:.3f} ({q1:.3f}-{q3:.3f}) |", flush=True)


REASONING_SYSTEM = (
    "You are a careful assistant that solves word problems. First think about the problem step by step inside "
    "<think> </think> tags: restate what is given, name each quantity, write each operation on its own line with "
    "its result, and check the result against the question before you go on. Then give only the final number "
    "inside <answer> </answer> tags, with no units and no other words. If the problem gives more numbers than it "
    "needs, say which ones you use and why. If a step could be done in more than one way, pick the shortest one "
    "and say so. Keep the reasoning short, plain and in full sentences, and never skip the check at the end.")
FILLER = ["On the way, the shop on the corner was closed for the holiday, so nothing was bought there.",
          "The weather was cold and windy, and the children wore their new coats all afternoon.",
          "Nobody counted the pencils in the drawer, which have nothing to do with this question.",
          "Later that week, a neighbour came to visit and stayed for a cup of tea and some biscuits.",
          "The numbers in the notebook were written in blue ink and underlined twice for clarity."]


def batch_of(shape: str, tokenizer) -> tuple:
    """(queries, their mask) [P x k, Lq] and k: 'sums', 8 chat sums x 4 (real_model.py --real-lengths' task), or
    'reasoning', 4 word problems of 150-250 prompt tokens (a system prompt and a question) x 8."""
    import random

    if shape == "sums":
        texts, k = [[{"role": "user", "content": f"What is {a}+{b}? Think step by step, then give the final answer."}]
                    for a, b in [(17, 25), (31, 48), (22, 39), (45, 16), (28, 33), (11, 47), (36, 24), (40, 19)]], 4
    else:
        rng, texts, k = random.Random(0), [], 8
        for extra in (0, 1, 2, 3):  # sentences of filler: prompts of about 190-250 tokens
            a, b, c = rng.randrange(10, 90), rng.randrange(10, 90), rng.randrange(2, 9)
            story = [f"Mia had {a} stickers.", *rng.sample(FILLER * 2, extra), f"She bought {b} more and then "
                     f"shared them equally with {c} friends, keeping none.", "How many stickers did each friend get?"]
            texts.append([{"role": "system", "content": REASONING_SYSTEM},
                          {"role": "user", "content": " ".join(story)}])
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in texts]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return batch.input_ids.repeat_interleave(k, 0), batch.attention_mask.repeat_interleave(k, 0), k


def same_batch(before: Path, model: Path, algo: str, shape: str = "sums", turns: int = 3) -> None:
    """--real-lengths: seconds of the decode loop and of one update (rloo_step with the grpo settings, or ppo_step
    with one epoch of one mini-batch) on one batch, each commit's in turn; of the update, its forwards with gradients
    and their backward apart; the positions the update's forwards compute."""
    import copy
    import time

    import torch

    torch.set_num_threads(2)
    modules = both_sides(before, algo)
    tokenizer, policy = modules[1].load_policy(str(model), False)
    policy = modules[1].disable_dropout(policy).eval().requires_grad_(False)  # the reference, and every update's start
    queries, mask, k = batch_of(shape, tokenizer)
    new_tokens = 128 if shape == "sums" else 256
    rewards = torch.randn(len(queries), generator=torch.Generator().manual_seed(0))
    common = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    parts = ("generation", "update", "update: forward + backward", "positions")
    times = {(side, part): [] for side in ("before", "after") for part in parts}
    responses, backward, clock = None, torch.Tensor.backward, {}

    def timed_backward(self, *a, **kw):
        start = time.perf_counter()
        backward(self, *a, **kw)
        clock["train"] = clock.get("train", 0.0) + time.perf_counter() - start

    def pre(module, args, kw):
        clock["start"] = time.perf_counter()
        if torch.is_grad_enabled():
            clock["positions"] = clock.get("positions", 0) + kw["input_ids"].numel()

    def post(module, args, kw, output):
        if torch.is_grad_enabled():
            clock["train"] = clock.get("train", 0.0) + time.perf_counter() - clock["start"]

    for _ in range(turns):
        for side, module in zip(("before", "after"), modules):
            sample, _ = module.generation_configs(module.GenArgs(max_new_tokens=new_tokens), tokenizer, 1.0)
            torch.manual_seed(0)
            start = time.perf_counter()
            ids = module.decode_loop(policy, queries, mask, sample)[0]
            times[side, "generation"].append(time.perf_counter() - start)
            responses = ids if responses is None else responses  # the update's batch: the first one sampled
            trained = copy.deepcopy(policy).train().requires_grad_(True)
            value = None
            if algo == "ppo":  # the value model: the policy under a fresh head, seeded
                torch.manual_seed(0)
                value = module.disable_dropout(module.token_classifier_from(policy, 1, "--model", "")).train()
            optimizer = module.adamw([trained] + ([value] if value is not None else []), 2e-5, 0.0)
            hooks = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in filter(None, (trained, value))]
            hooks += [m.register_forward_hook(post, with_kwargs=True) for m in filter(None, (trained, value))]
            clock.clear()
            torch.Tensor.backward = timed_backward
            start = time.perf_counter()
            if algo == "ppo":
                module.ppo_step(trained, value, policy, optimizer, queries, responses, rewards,
                                hp=module.PPOHParams(num_ppo_epochs=1, num_mini_batches=1), **common)
            else:
                named = getattr(module, "named_config", None)  # a commit before named_config: RECIPES held makers
                grpo = named("grpo") if named else module.RECIPES["grpo"][1]()
                hp = dataclasses.replace(grpo.rloo, rloo_k=k)
                module.rloo_step(trained, policy, optimizer, queries, responses, rewards, hp=hp, **common)
            times[side, "update"].append(time.perf_counter() - start)
            torch.Tensor.backward = backward
            times[side, "update: forward + backward"].append(clock.get("train", 0.0))
            times[side, "positions"].append(clock.get("positions", 0))
            for hook in hooks:
                hook.remove()
            del trained, value, optimizer
    valid = modules[1].response_valid_mask(responses, tokenizer.pad_token_id, tokenizer.eos_token_id)
    real = int(mask[::k].sum() + valid.sum())
    print(f"{algo}, {shape}: {len(queries) // k} prompts of {mask[::k].sum(1).min()}-{mask[::k].sum(1).max()} tokens "
          f"x {k} replies, mean {valid.sum(1).float().mean():.0f} of up to {responses.shape[1]} tokens; {real} real "
          f"tokens, each prompt once; seconds, medians of {turns} turns\n| part | before | after | after / before |"
          "\n| --- | --- | --- | --- |")
    for part in parts:
        b, a = (statistics.median(times[side, part]) for side in ("before", "after"))
        if part == "positions":
            print(f"| positions of the update's training forwards / real tokens | {b / real:.2f} | {a / real:.2f} | "
                  f"{a / b:.2f} |")
        else:
            print(f"| {part} | {b:.1f} | {a:.1f} | {a / b:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="c120fc9", help="the earlier commit")
    parser.add_argument("--only", choices=["ppo", "rloo", "prm"], action="append",
                        help="these rows only (default PPO and RLOO; PRM: seconds per step)")
    parser.add_argument("--iterations", type=int, default=20, help="iterations per side, taken in turn")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="both sides in this dtype")
    parser.add_argument("--bf16-gain", action="store_true",
                        help="the bf16 speed gain (fp32 / bf16) before and after: four processes taking turns")
    parser.add_argument("--real-lengths", type=Path, metavar="MODEL_FOLDER",
                        help="generation and one rloo_step on the same batch at real lengths (a SmolLM2 folder)")
    parser.add_argument("--shape", choices=["sums", "reasoning"], default="sums",
                        help="--real-lengths' batch: 8 chat sums x 4 replies of up to 128 tokens, or 4 word problems "
                             "of 150-250 prompt tokens (a system prompt and a question) x 8 replies of up to 256")
    parser.add_argument("--decode", type=int, metavar="PROMPT_TOKENS",
                        help="the decode loop alone, eager and compiled, on the small preset after prompts this long")
    args = parser.parse_args()
    if args.real_lengths and "prm" in (args.only or []):
        parser.error("--real-lengths --only prm: the real-length timing is of ppo.py's and rloo.py's updates")
    art = None if args.real_lengths else artifacts.build()
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before], check=True,
                       capture_output=True)
        try:
            if args.real_lengths:
                for algo in args.only or ["rloo"]:
                    same_batch(before, args.real_lengths.resolve(), algo, args.shape)
                return
            if args.decode:
                decode_in_turn(before, art, args.decode)
                return
            if args.bf16_gain:
                print(f"| bf16 gain (fp32 / bf16 s/iter) | before ({args.before}) | after (this checkout) "
                      "| after / before | paired after / before (quartiles) |")
            else:
                print(f"| {args.dtype} | before ({args.before}) s/iter | after (this checkout) s/iter "
                      "| after / before | paired after / before (quartiles) |")
            print("| --- | --- | --- | --- | --- |")
            for algo in args.only or ["ppo", "rloo"]:
                if args.bf16_gain:
                    sides = [(f"{side}_{dtype}", dtype, root) for side, root in (("before", before), ("after", ROOT))
                             for dtype in ("fp32", "bf16")]
                    b32, b16, a32, a16 = times_in_turn(algo, sides, args.iterations, art, tmp)
                    b = [x / y for x, y in zip(b32, b16)]  # the gain at each turn
                    a = [x / y for x, y in zip(a32, a16)]
                    cells = [f"{statistics.median(s32) / statistics.median(s16):.3f} ({statistics.median(s32):.3f} / "
                             f"{statistics.median(s16):.3f})" for s32, s16 in ((b32, b16), (a32, a16))]
                    ratio = (statistics.median(a32) / statistics.median(a16)) / (
                        statistics.median(b32) / statistics.median(b16))
                else:
                    b, a = times_in_turn(algo, [("before", args.dtype, before), ("after", args.dtype, ROOT)],
                                         args.iterations, art, tmp)
                    cells = [f"{statistics.median(b):.3f}", f"{statistics.median(a):.3f}"]
                    ratio = statistics.median(a) / statistics.median(b)
                q1, q2, q3 = statistics.quantiles([y / x for x, y in zip(b, a)], n=4)
                print(f"| {algo.upper()} | {cells[0]} | {cells[1]} | {ratio:.3f} | {q2:.3f} ({q1:.3f}-{q3:.3f}) |",
                      flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=True)


if __name__ == "__main__":
    main()
