"""The GPU check without a GPU: benchmarks/gpu_check.py says in one line that there is no CUDA device and prints its
whole table at the tiny size on CPU; its prompts have the stated length; benchmarks/gpu_wheels.py picks exactly the
packages the GPU machine lacks, and the pinned transformers; and what the GPU check runs works here: bf16 autocast
over fp32 weights in the decode loop (eager and compiled), generation under gradient checkpointing."""

import copy
import importlib.metadata
import json
import re
import sys

import pytest
import torch
import transformers
from transformers import AutoTokenizer

import ppo
import rloo
from conftest import ROOT, run_script

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_wheels  # noqa: E402

ROWS = ["generation: model.generate", "generation: decode loop (ppo.generate)",
        "generation: decode loop, --compile", "ppo.py, 1 process", "ppo.py, 1 process, --logits-chunk 0",
        "ppo.py, torchrun --nproc_per_node 1 (gloo)", "ppo.py, --compile, uneven prompts, 12 its", "rloo.py, 1 process",
        "rloo.py, 1 process, --logits-chunk 0", "rloo.py, torchrun --nproc_per_node 1 (gloo)",
        "rloo.py, --compile, uneven prompts, 12 its"]


def test_gpu_check_without_cuda_prints_the_tiny_table(tmp_path):
    result = run_script("benchmarks/gpu_check.py", "--work-dir", tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "gpu_check: no CUDA device here, so the table below is the tiny size on CPU, not the GPU check"
    start = lines.index("| run | speed | first call / iteration (s) | peak RSS (MiB) | wall (s) | status |")
    table = lines[start:lines.index("", start)]
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in table[2:])}
    assert list(rows) == ROWS
    # the uneven-length tables: one decode step at 4 batch sizes, then ppo.py and rloo.py grpo split into their parts
    steps = next(line for line in lines if line.startswith("one decode step over"))
    assert len(re.findall(r"\d+ rows [\d.]+ ms", steps)) == 4
    split = lines[lines.index(steps) + 3:]
    assert [line.split("|")[1].strip() for line in split] == ["ppo.py, batch 8", "rloo.py grpo, batch 8"]
    for line in split:
        cells = [c.strip() for c in line.strip("|").split("|")]
        decode, update = map(float, cells[9].split(" / "))
        assert float(cells[1]) > 0 and 0 <= decode < 1 and 0 <= update < 1 and int(cells[10]) > 0, line
    for name in ROWS[:2]:
        assert float(re.match(r"([\d,]+) tokens/s", rows[name][0])[1].replace(",", "")) > 0 and rows[name][-1] == "ok"
    for name in [name for name in ROWS if "--compile" in name]:
        assert rows[name][-1].startswith("skipped on CPU")
    for name in [name for name in ROWS[3:] if "--compile" not in name]:
        assert float(rows[name][0].removesuffix(" s/iter")) > 0 and rows[name][-1] == "ok", rows[name]
        assert (rows[name][2] == "–") == ("torchrun" in name)  # peak memory of the single-process runs


def test_prompts_have_the_stated_length(tmp_path):
    gpu_check.build(tmp_path, gpu_check.TINY)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) >= gpu_check.TINY.batch
    assert {len(tokenizer(p).input_ids) for p in prompts} == {gpu_check.TINY.prompt_len}
    assert len(tokenizer) == gpu_check.TINY.tokenizer_vocab


def test_wheels_are_what_the_gpu_machine_lacks_and_the_pinned_transformers():
    need = gpu_wheels.missing(gpu_wheels.ROOTS, ("transformers",))
    assert {"tyro", "datasets", "transformers"} <= need.keys()  # the scripts import the first two; the GPU machine
    assert need.keys() & gpu_wheels.IMAGE == {"transformers"}  # has neither, and an older transformers
    assert not need.keys() & {"torch", "tokenizers", "tqdm"}
    assert all(importlib.metadata.version(name) == version for name, version in need.items())
    assert need["transformers"] == next(line.split("==")[1] for line in (ROOT / "requirements.txt").read_text()
                                        .splitlines() if line.startswith("transformers=="))


def test_decode_loop_under_bf16_autocast_with_fp32_weights():
    """What --dtype bf16 runs: fp32 weights, forward passes under bf16 autocast, so keys come out fp32 (RoPE runs in
    the weights' dtype) and values bf16. The eager loop's growing cache and the compiled loop's static one (each
    keeps keys and values in their own dtypes) give model.generate's greedy tokens under the same autocast."""
    tokenizer = ppo.build_tokenizer()
    torch.manual_seed(0)
    model = ppo.build_tiny_model(tokenizer).eval()
    queries = ppo.left_pad([tokenizer(p).input_ids for p in ["1+2=", "3+4+5="]], tokenizer.pad_token_id)
    mask = (queries != tokenizer.pad_token_id).long()
    gen = transformers.GenerationConfig(do_sample=False, max_new_tokens=4, pad_token_id=tokenizer.pad_token_id,
                                        eos_token_id=tokenizer.eos_token_id)
    compiled = copy.deepcopy(gen)
    compiled.compile_config = transformers.CompileConfig(fullgraph=True, dynamic=False)
    with torch.no_grad(), ppo.autocast("bf16", torch.device("cpu")):
        expected = model.generate(input_ids=queries, attention_mask=mask, generation_config=gen)[:, queries.shape[1]:]
        assert torch.equal(ppo.decode_loop(model, queries, mask, gen)[0], expected)
        assert torch.equal(ppo.decode_loop(model, queries, mask, compiled)[0], expected)
    (cache,) = model.decode_caches.values()
    assert (cache.layers[0].keys.dtype, cache.layers[0].values.dtype) == (torch.float32, torch.bfloat16)


def test_generation_and_rloo_keep_their_cache_under_gradient_checkpointing():
    """--gradient-checkpointing trains the models in training mode, where a checkpointing layer drops its key/value
    cache when there are gradients (transformers 5.17 did even without: each new token attended to itself alone).
    Without gradients the pinned release keeps it: generate samples what eval mode samples, and rloo_step's
    shared-prompt pass without gradients finds its cache (ratio 1)."""
    tokenizer = ppo.build_tokenizer()
    torch.manual_seed(0)
    model = ppo.build_tiny_model(tokenizer).eval()
    queries = ppo.left_pad([tokenizer(f"{a}+{a + 5}=").input_ids for a in range(4) for _ in range(2)],
                           tokenizer.pad_token_id)  # 4 prompts, 2 samples each
    gen = transformers.GenerationConfig(do_sample=True, max_new_tokens=12, min_new_tokens=12,
                                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(1)
    expected = ppo.generate(model, tokenizer, queries, gen, [])[0]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    torch.manual_seed(1)
    responses = ppo.generate(model, tokenizer, queries, gen, [])[0]
    assert torch.equal(responses, expected) and all(m.training for m in model.modules())
    hp = rloo.RLOOHParams(rloo_k=2, num_mini_batches=2, kl_coef=0.0)  # not fused: old logprobs without gradients
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = rloo.rloo_step(model, None, optimizer, queries, responses, torch.linspace(0, 1, 8), hp=hp,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    assert metrics["val/ratio"] == pytest.approx(1.0, abs=1e-5) and all(m.training for m in model.modules())
