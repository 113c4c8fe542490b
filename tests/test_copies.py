"""The scripts stand alone, so some helpers are deliberate copies of ppo.py's. These tests keep the copies identical:
change one, change them all."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

MARKER = "# Machinery below:"
# above the marker, what both RL scripts share: their config groups and the math both updates use
SHARED_ABOVE_MARKER = ["GenArgs", "TaskArgs", "response_valid_mask", "masked_mean", "kl_penalty"]
# stepwise_prm.py's machinery: the subset of ppo.py's block it needs, copied definition by definition
SHARED_WITH_PRM = [
    "autocast", "BUILTIN_CHARS", "build_tokenizer", "build_tiny_model", "fail",
    "load_pretrained", "model_context", "world_size", "global_sum", "sync_gradients", "step_or_skip",
    "setup_distributed", "average_metrics", "open_run", "log_row", "rng_states", "set_rng_states", "save_checkpoint",
    "find_checkpoint", "load_state",
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
