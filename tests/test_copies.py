"""The scripts stand alone, so some helpers are deliberate copies of ppo.py's. These tests keep the copies identical:
change one, change them all; and each script's header names what it needs to run from the file alone."""

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

MARKER = "# Machinery below:"
# above the marker, what both RL scripts share: the flags' groups and the math both updates use
SHARED_ABOVE_MARKER = ["TaskArgs", "GenArgs", "MemoryArgs", "response_valid_mask", "masked_mean", "kl_penalty",
                       "token_logprobs"]  # the flags' groups, then the math helpers
# stepwise_prm.py's machinery: the subset of ppo.py's block it needs, copied definition by definition. Every other
# name the two files share is deliberately the script's own: Args (its flags), main (its loop) and evaluate (the
# PRM's held-out step metrics, not a policy's greedy decoding) and log_row (no completions to write).
SHARED_WITH_PRM = [
    "autocast", "BUILTIN_CHARS", "build_tokenizer", "build_tiny_model", "fail", "load_pretrained", "model_context",
    "world_size", "global_sum", "step_or_skip", "setup_distributed", "average_metrics", "open_run",
    "rng_states", "save_checkpoint", "find_checkpoint", "load_state", "MemoryArgs",
    "with_lora", "adamw", "load_weights", "load_optimizer_state",
]
COPIES = {
    "rloo.py": SHARED_ABOVE_MARKER,
    "stepwise_prm.py": SHARED_WITH_PRM,
}


def top_level_source(path: Path, name: str) -> str:
    """Source of the top-level function, class or assignment called `name` in a file."""
    text = path.read_text()
    for node in ast.parse(text).body:
        names = [node.name] if hasattr(node, "name") else [t.id for t in getattr(node, "targets", []) if
                                                            isinstance(t, ast.Name)]
        if name in names:
            decorators = "".join(ast.get_source_segment(text, d) + "\n" for d in getattr(node, "decorator_list", []))
            return decorators + ast.get_source_segment(text, node)
    raise AssertionError(f"{path.name} has no top-level {name}")


@pytest.mark.parametrize("script, name", [(s, n) for s, names in COPIES.items() for n in names])
def test_copy_is_identical_to_ppo(script, name):
    assert top_level_source(ROOT / script, name) == top_level_source(ROOT / "ppo.py", name), (
        f"{script}'s {name} differs from ppo.py's: keep the copies identical")


def machinery(path: Path) -> str:
    """Everything from the marker line to the end of the file."""
    text = path.read_text()
    lines = [i for i, line in enumerate(text.splitlines(keepends=True)) if line.startswith(MARKER)]
    assert len(lines) == 1, f"{path.name} needs exactly one line starting with {MARKER!r}"
    return "".join(text.splitlines(keepends=True)[lines[0]:])


def test_machinery_blocks_of_ppo_and_rloo_are_identical():
    ppo_block, rloo_block = machinery(ROOT / "ppo.py"), machinery(ROOT / "rloo.py")
    assert ppo_block.count("\n") > 300, "the machinery block is the loading, generation and run code"
    assert rloo_block == ppo_block, "rloo.py's machinery block differs from ppo.py's: keep them identical"


# (the marker's line, the whole file's lines) at most, as `wc -l` counts them
BUDGETS = {"ppo.py": (625, 1792), "rloo.py": (705, 1890), "stepwise_prm.py": (425, 915), "interleave.py": (None, 575)}


@pytest.mark.parametrize("script", BUDGETS)
def test_each_script_fits_its_line_budgets(script):
    """The reader's path (docstring, imports, config, the algorithm, main) ends at the marker within the line budget
    of the style guide, and the whole file within its own: a new feature pays for its lines."""
    marker_budget, file_budget = BUDGETS[script]
    text = (ROOT / script).read_text()
    if marker_budget is not None:
        above = text.split(f"\n{MARKER}")[0].count("\n") + 2  # the marker's own line number
        assert above <= marker_budget, f"{script}'s marker is on line {above}, past {marker_budget}: move machinery on"
    assert text.count("\n") <= file_budget, f"{script} has {text.count(chr(10))} lines, over its {file_budget}"


def test_every_definition_rloo_shares_with_ppo_is_guarded():
    """A definition in both scripts is either in the identical machinery block or on the guarded list above it,
    except those that are the script's own (its Args and its loop)."""
    def names(path: Path, text: str) -> set[str]:
        return {getattr(n, "name", None) or n.targets[0].id for n in ast.parse(text).body
                if hasattr(n, "name") or (isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name))}

    ppo_text, rloo_text = (ROOT / "ppo.py").read_text(), (ROOT / "rloo.py").read_text()
    above = names(ROOT / "ppo.py", ppo_text[:ppo_text.index(MARKER)]) & names(ROOT / "rloo.py",
                                                                             rloo_text[:rloo_text.index(MARKER)])
    assert above - {"Args", "main"} == set(SHARED_ABOVE_MARKER)


def config_fields(path: Path, cls: str) -> dict[str, str]:
    """Each field of a config dataclass: its declaration and the docstring under it, as source text."""
    text = path.read_text()
    body = next(n for n in ast.parse(text).body if getattr(n, "name", None) == cls).body
    fields = {}
    for stmt, after in zip(body, [*body[1:], None]):
        if isinstance(stmt, ast.AnnAssign):
            doc = ast.get_source_segment(text, after) if isinstance(after, ast.Expr) else ""
            fields[stmt.target.id] = ast.get_source_segment(text, stmt) + "\n" + doc
    return fields


# run-level flags that each script declares in its own way: its name, its default episodes, what a batch is (rloo.py:
# prompts x k samples), which models --fsdp shards
OWN_FIELDS = {"exp_name", "total_episodes", "batch_size", "fsdp"}


def test_run_flags_rloo_shares_with_ppo_are_declared_identically():
    ppo_fields, rloo_fields = config_fields(ROOT / "ppo.py", "Args"), config_fields(ROOT / "rloo.py", "Args")
    shared = (ppo_fields.keys() & rloo_fields.keys()) - OWN_FIELDS
    assert len(shared) >= 15, sorted(shared)
    for name in sorted(shared):
        assert rloo_fields[name] == ppo_fields[name], f"rloo.py's Args.{name} differs from ppo.py's"


# the run flags other scripts copy from ppo.py's Args word for word (declaration and docstring); their other flags
# of the same names differ on purpose (defaults, units: steps rather than episodes)
COPIED_FLAGS = {
    "stepwise_prm.py": ["anneal_lr", "keep_checkpoints", "output_dir", "resume", "track", "trust_remote_code",
                        "wandb_entity", "wandb_project"],
    "interleave.py": ["keep_checkpoints", "output_dir", "track", "trust_remote_code", "wandb_entity", "wandb_project"],
    "examples/calculator.py": ["track", "wandb_entity", "wandb_project"],
}


@pytest.mark.parametrize("script", COPIED_FLAGS)
def test_copied_run_flags_are_declared_as_in_ppo(script):
    ppo_fields, fields = config_fields(ROOT / "ppo.py", "Args"), config_fields(ROOT / script, "Args")
    for name in COPIED_FLAGS[script]:
        assert fields[name] == ppo_fields[name], f"{script}'s Args.{name} differs from ppo.py's"


def test_every_definition_stepwise_prm_shares_with_ppo_is_guarded():
    def names(text: str) -> set[str]:
        return {getattr(n, "name", None) or n.targets[0].id for n in ast.parse(text).body
                if hasattr(n, "name") or (isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name))}

    shared = names((ROOT / "ppo.py").read_text()) & names((ROOT / "stepwise_prm.py").read_text())
    assert shared - {"Args", "main", "evaluate", "log_row"} == set(SHARED_WITH_PRM)


def imported_packages(path: Path) -> set[str]:
    """Top-level names of the packages a file imports, anywhere in it (wandb is imported inside a function)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("script", ["ppo.py", "rloo.py", "stepwise_prm.py", "interleave.py"])
def test_each_script_header_names_the_pinned_packages_it_imports(script):
    """`uv run script.py` from the file: its PEP 723 header lists, at requirements.txt's pins, every package the file
    imports (interleave.py: and those of the scripts it imports, which must sit beside it), and nothing else."""
    text = (ROOT / script).read_text()
    block = re.search(r"^# /// script\n((?:#.*\n)*?)# ///$", text, re.M)
    assert block, f"{script} has no PEP 723 header"
    header = tomllib.loads("".join(line[2:] for line in block.group(1).splitlines(keepends=True)))
    pins = dict(line.split("==") for line in (ROOT / "requirements.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    siblings = {path.stem for path in ROOT.glob("*.py")}
    packages = imported_packages(ROOT / script)
    for sibling in packages & siblings:
        packages |= imported_packages(ROOT / f"{sibling}.py")
    third_party = packages - set(sys.stdlib_module_names) - siblings - {"__future__"}
    assert sorted(header["dependencies"]) == sorted(f"{name}=={pins[name]}" for name in third_party)
    assert header["requires-python"] == ">=3.11"
