"""The scripts stand alone, so some helpers are deliberate copies of ppo.py's. These tests keep the copies identical:
change one, change them all."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SHARED_WITH_RLOO = [
    "GenArgs", "TaskArgs", "BUILTIN_CHARS", "build_tokenizer", "build_tiny_model", "addition_prompt",
    "addition_eval_rows", "addition_reward", "multistep_problem", "multistep_prompt", "multistep_reward", "fail",
    "load_callable", "load_pretrained", "load_policy", "fp32_output_layer", "model_context", "check_task",
    "load_prompt_dataset", "check_rows", "render_prompt", "load_task", "draw_rows", "left_pad", "position_ids_from",
    "generation_configs", "off_policy_note",
    "cut_responses", "next_token", "cache_length", "decode_loop_unsupported", "CACHE_KWARG", "decode_step",
    "static_cache", "compiled_decode_step", "decode_loop", "stop_check", "print_once", "generate", "call_reward_fns",
    "reward_model_scores", "process_rewards", "rollout", "response_valid_mask", "world_size", "global_sum",
    "sync_gradients", "autocast", "step_or_skip", "masked_mean", "kl_penalty", "setup_distributed", "shard",
    "full_state_dict", "optimizer_state", "load_optimizer_state", "disable_dropout", "average_metrics",
    "refuse_dropout", "evaluate",
    "open_run", "log_row", "rng_states", "set_rng_states", "save_checkpoint", "find_checkpoint",
    "load_state",
]
SHARED_WITH_PRM = [
    "multistep_problem", "autocast", "BUILTIN_CHARS", "build_tokenizer", "build_tiny_model", "fail",
    "load_pretrained", "model_context", "world_size", "global_sum", "sync_gradients", "step_or_skip",
    "setup_distributed", "average_metrics", "open_run", "log_row", "rng_states", "set_rng_states", "save_checkpoint",
    "find_checkpoint", "load_state",
]
COPIES = {
    "rloo.py": SHARED_WITH_RLOO,
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
