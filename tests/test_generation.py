"""Generation: the decode loop (the model's own forward with a key/value cache: one that grows, eager; a static one
under --compile) gives model.generate's greedy tokens for several architectures and samples from the same
distribution; stop strings end rows and cut responses exactly where decoding every prefix would; models the loop
cannot take go through model.generate, said once."""

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

import ppo

SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny(config_cls, vocab_size: int = 500, **kwargs):
    """A random-init causal LM of 2 layers, hidden 64, grouped-query attention where the architecture has it."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4)
    if config_cls is not GPTNeoXConfig:
        sizes["num_key_value_heads"] = 2
    return AutoModelForCausalLM.from_config(config_cls(**sizes, **SPECIAL, **kwargs)).eval()


def left_padded(*prompts):
    queries = ppo.left_pad([list(p) for p in prompts], 0)
    return queries, ((queries != 0).cumsum(1) > 0).long()


# ---- greedy: exactly model.generate's tokens ------------------------------------------------------------------------


@pytest.mark.parametrize("config_cls", [LlamaConfig, Qwen2Config, GPTNeoXConfig], ids=["llama", "qwen2", "gpt_neox"])
def test_greedy_equals_generate_with_left_padding(config_cls):
    model = tiny(config_cls)  # Qwen2: biases on q, k, v; GPT-NeoX: fused qkv, partial rotary, parallel residual
    queries, mask = left_padded([1, 5, 6, 7], [1, 9, 10, 11, 12, 13, 14], [1, 20])
    gen = GenerationConfig(do_sample=False, max_new_tokens=12, **SPECIAL)
    assert ppo.decode_loop_unsupported(model, gen, ppo.cache_length(queries.shape[1], 12)) is None
    expected = model.generate(input_ids=queries, attention_mask=mask, generation_config=gen)[:, queries.shape[1]:]
    assert torch.equal(ppo.decode_loop(model, queries, mask, gen), expected)
    # rows ending at different steps: EOS is the token row 0 greedily takes third; the rest of each row is padding
    gen.eos_token_id = int(expected[0, 2])
    expected = model.generate(input_ids=queries, attention_mask=mask, generation_config=gen)[:, queries.shape[1]:]
    out = ppo.decode_loop(model, queries, mask, gen)
    assert torch.equal(out, expected) and out[0, 3:].eq(0).all()


def test_generate_takes_the_decode_loop_and_returns_the_cut_triple():
    tokenizer = ppo.build_tokenizer()
    model = ppo.build_tiny_model(tokenizer)
    queries = ppo.left_pad([tokenizer("3+4=").input_ids, tokenizer("12+30=").input_ids], tokenizer.pad_token_id)
    _, greedy = ppo.generation_configs(ppo.GenArgs(max_new_tokens=8), tokenizer, 1.0)
    mask = ((queries != tokenizer.pad_token_id).cumsum(1) > 0).long()
    expected = model.generate(input_ids=queries, attention_mask=mask, generation_config=greedy)[:, queries.shape[1]:]
    responses, lengths, ended = ppo.generate(model, tokenizer, queries, greedy, [])
    assert torch.equal(responses, ppo.cut_responses(tokenizer, expected, [])[0])
    assert lengths.tolist() == [8 if tokenizer.eos_token_id not in row else row.index(tokenizer.eos_token_id) + 1
                                for row in expected.tolist()]


# ---- sampling: the same distribution --------------------------------------------------------------------------------


def peaked(model):
    """The model with its output weights x10: a random-init model's next-token distribution is nearly uniform, too
    flat for a wrong temperature or filter to show in the frequencies."""
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    return model


def test_sampling_follows_the_softmax_over_two_steps():
    """4,000 rows of one prompt over a 12-token vocabulary: the frequencies of the first and second sampled tokens
    against the exact probabilities at temperature 0.7 (EOS held back by min_new_tokens). Their total-variation
    distance is about 0.01 here; sampling at temperature 1.0 instead would give 0.16 or more."""
    model, V, n = peaked(tiny(LlamaConfig, vocab_size=12)), 12, 4000
    gen = GenerationConfig(do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=2, min_new_tokens=2,
                           **SPECIAL)
    prompt = torch.tensor([[1, 5, 7, 3]])

    def probs(ids):  # [R, L] -> [R, V]: next-token probabilities with EOS held back, as next_token computes them
        logits = model(input_ids=ids).logits[:, -1] / 0.7
        logits[:, 2] = -float("inf")
        return logits.softmax(-1).double()

    with torch.no_grad():
        first = probs(prompt)[0]  # [V]
        second = first @ probs(torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], 1))  # [V] marginal
        torch.manual_seed(0)
        out = ppo.decode_loop(model, prompt.expand(n, -1), torch.ones(n, 4, dtype=torch.long), gen)
    for step, exact in ((0, first), (1, second)):
        freq = torch.bincount(out[:, step], minlength=V).double() / n
        assert 0.5 * (freq - exact).abs().sum() < 0.05, (step, freq, exact)


def test_sampling_matches_generate_with_top_k_and_repetition_penalty():
    """The same check against model.generate's own samples, with top-k and a repetition penalty on."""
    model, V, n = peaked(tiny(LlamaConfig, vocab_size=12)), 12, 4000
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=5, top_p=1.0, repetition_penalty=1.5,
                           max_new_tokens=2, min_new_tokens=2, **SPECIAL)
    queries, mask = torch.tensor([[1, 5, 7, 3]]).expand(n, -1), torch.ones(n, 4, dtype=torch.long)
    with torch.no_grad():
        torch.manual_seed(0)
        ours = ppo.decode_loop(model, queries, mask, gen)
        torch.manual_seed(1)
        theirs = model.generate(input_ids=queries, attention_mask=mask, generation_config=gen)[:, 4:]
    for step in (0, 1):
        a, b = (torch.bincount(x[:, step], minlength=V).double() / n for x in (ours, theirs))
        assert 0.5 * (a - b).abs().sum() < 0.05, (step, a, b)
    assert (ours[:, 0].unique().numel()) <= 5  # top-k: the first token is one of the 5 likeliest


def test_sampling_settings_hold_on_the_builtin_model():
    tokenizer = ppo.build_tokenizer()
    model = ppo.build_tiny_model(tokenizer)
    sample, _ = ppo.generation_configs(ppo.GenArgs(max_new_tokens=6, min_new_tokens=6, top_k=3), tokenizer, 1.0)
    queries = ppo.left_pad([tokenizer("3+4=").input_ids] * 64, tokenizer.pad_token_id)
    torch.manual_seed(0)
    out = ppo.decode_loop(model, queries, torch.ones_like(queries), sample)
    assert out.shape == (64, 6) and (out != tokenizer.eos_token_id).all()  # min_new_tokens holds EOS back
    logits = model(queries[:1]).logits[0, -1]
    logits[tokenizer.eos_token_id] = -float("inf")  # held back before top-k, as generate's processors do
    assert set(out[:, 0].tolist()) <= set(logits.topk(3).indices.tolist())  # top-k: only the 3 likeliest tokens


# ---- stop strings ---------------------------------------------------------------------------------------------------


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A 300-token byte-level BPE (GPT-2's scheme): ids past the merges are single bytes, so random ids decode to
    broken UTF-8 too."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the sum of 12+30 is 42, then 7+8=15; ok.\n", "héllo wörld ünïcode ± 3 ≤ 4 ✓ stop here\n"] * 50
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<bos>", "<eos>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def quadratic_cut(tokenizer, row: list[int], stop_strings: list[str]) -> tuple[int, bool]:
    """The previous cut_responses, for one row: decode every prefix until a stop string shows."""
    n = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
    done = tokenizer.eos_token_id in row
    if stop_strings and any(s in tokenizer.decode(row[:n]) for s in stop_strings):
        n = next(k for k in range(1, n + 1) if any(s in tokenizer.decode(row[:k]) for s in stop_strings))
        done = True
    return n, done


@pytest.mark.parametrize("which", ["builtin", "byte_level"])
def test_cut_responses_cuts_where_decoding_every_prefix_does(which):
    tokenizer = ppo.build_tokenizer() if which == "builtin" else byte_level_tokenizer()
    rng = random.Random(0)
    V, specials = len(tokenizer), {tokenizer.pad_token_id, tokenizer.bos_token_id}
    ids = [i for i in range(V) if i not in specials]
    for case in range(300):
        rows = [[rng.choice(ids) for _ in range(rng.randint(1, 24))] for _ in range(4)]
        width = max(map(len, rows))
        rows = [r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows]
        texts = [tokenizer.decode(r) for r in rows]
        # stop strings: pieces of the rows' own text (so that they hit), a character, and one that never shows; none
        # with U+FFFD, what a partial character decodes to until its next byte comes (the one text that can vanish)
        stops = [t[i:i + rng.randint(1, 4)] for t in rng.sample(texts, 2) for i in [rng.randrange(max(len(t), 1))]]
        stops = [s for s in stops + [rng.choice("+=1 é"), "never-shows"] if s and "\ufffd" not in s]
        out, lengths, ended = ppo.cut_responses(tokenizer, torch.tensor(rows), stops)
        for row, got, n, done in zip(rows, out.tolist(), lengths.tolist(), ended.tolist()):
            assert (n, done) == quadratic_cut(tokenizer, row, stops), (case, row, stops)
            assert got == row[:n] + [tokenizer.pad_token_id] * (width - n)


@pytest.mark.parametrize("which", ["builtin", "byte_level"])
def test_stop_check_sees_what_decoding_every_prefix_sees(which):
    """Stepping through random rows, the windowed check fires at the first step where the whole text holds a stop
    string, never before."""
    tokenizer = ppo.build_tokenizer() if which == "builtin" else byte_level_tokenizer()
    rng = random.Random(1)
    ids = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    for case in range(100):
        rows = torch.tensor([[rng.choice(ids) for _ in range(16)] for _ in range(4)])
        stops = [s for t in tokenizer.batch_decode(rows[:2]) for i in [rng.randrange(len(t))]
                 if (s := t[i:i + 3]) and "\ufffd" not in s] or ["+"]
        stop = ppo.stop_check(tokenizer, stops)
        seen = torch.zeros(4, dtype=torch.bool)
        for t in range(1, 17):
            whole = torch.tensor([any(s in text for s in stops) for text in tokenizer.batch_decode(rows[:, :t])])
            fired = stop(rows[:, :t])
            assert torch.equal(fired & ~seen, whole & ~seen), (case, t, stops)
            seen |= whole


def test_stop_strings_cost_a_few_decodes_not_one_per_token():
    """A 300-token response whose stop string comes at its end: cut_responses decodes a few prefixes (bisection), not
    all 300; the check during decoding decodes only the last few tokens of each row."""
    tokenizer = ppo.build_tokenizer()
    row = tokenizer("1+2" * 99 + "==", add_special_tokens=False).input_ids  # 299 tokens; "==" ends with the last
    decoded = []
    decode = tokenizer.decode
    tokenizer.decode = lambda token_ids, **kw: decoded.append(len(token_ids)) or decode(token_ids, **kw)
    _, lengths, ended = ppo.cut_responses(tokenizer, torch.tensor([row]), ["=="])
    assert lengths.tolist() == [len(row)] and ended.tolist() == [True]
    assert len(decoded) <= 12, decoded  # decoding every prefix: 299 decodes, 45,000 tokens
    windows = []
    batch_decode = tokenizer.batch_decode
    tokenizer.batch_decode = lambda rows, **kw: windows.append(len(rows[0])) or batch_decode(rows, **kw)
    assert ppo.stop_check(tokenizer, ["=="])(torch.tensor([row])).tolist() == [True]
    assert windows == [3]  # "==" is 2 bytes: the last 2 tokens, and one more


def test_stop_strings_end_rows_during_decoding():
    """Greedy decoding with a stop string gives the cut of the same decoding without one, and ends the loop early."""
    tokenizer = ppo.build_tokenizer()
    model = ppo.build_tiny_model(tokenizer)
    queries = ppo.left_pad([tokenizer("3+4=").input_ids, tokenizer("12+30=").input_ids], tokenizer.pad_token_id)
    _, greedy = ppo.generation_configs(ppo.GenArgs(max_new_tokens=16), tokenizer, 1.0)
    full, _, _ = ppo.generate(model, tokenizer, queries, greedy, [])
    stop = tokenizer.decode(full[0, 1:3])  # two characters row 0 produces early
    responses, lengths, ended = ppo.generate(model, tokenizer, queries, greedy, [stop])
    assert ended[0] and lengths[0] <= 3
    expected = ppo.cut_responses(tokenizer, full, [stop])
    assert torch.equal(responses, expected[0][:, :responses.shape[1]]) and torch.equal(lengths, expected[1])
    assert torch.equal(ended, expected[2])


# ---- models and settings the loop does not take ---------------------------------------------------------------------


def test_other_models_and_settings_go_through_generate_said_once(capsys):
    tokenizer = ppo.build_tokenizer()
    model = tiny(MistralConfig, vocab_size=len(tokenizer), sliding_window=8)  # a window shorter than the cache
    queries = ppo.left_pad([tokenizer("3+4=").input_ids], tokenizer.pad_token_id)
    _, greedy = ppo.generation_configs(ppo.GenArgs(max_new_tokens=12), tokenizer, 1.0)
    reason = ppo.decode_loop_unsupported(model, greedy, ppo.cache_length(queries.shape[1], 12))
    assert "sliding window" in reason
    ppo.print_once.cache_clear()
    for _ in range(2):
        responses, _, _ = ppo.generate(model, tokenizer, queries, greedy, [])
    assert capsys.readouterr().out == f"generation through model.generate, not the decode loop: {reason}\n"
    mask = torch.ones_like(queries)
    expected = model.generate(input_ids=queries, attention_mask=mask, generation_config=greedy)[:, queries.shape[1]:]
    assert torch.equal(responses, ppo.cut_responses(tokenizer, expected, [])[0])
    greedy.suppress_tokens = [5]  # a setting next_token does not implement
    assert "suppress_tokens" in ppo.decode_loop_unsupported(ppo.build_tiny_model(tokenizer), greedy, 16)


def test_compiled_step_gives_the_eager_tokens():
    """--compile's decode step (torch.compile, fullgraph, fixed shapes) decodes the same greedy tokens, compiling
    once for two calls of the same shape, which also share one cache (same memory, as CUDA graphs need)."""
    model = tiny(LlamaConfig)
    queries, mask = left_padded([1, 5, 6, 7], [1, 9, 10, 11, 12, 13, 14])
    gen = GenerationConfig(do_sample=False, max_new_tokens=6, **SPECIAL)
    eager = ppo.decode_loop(model, queries, mask, gen)
    assert "decode_caches" not in model.__dict__  # eager: nothing kept between calls
    gen.compile_config = ppo.CompileConfig(fullgraph=True, dynamic=False, mode="default")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the graphs of tests before
    ppo.compiled_decode_step.cache_clear()
    assert torch.equal(ppo.decode_loop(model, queries, mask, gen), eager)
    (cache,) = model.decode_caches.values()
    keys = cache.layers[0].keys.data_ptr()
    assert torch.equal(ppo.decode_loop(model, queries.flip(0), mask.flip(0), gen), eager.flip(0))
    assert list(model.decode_caches.values()) == [cache] and cache.layers[0].keys.data_ptr() == keys
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1



def test_compiled_loop_leaves_sliding_window_layers_to_generate():
    """A sliding-window layer's static cache counts its tokens in a Python int, which the compiled step (its guards
    skipped after the first) would keep at its first value: Mistral's window of 4,096 is longer than the cache, the
    eager loop takes it and the compiled one gave wrong greedy tokens, silently. Under --compile such a model goes
    through model.generate, with its tokens."""
    tokenizer = ppo.build_tokenizer()
    model = tiny(MistralConfig, vocab_size=len(tokenizer))
    queries = ppo.left_pad([tokenizer("3+4=").input_ids, tokenizer("12+5=").input_ids], tokenizer.pad_token_id)
    _, greedy = ppo.generation_configs(ppo.GenArgs(max_new_tokens=6), tokenizer, 1.0)
    length = ppo.cache_length(queries.shape[1], 6)
    assert ppo.decode_loop_unsupported(model, greedy, length) is None
    mask = (queries != tokenizer.pad_token_id).long()
    expected = model.generate(input_ids=queries, attention_mask=mask, generation_config=greedy)[:, queries.shape[1]:]
    greedy.compile_config = ppo.CompileConfig(fullgraph=True, dynamic=False, mode="default")
    assert "sliding-window" in ppo.decode_loop_unsupported(model, greedy, length)
    responses, _, _ = ppo.generate(model, tokenizer, queries, greedy, [])
    assert torch.equal(responses, ppo.cut_responses(tokenizer, expected, [])[0])

# ---- oneDNN's matmuls on a CPU: another kernel, the same model -----------------------------------------------------


def linear_forwards(model) -> list:
    return [m.__dict__.get("forward") for m in model.modules() if type(m) is torch.nn.Linear]


def test_onednn_linears_change_the_kernel_and_nothing_else():
    """Within onednn_linears, a pass without gradients runs the model's linear layers through oneDNN's matmul (the
    profiler sees mkldnn's linear and no BLAS matmul) with the plain forward's logits and greedy tokens, each weight
    packed in oneDNN's layout on entry (so a weight changed in between, as an optimizer step changes it, is packed
    anew); each layer's own forward is back after, the output layer's fp32 wrapper (fp32_output_layer) included and
    the packed copies gone. Under bf16 autocast the weights are packed in bf16, as autocast would cast them, but the
    output layer's, whose fp32_output_layer wrapper computes in fp32: autocast's logits. With gradients it changes
    nothing."""
    model = ppo.fp32_output_layer(tiny(LlamaConfig))
    own = linear_forwards(model)
    assert own[-1] is not None and own[:-1] == [None] * 14  # the output layer's wrapper, the others' class forward
    queries, mask = left_padded([1, 5, 6, 7], [1, 9, 10, 11, 12, 13, 14])
    gen = GenerationConfig(do_sample=False, max_new_tokens=6, **SPECIAL)
    with torch.no_grad():
        plain_logits = model(input_ids=queries, attention_mask=mask).logits
        plain = ppo.decode_loop(model, queries, mask, gen)
        with ppo.onednn_linears(model):
            assert all(forward is not None and forward not in own for forward in linear_forwards(model))
            assert all(m.onednn_weight.is_mkldnn for m in model.modules() if type(m) is torch.nn.Linear)
            with torch.profiler.profile() as prof:
                logits = model(input_ids=queries, attention_mask=mask).logits
            ops = {event.key for event in prof.key_averages()}
            assert torch.equal(ppo.decode_loop(model, queries, mask, gen), plain)
    assert "mkldnn::_linear_pointwise" in ops and not ops & {"aten::mm", "aten::addmm", "aten::bmm"}, ops
    torch.testing.assert_close(logits, plain_logits, rtol=1e-5, atol=1e-5)
    assert linear_forwards(model) == own
    assert not any(hasattr(m, "onednn_weight") for m in model.modules())
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(-2.0)  # as an optimizer step would, in place
        changed_logits = model(input_ids=queries, attention_mask=mask).logits
        with ppo.onednn_linears(model):
            torch.testing.assert_close(model(input_ids=queries, attention_mask=mask).logits, changed_logits,
                                       rtol=1e-5, atol=1e-5)
    with ppo.onednn_linears(model):  # gradients on: BLAS, as before
        assert linear_forwards(model) == own
    with torch.no_grad(), ppo.autocast("bf16", torch.device("cpu")):  # bf16: the weights packed in bf16, as
        autocast_logits = model(input_ids=queries, attention_mask=mask).logits  # autocast casts them, but the
        with ppo.onednn_linears(model):  # output layer's, which fp32_output_layer computes in fp32
            dtypes = [m.onednn_weight.dtype for m in model.modules() if type(m) is torch.nn.Linear]
            with torch.profiler.profile() as prof:
                logits = model(input_ids=queries, attention_mask=mask).logits
        assert dtypes == [torch.bfloat16] * 14 + [torch.float32] and logits.dtype == torch.float32
        assert not {event.key for event in prof.key_averages()} & {"aten::mm", "aten::addmm", "aten::linear"}
        torch.testing.assert_close(logits, autocast_logits, rtol=1e-4, atol=1e-4)
    assert linear_forwards(model) == own


def test_onednn_linears_under_compile_keep_one_graph():
    """--compile's decode step with oneDNN's linear layers (an operator registered with torch.library, which
    torch.compile calls as it is) gives the eager tokens and compiles once for two calls, each in its own
    onednn_linears."""
    model = tiny(LlamaConfig)
    queries, mask = left_padded([1, 5, 6, 7], [1, 9, 10, 11, 12, 13, 14])
    gen = GenerationConfig(do_sample=False, max_new_tokens=6, **SPECIAL)
    eager = ppo.decode_loop(model, queries, mask, gen)
    gen.compile_config = ppo.CompileConfig(fullgraph=True, dynamic=False, mode="default")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the graphs of tests before
    ppo.compiled_decode_step.cache_clear()
    for _ in range(2):
        with ppo.onednn_linears(model):
            assert torch.equal(ppo.decode_loop(model, queries, mask, gen), eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert linear_forwards(model) == [None] * 15


# ---- the compiled step's attention on a CPU: products and sums, SDPA's results ------------------------------------


def test_one_query_attention_gives_sdpas_output():
    """One query per row over a cache with masked slots (left padding, slots not written yet), grouped-query heads
    (2 key/value heads for 6 query heads): SDPA's output; with more than one query, or no mask, it is SDPA."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 3, True, False
    key, value = torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    mask = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    mask[0, ..., :3] = False  # left padding of row 0
    mask[..., 7:] = False  # slots not written yet
    sdpa = ppo.AttentionInterface()["sdpa"]
    for query, m in [(torch.randn(2, 6, 1, 8), mask), (torch.randn(2, 6, 4, 8), mask.expand(2, 1, 4, 10)),
                     (torch.randn(2, 6, 1, 8), None)]:
        out, _ = ppo.one_query_attention(module, query, key, value, m, scaling=0.3)
        expected, _ = sdpa(module, query, key, value, m, scaling=0.3)
        assert out.shape == expected.shape == (2, query.shape[2], 6, 8)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    unmasked, masked = out, ppo.one_query_attention(module, query, key, value, mask, scaling=0.3)[0]
    assert (unmasked - masked).abs().min() > 1e-3  # the mask counts: every head of every row changes


def test_fused_attention_takes_the_compiled_step_only():
    """Within fused_attention, a compiled decode step on a CPU runs no SDPA kernel (the profiler sees none) and decodes
    the eager tokens, one graph for two calls; eager decoding keeps SDPA; the model's attention is SDPA again after
    (fp32_sdpa, if it was)."""
    model = tiny(LlamaConfig)
    queries, mask = left_padded([1, 5, 6, 7], [1, 9, 10, 11, 12, 13, 14])
    gen = GenerationConfig(do_sample=False, max_new_tokens=6, **SPECIAL)
    eager = ppo.decode_loop(model, queries, mask, gen)
    with ppo.fused_attention(model, compiled=False):
        assert model.config._attn_implementation == "sdpa"
    gen.compile_config = ppo.CompileConfig(fullgraph=True, dynamic=False, mode="default")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the graphs of tests before
    ppo.compiled_decode_step.cache_clear()
    for _ in range(2):
        with ppo.fused_attention(model, compiled=True), torch.profiler.profile() as prof:
            assert model.config._attn_implementation != "sdpa"
            assert torch.equal(ppo.decode_loop(model, queries, mask, gen), eager)
        steps = [e for e in prof.events() if e.name.startswith("Torch-Compiled Region")]
        assert len(steps) == 5 and not any("scaled_dot_product" in e.name for e in prof.events()
                                           if any(e.time_range.start >= s.time_range.start
                                                  and e.time_range.end <= s.time_range.end for s in steps))
        assert model.config._attn_implementation == "sdpa"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    ppo.fp32_attention(model)  # as ppo.place leaves a model on a CPU: switched too, and back to fp32_sdpa after
    with ppo.fused_attention(model, compiled=True):
        assert model.config._attn_implementation.endswith("_one_query")
    assert model.config._attn_implementation == ppo.FP32_SDPA
