"""The decode loop drops finished rows (--compact-below): the same tokens and logprobs as the whole batch stepping on
(the uniform draws are made for every row, each used by its own), eagerly and compiled, greedy still model.generate's;
and under FSDP a process whose rows have all ended keeps stepping (one finished row) until every process is done."""

import sys

import pytest
import torch
from transformers import CompileConfig, GenerationConfig

import ppo
from conftest import run_script

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def batch(rows: int = 16, prompt: int = 6) -> tuple:
    tokenizer = ppo.build_tokenizer()
    torch.manual_seed(0)
    model = ppo.build_tiny_model(tokenizer).eval()
    queries = torch.randint(4, len(tokenizer), (rows, prompt))
    mask = torch.ones_like(queries)
    mask[: rows // 4, :2] = 0  # some prompts left-padded
    return tokenizer, model, queries.masked_fill(mask == 0, tokenizer.pad_token_id), mask


def decode(model, queries, mask, compact: float, compiled: bool = False, **settings) -> tuple:
    gen = GenerationConfig(max_new_tokens=24, pad_token_id=0, eos_token_id=2, compact_below=compact,
                           **{"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, **settings})
    if compiled:
        torch._dynamo.reset()
        gen.compile_config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
    torch.manual_seed(5)
    return ppo.decode_loop(model, queries, mask, gen)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("settings", [{}, {"top_k": 5, "repetition_penalty": 1.3}], ids=["plain", "filtered"])
def test_dropping_finished_rows_gives_the_tokens_and_logprobs_of_the_whole_batch(compiled, settings):
    tokenizer, model, queries, mask = batch()
    whole, whole_logprobs, whole_steps = decode(model, queries, mask, 0.0, compiled, **settings)
    kept, kept_logprobs, kept_steps = decode(model, queries, mask, 0.9, compiled, **settings)
    assert torch.equal(kept, whole)
    assert (kept_logprobs - whole_logprobs).abs().max() < 1e-5
    lengths = (whole != tokenizer.pad_token_id).sum(1)
    assert lengths.min() < whole.shape[1] // 2  # rows end at different steps: there was something to drop
    assert whole_steps == whole.numel() and kept_steps < whole_steps  # fewer rows stepped, every token still made


def test_greedy_decoding_that_drops_rows_still_gives_model_generate_s_tokens():
    tokenizer, model, queries, mask = batch()
    ours = decode(model, queries, mask, 0.9, do_sample=False)[0]
    expected = model.generate(input_ids=queries, attention_mask=mask, generation_config=GenerationConfig(
        do_sample=False, max_new_tokens=24, pad_token_id=0, eos_token_id=2))[:, queries.shape[1]:]
    assert torch.equal(ours[:, :expected.shape[1]], expected)


def test_under_fsdp_a_process_whose_rows_all_ended_steps_on(tmp_path):
    """Rank 0's rows all stop after two tokens (a stop check), rank 1's run on: each forward of the sharded model is
    a collective, so rank 0 must keep stepping, on one finished row, until rank 1 is done (else the run hangs)."""
    out = tmp_path / "tokens.pt"
    result = run_script("tests/dist_decode.py", str(out), launcher=TORCHRUN, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = torch.load(out)
    for rank in (0, 1):
        assert torch.equal(saved[rank]["kept"], saved[rank]["whole"])
    assert (saved[0]["kept"][:, 2:] == 0).all() and saved[0]["steps"] < saved[1]["steps"]
