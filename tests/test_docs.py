"""The docs cannot rot: every command in README.md and docs/*.md runs, every numbered step comment of a script is
explained in its page with a link to its line, and every link into the code, the docs and the images resolves.

Each page's commands run in order in one fresh folder (so a later command can use an earlier run's output), after
the files the page shows with a title (```python title="my_rewards.py"```) are written there. Tiny settings are
appended to each command (they override the documented ones), hub ids are replaced by local stand-ins built from
config (nothing can be downloaded here), torchrun runs 2 processes on one machine, and the benchmarks that need TRL's
own virtual environment, take an hour, check out another commit or need a real model (vs_trl.py, before_after.py,
memory.py, real_model.py, grpo_family.py; tests/test_real_model.py runs real_model.py small) are
checked with --help: every flag the page uses must be one they take. The `python` commands of
the repository's scripts run in the test's process (conftest.run_main runs the script's __main__ block as `python`
would), except those with --track or --compile; those under torchrun, and a page's own files, get a process each.
"""

import json
import os
import random
import re
import shlex
import subprocess
import sys

import pytest

import ppo
from conftest import ROOT, run_main

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPT_PAGES = {"ppo.py": "ppo.md", "rloo.py": "rloo.md", "stepwise_prm.py": "stepwise_prm.md",
                "interleave.py": "interleave.md"}
RL_TINY = ["--total-episodes", "32", "--batch-size", "16", "--num-mini-batches", "2", "--num-ppo-epochs", "2",
           "--eval-every", "1", "--num-eval-prompts", "8"]
TINY = {
    "ppo.py": RL_TINY,
    "rloo.py": RL_TINY + ["--rloo-k", "2"],
    "stepwise_prm.py": ["--num-train-rows", "200", "--num-eval-rows", "40", "--best-of-n", "4", "--warmup-steps", "10",
                        "--total-steps", "4", "--batch-size", "16", "--eval-every", "2"],
    "stepwise_prm.py --dataset": ["--total-steps", "4", "--batch-size", "8", "--eval-every", "2",
                                  "--num-eval-rows", "8", "--learning-rate", "1e-3"],
    "interleave.py": ["--total-steps", "6", "--eval-every", "3", "--sft.batch-size", "8", "--rloo.batch-size", "8",
                      "--ppo.batch-size", "8", "--prm.batch-size", "8"],
    "examples/calculator.py": ["--sft-steps", "20", "--sft-batch-size", "16", "--ppo-iterations", "2", "--batch-size",
                               "8", "--num-mini-batches", "2", "--num-ppo-epochs", "1", "--num-eval-tasks", "8",
                               "--eval-every", "1"],
    "benchmarks/interleave_table.py": ["--seeds", "1", "--budget", "2"],
    "benchmarks/plot.py": [],
    "benchmarks/pack_widths.py": ["--model", "builtin", "--turns", "1"],  # the tiny model in place of SmolLM2
}
HELP_ONLY = {"benchmarks/vs_trl.py", "benchmarks/before_after.py", "benchmarks/memory.py", "benchmarks/real_model.py",
             "benchmarks/grpo_family.py"}
HUB_MODELS = {"Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-1.5B-Instruct",
              "Qwen/Qwen2.5-7B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "./my-sft-model"}
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", re.M | re.S)


def fenced(text: str) -> list[tuple[str, str, str]]:
    """(language, title or "", body) of each fenced block."""
    out = []
    for lang, info, body in FENCE.findall(text):
        title = re.search(r'title="([^"]+)"', info)
        out.append((lang, title.group(1) if title else "", body))
    return out


def page_commands(text: str) -> list[list[str]]:
    """The `python ...` and `torchrun ...` lines of the page's bash blocks, split into words, comments dropped."""
    return [shlex.split(line, comments=True) for lang, _, body in fenced(text) if lang in ("bash", "sh")
            for line in body.splitlines() if re.match(r"(python|torchrun) ", line.strip())]


def page_files(text: str) -> dict[str, str]:
    return {title: body for _, title, body in fenced(text) if title}


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, str]:
    """Local stand-ins for the hub ids and placeholder paths the pages use, built from config."""
    import torch
    from transformers import AutoModelForSequenceClassification

    import stepwise_prm

    root = tmp_path_factory.mktemp("stand_ins")
    tokenizer = ppo.build_tokenizer()
    torch.manual_seed(0)
    policy = ppo.build_tiny_model(tokenizer)
    policy.config.max_position_embeddings = 4096  # room for the documented lengths
    policy.save_pretrained(root / "lm")
    tokenizer.save_pretrained(root / "lm")
    config = policy.config
    config.num_labels = 1
    AutoModelForSequenceClassification.from_config(config).save_pretrained(root / "rm")
    tokenizer.save_pretrained(root / "rm")
    posts = ["my cat knocks cups off the table every morning", "we moved to a new city and I miss my old friends"]
    (root / "tldr.jsonl").write_text("".join(json.dumps({"prompt": f"POST: {p}\nTL;DR:"}) + "\n" for p in posts * 4))
    rng = random.Random(0)
    (root / "steps.jsonl").write_text("".join(json.dumps(stepwise_prm.multistep_row(rng)) + "\n" for _ in range(40)))
    return {**{m: str(root / "lm") for m in HUB_MODELS}, "./rm": str(root / "rm"),
            "trl-lib/tldr": str(root / "tldr.jsonl"), "trl-lib/math_shepherd": str(root / "steps.jsonl")}


def tiny_command(words: list[str], stand_ins: dict[str, str]) -> tuple[list[str], str]:
    """The command as the test runs it (stand-ins in, tiny settings appended), and the script it runs."""
    words = [stand_ins.get(w, w) for w in words if w != "..."]
    i = next(i for i, w in enumerate(words) if w.endswith(".py"))
    launcher, script, args = words[1:i], words[i], words[i + 1:]
    if words[0] == "torchrun":  # 2 processes on this machine
        swap = {"--nproc_per_node": "2", "--nnodes": "1", "--rdzv-endpoint": "localhost:29517"}
        launcher = ["-m", "torch.distributed.run", *(swap.get(launcher[j - 1], w) if j else w
                                                       for j, w in enumerate(launcher))]
    path = str(ROOT / script) if (ROOT / script).exists() else script
    if script in HELP_ONLY:
        return [sys.executable, path, "--help"], script
    key = f"{script} --dataset" if script == "stepwise_prm.py" and "--dataset" in args else script
    return [sys.executable, *launcher, path, *args, *TINY.get(key, [])], script


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_runs(page, tmp_path, stand_ins):
    text = page.read_text()
    for name, body in page_files(text).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    if page.name == "README.md":  # the README's examples use the files docs/custom.md shows
        for name, body in page_files((ROOT / "docs" / "custom.md").read_text()).items():
            if not (tmp_path / name).exists():
                (tmp_path / name).write_text(body)
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # as from the repository: --reward-fn examples/...
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    helps = {}  # a help-only script's --help, run once per page
    for words in page_commands(text):
        cmd, script = tiny_command(words, stand_ins)
        if script in helps:
            result = helps[script]
        elif words[0] == "python" and (ROOT / script).exists() and not {"--track", "--compile"} & set(words):
            result = run_main(script, *cmd[2:], cwd=tmp_path)  # as the process would, without 6 s of imports
        else:
            result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{' '.join(words)}\n-> {' '.join(cmd)}\n{result.stderr[-3000:]}"
        if script in HELP_ONLY:
            helps[script] = result
            for flag in (w.split("=")[0] for w in words if w.startswith("--")):
                assert flag in result.stdout, f"{' '.join(words)}: {script} takes no {flag}"


def test_pages_have_commands():
    for page in PAGES:
        assert page_commands(page.read_text()), f"{page.name} shows no command"


@pytest.mark.parametrize("script", list(SCRIPT_PAGES))
def test_every_numbered_step_is_explained_with_a_link_to_its_line(script):
    page = (ROOT / "docs" / SCRIPT_PAGES[script]).read_text()
    lines = (ROOT / script).read_text().splitlines()
    steps = {int(m.group(1)): n for n, line in enumerate(lines, 1) if (m := re.match(r"\s*# (\d+)\. ", line))}
    assert sorted(steps) == list(range(1, len(steps) + 1)), f"{script}: steps {sorted(steps)}"
    items = {int(m.group(1)): m.group(2) for m in re.finditer(r"^(\d+)\. (.*(?:\n(?!\d+\. |\n).*)*)", page, re.M)}
    for k, line in steps.items():
        assert k in items, f"docs/{SCRIPT_PAGES[script]}: no item {k}. for {script}:{line}"
        assert f"../{script}#L{line}" in items[k], \
            f"docs/{SCRIPT_PAGES[script]} item {k}. must link to ../{script}#L{line}: {lines[line - 1].strip()}"


def test_links_resolve():
    for page in [*PAGES, ROOT / "benchmarks" / "README.md"]:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve()
            assert file.exists(), f"{page.name}: {target} does not exist"
            if anchor.startswith("L"):
                n = int(anchor[1:].split("-")[0])
                assert 1 <= n <= len(file.read_text().splitlines()), f"{page.name}: {target} is past the file's end"


def test_a_link_to_a_script_line_says_that_line_and_holds_what_it_names():
    """[`name`, ppo.py#L120](../ppo.py#L120): a line that the label names is the target's, and `name` stands on it."""
    for page in [*PAGES, ROOT / "benchmarks" / "README.md"]:
        for label, path, lines in re.findall(r"\[([^\]]*)\]\(([\w./]+\.py)#(L\d+(?:-L\d+)?)\)", page.read_text()):
            link = f"{page.name}: [{label}]({path}#{lines})"
            said = re.search(r"(\w+\.py)#(L\d+(?:-L\d+)?)", label)
            assert said is None or said.groups() == (path.rsplit("/", 1)[-1], lines), link
            name = re.match(r"`(\w+)`", label)
            if name:
                text = (page.parent / path).read_text().splitlines()[int(lines[1:].split("-")[0]) - 1]
                assert name.group(1) in text, f"{link} is on {text.strip()!r}"


def test_benchmarks_index_names_every_script_once_and_its_commands_run():
    """benchmarks/README.md: one row per script (at most 8) or helper, each file of the folder once, and every flag of
    a script's command one its --help lists."""
    index = (ROOT / "benchmarks" / "README.md").read_text()
    rows = re.findall(r"^\| \[`(\w+\.py)`\]\(\1\) \|(.*)$", index, re.M)
    names = [name for name, _ in rows]
    assert sorted(names) == sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")), names
    scripts = {name: cells for name, cells in rows if "`python benchmarks/" in cells}
    assert 1 <= len(scripts) <= 8, list(scripts)
    for name, cells in scripts.items():
        commands = re.findall(r"`(python benchmarks/[^`]+)`", cells)
        flags = {w for c in commands for w in c.split() if w.startswith("--")}
        flags |= set(re.findall(r"`(--[\w-]+)`", cells))
        result = run_main(f"benchmarks/{name}", "--help")  # argparse's help, in this process
        assert result.returncode == 0, f"{name} --help: {result.stderr[-2000:]}"
        assert all(f"benchmarks/{name}" in c for c in commands), commands
        assert not [f for f in flags if f not in result.stdout], f"{name} takes no {flags - set(result.stdout.split())}"


def test_plot_script_draws_the_curves(tmp_path):
    rows = [{"iteration": i, "episode": 16 * i, "task/accuracy": i / 10, "objective/kl": 0.01 * i} for i in range(10)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plot.py"), str(tmp_path / "metrics.jsonl"),
                             "--keys", "task/accuracy", "objective/kl", "--out", str(tmp_path / "c.png")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
