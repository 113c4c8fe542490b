"""benchmarks/real_model.py on a tiny stand-in for SmolLM2 (nothing can be downloaded in a test): a Llama-shaped model
built from config with a character tokenizer that has a ChatML chat template. All three runs go through at the
smallest scale; the printed table agrees with each run's metrics.jsonl; the task data holds its promises (held-out
pairs never trained on, in either order) and the reward file scores as it says; the plot is written."""

import importlib.util
import json
import re
import string
import sys

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from conftest import ROOT, run_main

sys.path.insert(0, str(ROOT / "benchmarks"))
import real_model  # noqa: E402

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SCALE = 0.05  # rloo: 2560 x 0.05 = 128 episodes (4 iterations of 32); ppo: 1920 x 0.05 = 96 (3 iterations)
EPISODES = {"rloo": 128, "ppo": 96, "rloo-lora": 128}  # the default runs, in their order


def build_chat_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over the printable ASCII characters, with SmolLM2's special tokens (pad = eos =
    <|im_end|>) and a ChatML chat template, built offline with the `tokenizers` library."""
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate([*specials, *sorted(set(string.printable))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        pad_token="<|im_end|>", unk_token="<unk>")
    tokenizer.chat_template = CHATML
    return tokenizer


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    """A tiny Llama-shaped causal LM (random weights) and the chat tokenizer, saved as a model folder."""
    path = tmp_path_factory.mktemp("tiny_chat_llama")
    tokenizer = build_chat_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_benchmark_runs_end_to_end_on_a_tiny_model(tiny_chat_model, tmp_path):
    out, png = tmp_path / "runs", tmp_path / "real_model.png"
    result = run_main("benchmarks/real_model.py", "--model-folder", tiny_chat_model, "--out", out,
                      "--episodes-scale", SCALE, "--plot", png)  # the runs it starts are processes
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "it/s" not in result.stdout + result.stderr  # the runs' progress bars went to their logs
    lines = result.stdout.strip().splitlines()
    header = "| run | base accuracy | final accuracy | episodes | minutes | peak memory (MB) | final KL |"
    table = lines[lines.index(header) + 2:lines.index(header) + 2 + len(EPISODES)]
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in table)}
    assert list(rows) == list(EPISODES)
    for name, (base, final, episodes, minutes, peak, kl) in rows.items():
        metrics = read_rows(out / name / "metrics.jsonl")
        evals = [r for r in metrics if "task/accuracy" in r]
        assert evals[0]["iteration"] == 0 and evals[-1]["iteration"] == metrics[-1]["iteration"] > 0
        assert float(base) == pytest.approx(evals[0]["task/accuracy"], abs=5e-4)
        assert float(final) == pytest.approx(evals[-1]["task/accuracy"], abs=5e-4)
        assert 0 <= float(base) <= 1 and 0 <= float(final) <= 1
        assert int(episodes) == metrics[-1]["episode"] == EPISODES[name]
        assert float(kl) == pytest.approx(metrics[-1]["objective/kl"], abs=5e-5)
        assert float(minutes) > 0
        assert 100 < float(peak.replace(",", "")) < 50_000  # a Python process with torch: hundreds of MB
        assert "final task/accuracy" in (out / name / "log.txt").read_text()  # the script's last line
    config = json.loads((out / "rloo-lora" / "config.json").read_text())
    assert config["memory"]["lora_r"] == 16 and config["gen"]["max_new_tokens"] == real_model.MAX_NEW_TOKENS
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000

    # The task it wrote: 1,600 training and 200 held-out prompts, no held-out pair trained on in either order.
    train, test = read_rows(out / "data" / "train.jsonl"), read_rows(out / "data" / "test.jsonl")
    assert len(train) == real_model.NUM_TRAIN and len(test) == real_model.NUM_TEST

    def pair(row):
        words = row["prompt"][0]["content"].split()  # "What is a+b? Reply ..."
        a, b = map(int, words[2].rstrip("?").split("+"))
        assert row["answer"] == a + b and 10 <= min(a, b) and max(a, b) <= 49
        return a, b

    test_pairs = [pair(r) for r in test]
    assert len(set(test_pairs)) == len(test_pairs)
    assert not {pair(r) for r in train} & (set(test_pairs) | {(b, a) for a, b in test_pairs})

    # The reward file: 1.0 when the reply's last integer is the answer.
    spec = importlib.util.spec_from_file_location("reward", out / "data" / "reward.py")
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
    replies = ["46", "12 + 34 = 46", "12 + 34 = 48", "46, no: 47", "forty-six", "46.", ""]
    completions = [[{"role": "assistant", "content": text}] for text in replies]
    assert reward.score(None, completions, [46] * len(replies)) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def test_an_existing_model_folder_is_not_made_again(tiny_chat_model):
    assert real_model.make_model_folder(tiny_chat_model) == tiny_chat_model
    assert real_model.split_pairs() == real_model.split_pairs()  # a fixed seed: the same task every run


def test_the_table_takes_base_and_final_accuracy_from_the_first_and_last_evaluations():
    rows = [{"iteration": 0, "episode": 0, "elapsed_s": 0.0, "task/accuracy": 0.245},
            {"iteration": 1, "episode": 32, "elapsed_s": 16.0, "objective/kl": 0.01},
            {"iteration": 2, "episode": 64, "elapsed_s": 33.0, "objective/kl": 0.02, "task/accuracy": 0.42},
            {"iteration": 3, "episode": 96, "elapsed_s": 50.0, "objective/kl": 0.0312345}]
    lines = real_model.table({"rloo": {"rows": rows, "minutes": 1.44, "peak_mb": 4875.4}}).splitlines()
    assert lines[2] == "| rloo | 0.245 | 0.420 | 96 | 1.4 | 4,875 | 0.0312 |"


def test_vs_trl_runs_rloo_grpo_and_trl_grpotrainer_at_the_same_evaluation_points(tiny_chat_model, tmp_path):
    """--vs-trl at its smallest: 4 steps of 32 episodes a side. Without the TRL environment (a clean clone, CI) the
    TRL side is skipped in one line and our side still runs. --eval-num-samples 2 then gives pass@k of the base model
    and of our side's final model, rloo.py's own iteration-0 evaluation with nothing trained."""
    out, png = tmp_path / "runs", tmp_path / "vs_trl.png"
    result = run_main("benchmarks/real_model.py", "--vs-trl", "--model-folder", tiny_chat_model, "--out", out,
                      "--episodes-scale", SCALE, "--plot", png, "--eval-num-samples", "2")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    has_trl = (ROOT / "benchmarks" / ".trl-venv" / "bin" / "python").exists()
    lines = result.stdout.strip().splitlines()
    header = "| side | base accuracy | final accuracy | episodes | minutes | s/step (median) | peak memory (MB) |"
    sides = ["rloo-grpo", "trl-grpo"] if has_trl else ["rloo-grpo"]
    table = lines[lines.index(header) + 2:lines.index(header) + 2 + len(sides)]
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in table)}
    assert list(rows) == sides
    if not has_trl:
        assert any(line.startswith("trl-grpo: skipped, no TRL environment") for line in lines)
    config = json.loads((out / "rloo-grpo" / "config.json").read_text())
    assert config["rloo"]["loss_type"] == "grpo" and config["rloo"]["kl_coef"] == 0.04  # the grpo recipe
    evaluated = {}
    for name, (base, final, episodes, minutes, per_step, peak) in rows.items():
        metrics = read_rows(out / name / "metrics.jsonl")
        evals = [r for r in metrics if "task/accuracy" in r]
        evaluated[name] = [r["episode"] for r in evals]
        assert float(base) == pytest.approx(evals[0]["task/accuracy"], abs=5e-4)
        assert float(final) == pytest.approx(evals[-1]["task/accuracy"], abs=5e-4)
        assert int(episodes) == metrics[-1]["episode"] == 128
        steps = sorted(b["elapsed_s"] - a["elapsed_s"] for a, b in zip(metrics[1:], metrics[2:]))
        assert float(minutes) * 60 + 3 >= metrics[-1]["elapsed_s"]  # the whole run holds its training (0.05 min: 3 s)
        assert float(per_step) == pytest.approx(steps[len(steps) // 2], abs=6e-3)  # printed to 2 decimals
        assert 100 < float(peak.replace(",", "")) < 50_000
    assert len({tuple(e) for e in evaluated.values()}) == 1 and evaluated["rloo-grpo"] == [0, 128]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    header = "| model | greedy accuracy | pass@1 | pass@2 | maj@2 |"
    table = lines[lines.index(header) + 2:]
    assert [line.split("|")[1].strip() for line in table] == ["base", "rloo-grpo"]  # TRL's side saves no model
    for line, name in zip(table, ["base", "rloo-grpo"]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        first = read_rows(out / "pass_at_k" / name / "metrics.jsonl")[0]
        config = json.loads((out / "pass_at_k" / name / "config.json").read_text())
        assert config["learning_rate"] == 0 and config["task"]["eval_num_samples"] == 2
        assert cells[0] == name and first["iteration"] == 0
        expected = [first[k] for k in ("task/accuracy", "eval/pass@1", "eval/pass@2", "eval/maj@2")]
        assert [float(c) for c in cells[1:]] == pytest.approx(expected, abs=6e-4)  # printed to 3 decimals


@pytest.mark.parametrize("flags, refusal", [
    (["--runs", "trl-grpo"], "are --vs-trl's sides; add --vs-trl"),  # a side alone
    (["--vs-trl", "--runs", "ppo"], "with --vs-trl name its sides (rloo-grpo, trl-grpo) or none"),  # not a side
])
def test_runs_that_do_not_fit_vs_trl_are_refused_before_anything_is_made(flags, refusal, tmp_path):
    """Refused in one line that names the fix, before any model folder or task is made (--vs-trl --runs ppo used to
    run both sides)."""
    result = run_main("benchmarks/real_model.py", *flags, "--out", tmp_path / "runs")
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith(refusal), result.stderr
    assert not (tmp_path / "runs").exists()


def test_vs_trl_with_runs_none_runs_nothing(tiny_chat_model, tmp_path):
    """--vs-trl --runs none makes the task and runs no side (it used to run both)."""
    result = run_main("benchmarks/real_model.py", "--vs-trl", "--runs", "none", "--model-folder", tiny_chat_model,
                      "--out", tmp_path / "runs", "--plot", tmp_path / "png.png")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "running" not in result.stdout and (tmp_path / "runs" / "data" / "reward.py").exists()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["data"]


def test_real_lengths_splits_each_iteration_into_its_parts(tiny_chat_model, tmp_path):
    """--real-lengths at the tiny model's scale (replies of up to 128 tokens, 5 steps of 32 responses) for our two
    sides (TRL's need their own environments): a row each, whose parts add up to no more than its step, padded shares
    in [0, 1) read from the runs' splits, and one decode step timed at four batch sizes."""
    result = run_main("benchmarks/real_model.py", "--real-lengths", "--runs", "rloo-grpo", "ppo", "--model-folder",
                      tiny_chat_model, "--out", tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    header = lines.index(next(line for line in lines if line.startswith("| side | s/iter | generation |")))
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                               for line in lines[header + 2:header + 4])}
    assert list(rows) == ["rloo-grpo", "ppo"]
    for name, cells in rows.items():
        splits = read_rows(tmp_path / name / "splits.jsonl")
        assert [s["iteration"] for s in splits] == [0, 1, 2, 3, 4, 5]
        step, parts, rest = float(cells[0]), [float(c) for c in cells[1:6]], float(cells[6])
        assert step > 0 and all(x >= 0 for x in parts) and rest > -0.05 and abs(step - sum(parts) - rest) < 0.15
        output_layer, step_other, loop_other = map(float, cells[7].split(" / "))  # the rest, in three
        assert output_layer > 0 and abs(output_layer + step_other + loop_other - rest) < 0.15
        decode, update = map(float, cells[8].split(" / "))
        assert 0 <= decode < 1 and 0 <= update < 1 and 0 < int(cells[9]) <= real_model.LONG_NEW_TOKENS
        assert all(s["real_positions"] <= s["computed_positions"] for s in splits[1:])
    assert len(re.findall(r"\d+ rows \d+ ms", lines[-1])) == 4
