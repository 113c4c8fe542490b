"""stepwise_prm.py run as a user runs it: subprocesses with tiny settings, and every bad-input case."""

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForTokenClassification, AutoTokenizer

import stepwise_prm as prm
from conftest import assert_one_line_error, run_main, run_script

TINY = ["--num-train-rows", "200", "--num-eval-rows", "40", "--best-of-n", "4", "--warmup-steps", "10",
        "--total-steps", "4", "--batch-size", "16", "--eval-every", "2"]
TINY_DATA = ["--total-steps", "4", "--batch-size", "8", "--eval-every", "2", "--num-eval-rows", "8",
             "--learning-rate", "1e-3"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """Stepwise files: good ones (Math-Shepherd-shaped rows of the built-in task) and one per kind of bad row."""
    rng = random.Random(0)
    good = [prm.multistep_row(rng) for _ in range(40)]
    write_jsonl(tmp_path / "steps.jsonl", good)
    write_jsonl(tmp_path / "folder" / "train.jsonl", good[:32])
    write_jsonl(tmp_path / "folder" / "test.jsonl", good[32:])
    row = {"prompt": "1+1+1=", "completions": ["1+1=2", "2+1=3"]}
    write_jsonl(tmp_path / "mismatch.jsonl", [{**row, "labels": [True, True]}, {**row, "labels": [True]}])
    write_jsonl(tmp_path / "float_label.jsonl", [{**row, "labels": [0.7, 1.0]}])
    write_jsonl(tmp_path / "int_label.jsonl", [{**row, "labels": [1, 0]}])
    write_jsonl(tmp_path / "empty.jsonl", [{**row, "labels": [True, True]}] * 2 + [{**row, "completions": [],
                                                                                      "labels": []}])
    write_jsonl(tmp_path / "missing.jsonl", [{"prompt": "1+1=", "steps": ["1+1=2"], "labels": [True]}])
    (tmp_path / "steps.csv").write_text("prompt\n1+1=\n")
    return tmp_path


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_default_task_with_tiny_settings(tmp_path):
    result = run_main("stepwise_prm.py", *TINY, "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4]
    assert "warmup/loss" in rows[0]
    assert {"train/loss", "train/step_accuracy", "lr", "elapsed_s"} <= set(rows[1])
    evals = {"eval/step_accuracy", "eval/wrong_step_precision", "eval/wrong_step_recall", "eval/wrong_step_f1",
             "eval/solution_accuracy", "eval/best_of_n_accuracy", "eval/random_pick_accuracy"}
    assert evals <= set(rows[0]) and evals <= set(rows[2]) and evals <= set(rows[4]) and not evals & set(rows[3])
    assert all(0.0 <= rows[-1][k] <= 1.0 for k in evals)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["batch_size"] == 16
    model = AutoModelForTokenClassification.from_pretrained(tmp_path / "run" / "model")
    assert model.config.num_labels == 2 and model.config.id2label == {0: "wrong", 1: "correct"}
    assert "final held-out step accuracy" in result.stdout and "best-of-4" in result.stdout


def test_local_jsonl_with_a_model_folder_and_the_saved_prm_in_use(tmp_path, tiny_model_dir, data):
    result = run_main("stepwise_prm.py", "--model", tiny_model_dir, "--dataset", data / "steps.jsonl", *TINY_DATA,
                      "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["iteration"] == 4 and "eval/wrong_step_f1" in rows[-1] and "eval/best_of_n_accuracy" not in rows[-1]
    model = AutoModelForTokenClassification.from_pretrained(tmp_path / "run" / "model")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run" / "model")
    scores = prm.score_steps(model, tokenizer, "1+2+3=", ["1+2=3", "3+3=6"])
    assert len(scores) == 2 and all(0.0 <= s <= 1.0 for s in scores)


def test_built_in_model_on_a_file_with_fewer_correct_solutions_than_a_batch(tmp_path, data):
    result = run_main("stepwise_prm.py", "--dataset", data / "steps.jsonl", *TINY_DATA, "--batch-size", "32",
                      "--warmup-steps", "3", "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "warmup_lm" / "config.json").exists()


def test_dataset_folder_with_eval_split_last_step_only_truncation_and_accumulation(tmp_path, tiny_model_dir, data):
    result = run_main("stepwise_prm.py", "--model", tiny_model_dir, "--dataset", data / "folder", "--eval-split",
                      "test", "--train-on-last-step-only", "--max-length", "20", "--max-completion-length", "16",
                      "--gradient-accumulation-steps", "2", *TINY_DATA, "--output-dir", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_metrics(tmp_path / "run")[-1]["iteration"] == 4


def test_wandb_offline(tmp_path):
    result = run_script("stepwise_prm.py", *TINY, "--track", "--output-dir", tmp_path / "run",
                        env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_save_then_resume_gives_the_same_run(tmp_path):
    full = tmp_path / "full"
    args = [*TINY, "--save-every", "2", "--keep-checkpoints", "0"]
    result = run_main("stepwise_prm.py", *args, "--output-dir", full)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == ["iter_000002", "iter_000004"]
    # a second run folder holding what the first had after step 2: the checkpoint and the metrics rows so far
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "iter_000002", resumed / "checkpoints" / "iter_000002")
    (resumed / "metrics.jsonl").write_text("".join(line + "\n" for line in
                                                   (full / "metrics.jsonl").read_text().splitlines()[:3]))
    result = run_script("stepwise_prm.py", *args, "--output-dir", resumed, "--resume", "latest")
    assert result.returncode == 0, result.stderr[-3000:]
    strip = lambda rows: [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rows]  # noqa: E731
    assert strip(read_metrics(resumed)) == strip(read_metrics(full))
    a, b = load_file(full / "model" / "model.safetensors"), load_file(resumed / "model" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---- bad input: one line that names the flag, the value and the fix; exit code != 0; no traceback --------------------


@pytest.mark.parametrize("args, flag, words", [
    (["--dataset", "mismatch.jsonl"], "--dataset", ["row 1 ", "1 labels for 2 completions"]),
    (["--dataset", "float_label.jsonl"], "--dataset", ["row 0 ", "0.7", "not a boolean"]),
    (["--dataset", "int_label.jsonl"], "--dataset", ["row 0 ", "label 1,", "not a boolean"]),
    (["--dataset", "empty.jsonl"], "--dataset", ["row 2 ", "no completions"]),
    (["--dataset", "missing.jsonl"], "--dataset", ["['completions']", "['prompt', 'steps', 'labels']"]),
    (["--step-separator", "\t"], "--step-separator", ["cannot encode"]),
    (["--dataset", "steps.csv"], "--dataset", ["unknown file type"]),
    (["--dataset", "no_such_file.jsonl"], "--dataset", ["cannot load"]),
    (["--dataset", "steps.jsonl", "--eval-split", "test"], "--dataset", ["split 'test'"]),
    (["--dataset", "steps.jsonl", "--num-eval-rows", "40"], "--num-eval-rows", ["none to train on"]),
    (["--batch-size", "10", "--gradient-accumulation-steps", "4"], "--batch-size", ["divisible"]),
    (["--gradient-accumulation-steps", "0"], "--gradient-accumulation-steps", ["at least 1"]),  # not % 0
    (["--max-grad-norm", "0"], "--max-grad-norm", ["> 0"]),
    (["--model", "no/such-model-folder", "--warmup-steps", "0"], "--model", ["no/such-model-folder"]),
    (["--max-length", "1000"], "--max-length", ["context of 256"]),
    (["--resume", "no_such_checkpoint"], "--resume", ["not a checkpoint folder"]),
])
def test_bad_input_is_one_line(args, flag, words, data, tmp_path):
    result = run_main("stepwise_prm.py", *TINY, *args, "--output-dir", tmp_path / "run", cwd=data)
    assert_one_line_error(result, flag, *words)


def test_warm_start_is_refused_for_a_pretrained_model(tiny_model_dir, data, tmp_path):
    result = run_main("stepwise_prm.py", "--model", tiny_model_dir, "--dataset", "steps.jsonl", *TINY_DATA,
                      "--warmup-steps", "5", "--output-dir", tmp_path / "run", cwd=data)
    assert_one_line_error(result, "--warmup-steps", "needs none")
