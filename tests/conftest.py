"""Shared test set-up: offline, real tiny models and tokenizers, and a helper that runs a script as a user would."""

import contextlib
import io
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false",
                  WANDB_SILENT="true", TRANSFORMERS_VERBOSITY="error", HF_DATASETS_DISABLE_PROGRESS_BARS="1",
                  OMP_NUM_THREADS="1")  # one thread a test process, as in the processes the tests start: pytest -n 2


def run_script(script: str, *args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600,
               launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run `python <script> args...` (or `<launcher> <script> args...`) in a subprocess and return the result."""
    cmd = [*(launcher or [sys.executable]), str(ROOT / script), *map(str, args)]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=cwd or ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def run_killed_at(script: str, *args: str, checkpoint: Path) -> None:
    """Run `python <script> args...` and kill it with SIGKILL as soon as the checkpoint folder is written: a crash."""
    proc = subprocess.Popen([sys.executable, str(ROOT / script), *map(str, args)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not checkpoint.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"


def run_main(script: str, *args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the script's `if __name__ == "__main__":` block in this process, as `python <script> args...` runs it
    (the same sys.argv, working folder, environment, one thread, the script's folder first on sys.path), and return what
    run_script would: the exit code, stdout, and stderr ending with what Python prints when it exits, the message of
    SystemExit("...") (exit code 1) or the traceback of any other exception. For the bad-input tests, the docs'
    commands and short runs of one process, where a new process spends 6-9 s importing torch, transformers and peft
    (tests/test_cli.py checks that both ways end alike), and the runs that a resume is compared with or starts
    from; resumes, kills, torchrun, --compile, --track and remote code get processes.
    Modules imported from the run's folder (the user's reward files) are forgotten afterwards, so the next run imports
    its own."""
    import torch

    saved = sys.argv, sys.path[:], set(sys.modules), dict(os.environ), os.getcwd(), torch.get_num_threads()
    out, err, code = io.StringIO(), io.StringIO(), 0
    folder = Path(cwd or ROOT).resolve()
    try:
        os.chdir(folder)
        os.environ.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})  # as run_script's, for any child process
        os.environ.update({k: str(v) for k, v in (env or {}).items()})
        argv = sys.argv = [str(ROOT / script), *map(str, args)]
        sys.path[:0] = [str((ROOT / script).parent), str(ROOT)]  # as python and run_script's PYTHONPATH put them
        torch.set_num_threads(1)  # as run_script's OMP_NUM_THREADS=1
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(ROOT / script), run_name="__main__")
            except SystemExit as e:
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        sys.argv, sys.path[:] = saved[0], saved[1]
        os.environ.clear()
        os.environ.update(saved[3])
        os.chdir(saved[4])
        torch.set_num_threads(saved[5])
        for name in set(sys.modules) - saved[2]:
            file = getattr(sys.modules[name], "__file__", None)
            if folder != ROOT and file and Path(file).resolve().is_relative_to(folder):
                del sys.modules[name]
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


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


def assert_merged_is_base_plus_adapter(merged_dir: Path, base_dir: Path, adapter_dir: Path, auto_cls=None,
                                       ids=None, tol: float = 1e-4, **base_kwargs):
    """A LoRA run's saved pair agrees: the merged model (merged_dir) and the base (base_dir) with the adapter
    (adapter_dir) loaded through peft give the same logits within tol, and training moved them off the base's.
    Returns the merged model."""
    import copy

    import peft
    import torch
    from transformers import AutoModelForCausalLM

    auto_cls = auto_cls or AutoModelForCausalLM
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]]) if ids is None else ids
    merged = auto_cls.from_pretrained(merged_dir)
    base = auto_cls.from_pretrained(base_dir, **base_kwargs)
    adapted = peft.PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir)
    with torch.no_grad():
        logits = [m(input_ids=ids).logits for m in (merged, adapted, base)]
    assert (logits[0] - logits[1]).abs().max() < tol  # merged weights = base + adapters
    assert (logits[0] - logits[2]).abs().max() > 1e-4  # and training moved them off the base
    return merged
