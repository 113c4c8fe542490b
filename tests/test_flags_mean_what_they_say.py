"""Flags mean what they say, with no silent wrong result. Models that go through `model.generate`, --temperature 0 and
--learning-rate 0, the note for a sequence-level ratio with a token-weighted loss, and gpu_check.py's forward swap.
(The min/max reductions over processes: tests/test_checks_and_process_metrics.py; the KL under sampling filters:
tests/test_filtered_kl.py; samples.jsonl's order under torchrun: tests/test_distributed.py; the trl_rloo recipe
against TRL's RLOOTrainer: tests/test_grpo_family.py.)"""

import ast
import json

import pytest
import torch
from test_generation import PastKeyValuesLM

import ppo
import rloo
from conftest import ROOT, assert_one_line_error, run_main


def test_response_logprobs_of_a_model_without_a_cache_object_see_the_prompt():
    """Such a model (its forward takes `past_key_values`, not a cache object) forwarded with each prompt once and its
    responses packed after it scores the responses as if each prompt were forwarded k times: they see the prompt (a
    response pass that lost it was 0.27 nats off)."""
    tokenizer = ppo.build_tokenizer()
    torch.manual_seed(0)
    model = PastKeyValuesLM(ppo.build_tiny_model(tokenizer).config).eval()
    queries = ppo.left_pad([tokenizer("3+4=").input_ids, tokenizer("12+30=").input_ids], tokenizer.pad_token_id)
    responses = torch.randint(4, len(tokenizer), (4, 5))
    valid = torch.ones_like(responses, dtype=torch.bool)
    with torch.no_grad():
        query_mask = (queries != tokenizer.pad_token_id).cumsum(1) > 0
        once = rloo.response_logprobs(model, queries, query_mask, responses, valid, 1.0)[0]
        full_queries, full_mask = queries.repeat_interleave(2, 0), query_mask.repeat_interleave(2, 0)
        full = ppo.response_logprobs(model, full_queries, full_mask, responses, valid, 1.0)[0]
    torch.testing.assert_close(once, full, atol=1e-5, rtol=0)


def test_generate_samples_what_the_flags_say_not_the_models_generation_config(capsys):
    """A model that ships min_p 0.9 (and top_k 1) in its generation_config, sampled with no filter through
    `model.generate`, draws many first tokens, as the full softmax does (it drew 1); and the run is told once that
    the sampler's logprobs are unknown there."""
    tokenizer = ppo.build_tokenizer()
    torch.manual_seed(0)
    model = PastKeyValuesLM(ppo.build_tiny_model(tokenizer).config).eval()
    model.generation_config.min_p, model.generation_config.top_k = 0.9, 1
    sample, _ = ppo.generation_configs(ppo.GenArgs(max_new_tokens=1), tokenizer, 1.0)
    queries = torch.tensor([tokenizer("3+4=").input_ids] * 200)
    ppo.print_once.cache_clear()
    responses, _, _, sampler_logprobs, _ = ppo.generate(model, tokenizer, queries, sample, [])
    assert sampler_logprobs is None
    assert len(set(responses[:, 0].tolist())) > 10
    out = capsys.readouterr().out
    assert out.count("no sampling/* metrics, no --sampler-correction-cap") == 1, out


@pytest.mark.parametrize("script, flag", [("ppo.py", "--temperature"), ("rloo.py", "--temperature"),
                                          ("interleave.py", "--rloo.temperature")])
def test_temperature_zero_is_refused_at_start(script, flag, tmp_path):
    result = run_main(script, flag, "0", "--output-dir", tmp_path)
    assert_one_line_error(result, "--temperature" if script != "interleave.py" else flag, "must be > 0")
    assert not (tmp_path / "config.json").exists()  # refused before the run began


def test_learning_rate_zero_means_zero_and_a_sequence_ratio_with_a_token_loss_is_noted(tmp_path):
    """--learning-rate 0 trained at 1e-3 before (`or` took 0 for unset); gspo with --loss-type dapo says once that
    the per-response loss is weighed by length, as TRL warns."""
    result = run_main("rloo.py", "gspo", "--loss-type", "dapo", "--learning-rate", "0", "--total-episodes", "64",
                      "--batch-size", "32", "--num-mini-batches", "2", "--eval-every", "2", "--output-dir", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows[1:]] == [0.0, 0.0]
    assert result.stdout.count("note: --loss-type dapo with --importance-sampling-level sequence: each response's "
                               "one loss weighed by its length (GSPO: grpo; VESPO: token)") == 1
    torch.manual_seed(1)  # the run's seed: its initial weights
    initial = ppo.build_tiny_model(ppo.build_tokenizer()).state_dict()
    trained = ppo.AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    assert all(torch.equal(trained[k], v) for k, v in initial.items())


def test_gpu_check_uses_the_scripts_compile_path_and_swaps_no_forward():
    tree = ast.parse((ROOT / "benchmarks" / "gpu_check.py").read_text())
    swaps = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(t, ast.Attribute) and t.attr == "forward"]
    assert not swaps, f"gpu_check.py assigns a forward at lines {swaps}: use ppo.compile_models, --compile's path"
    calls = [node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute)]
    assert "compile_models" in calls
