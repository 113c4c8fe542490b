"""Shared test set-up: offline, real tiny models and tokenizers, and a helper that runs a script as a user would."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false",
                  WANDB_SILENT="true", TRANSFORMERS_VERBOSITY="error", HF_DATASETS_DISABLE_PROGRESS_BARS="1")


def run_script(script: str, *args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600,
               launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run `python <script> args...` (or `<launcher> <script> args...`) in a subprocess and return the result."""
    cmd = [*(launcher or [sys.executable]), str(ROOT / script), *map(str, args)]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=cwd or ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result: subprocess.CompletedProcess, flag: str, *words: str) -> str:
    """The run failed with exit code != 0, no traceback, and a last line naming the flag (and the given words)."""
    assert result.returncode != 0, result.stdout[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {flag}"), line
    for w in words:
        assert w in line, line
    return line


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama-shaped causal LM and the built-in character tokenizer, saved with save_pretrained."""
    import torch

    import ppo

    path = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = ppo.build_tokenizer()
    torch.manual_seed(0)
    ppo.build_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_prm_dir(tmp_path_factory) -> Path:
    """A tiny two-label token classifier with the built-in tokenizer, saved as stepwise_prm.py saves its PRMs."""
    import ppo

    path = tmp_path_factory.mktemp("tiny_prm")
    tokenizer = ppo.build_tokenizer()
    config = ppo.build_tiny_model(tokenizer).config
    config.num_labels = 2
    ppo.AutoModelForTokenClassification.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
