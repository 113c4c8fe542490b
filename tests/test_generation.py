"""Generation: the decode loop (the model's own forward with a key/value cache: one that grows, eager; a static one
under --compile) gives model.generate's greedy tokens for several architectures and samples from the same
distribution; stop strings end rows and cut responses exactly where decoding every prefix would; a model whose
forward takes no cache object goes through model.generate, said once, and one whose layers keep a sliding window
decodes eagerly under --compile, said once."""

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    LlamaForCausalLM,
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
    if config_cls is GPT2Config:  # learned absolute positions: left padding needs the position ids the loop gives
        sizes = dict(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    elif config_cls is not GPTNeoXConfig:
        sizes["num_key_value_heads"] = 2
    return AutoModelForCausalLM.from_config(config_cls(**sizes, **SPECIAL, **kwargs)).eval()


def left_padded(*prompts):
    queries = ppo.left_pad([list(p) for p in prompts], 0)
    return queries, ((queries != 0).cumsum(1) > 0).long()


# ---- greedy: exactly model.generate's tokens ------------------------------------------------------------------------


ARCHITECTURES = {"llama": (LlamaConfig, {}), "qwen2": (Qwen2Config, {}), "gpt_neox": (GPTNeoXConfig, {}),
                 "gpt2": (GPT2Config, {}), "mistral": (MistralConfig, {"sliding_window": 4096}),
                 "mistral_window_8": (MistralConfig, {"sliding_window": 8})}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_equals_generate_with_left_padding(arch):
    """Qwen2: biases on q, k, v; GPT-NeoX: fused qkv, partial rotary, parallel residual; GPT-2: learned positions;
    Mistral: a sliding window longer than the cache, and one of 8 tokens, shorter than prompt and response."""
    config_cls, extra = ARCHITECTURES[arch]
    model = tiny(config_cls, **extra)
    queries, mask = left_padded([1, 5, 6, 7], [1, 9, 10, 11, 12, 13, 14], [1, 20])
    gen = GenerationConfig(do_sample=False, max_new_tokens=12, **SPECIAL)
    expected = model.generate(input_ids=queries, attention_mask=mask, generation_config=gen)[:, queries.shape[1]:]
    assert torch.equal(ppo.decode_loop(model, queries, mask, gen)[0], expected)
    # rows ending at different steps: EOS is the token row 0 greedily takes third; the rest of each row is padding
    gen.eos_token_id = int(expected[0, 2])
    expected = model.generate(input_ids=queries, attention_mask=mask, generation_config=gen)[:, queries.shape[1]:]
    out = ppo.decode_loop(model, queries, mask, gen)[0]
    assert torch.equal(out, expected) and out[0, 3:].eq(0).all()


def test_generate_takes_the_decode_loop_and_returns_the_cut_triple():
    tokenizer = ppo.build_tokenizer()
    model = ppo.build_tiny_model(tokenizer)
    queries = ppo.left_pad([tokenizer("3+4=").input_ids, tokenizer("12+30=").input_ids], tokenizer.pad_token_id)
    _, greedy = ppo.generation_configs(ppo.GenArgs(max_new_tokens=8), tokenizer, 1.0)
    mask = ((queries != tokenizer.pad_token_id).cumsum(1) > 0).long()
    expected = model.generate(input_ids=queries, attention_mask=mask, generation_config=greedy)[:, queries.shape[1]:]
    responses, lengths, ended, _, _ = ppo.generate(model, tokenizer, queries, greedy, [])
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
        out = ppo.decode_loop(model, prompt.expand(n, -1), torch.ones(n, 4, dtype=torch.long), gen)[0]
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
        ours = ppo.decode_loop(model, queries, mask, gen)[0]
        torch.manual_seed(1)
        theirs = model.generate(input_ids=queries, attention_mask=mask, generation_config=gen)[:, 4:]
    for step in (0, 1):
        a, b = (torch.bincount(x[:, step], minlength=V).double() / n for x in (ours, theirs))
        assert 0.5 * (a - b).abs().sum() < 0.05, (step, a, b)
    assert (ours[:, 0].unique().numel()) <= 5  # top-k: the first token is one of the 5 likeliest


def test_the_repetition_penalty_leaves_left_padding_out():
    """generate leaves each row's left padding out of the tokens its repetition penalty counts. Pad is often EOS (a
    tokenizer without a pad token), and counting it held back the EOS of every prompt shorter than the longest in its
    batch: a row's samples and sampler logprobs moved with the other prompts' lengths."""
    tokenizer = ppo.build_tokenizer()
    model, E = ppo.build_tiny_model(tokenizer), tokenizer.eos_token_id
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.5,
                           max_new_tokens=1, pad_token_id=E, eos_token_id=E)
    out = []
    for rows in (["3+4="], ["3+4=", "3+4=5+6=7"]):
        queries = ppo.left_pad([tokenizer(r).input_ids for r in rows], E)
        torch.manual_seed(0)
        out.append(ppo.decode_loop(model, queries, ((queries != E).cumsum(1) > 0).long(), gen))
    assert torch.equal(out[0][0][0], out[1][0][0])
    assert out[0][1][0].item() == pytest.approx(out[1][1][0].item(), abs=1e-5)


def test_sampling_settings_hold_on_the_builtin_model():
    tokenizer = ppo.build_tokenizer()
    model = ppo.build_tiny_model(tokenizer)
    sample, _ = ppo.generation_configs(ppo.GenArgs(max_new_tokens=6, min_new_tokens=6), tokenizer, 1.0, top_k=3)
    queries = ppo.left_pad([tokenizer("3+4=").input_ids] * 64, tokenizer.pad_token_id)
    torch.manual_seed(0)
    out = ppo.decode_loop(model, queries, torch.ones_like(queries), sample)[0]
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
    full, _, _, _, _ = ppo.generate(model, tokenizer, queries, greedy, [])
    stop = tokenizer.decode(full[0, 1:3])  # two characters row 0 produces early
    responses, lengths, ended, _, _ = ppo.generate(model, tokenizer, queries, greedy, [stop])
    assert ended[0] and lengths[0] <= 3
    expected = ppo.cut_responses(tokenizer, full, [stop])
    assert torch.equal(responses, expected[0][:, :responses.shape[1]]) and torch.equal(lengths, expected[1])
    assert torch.equal(ended, expected[2])


# ---- models the loop does not take, the compiled step, sampling's edge ---------------------------------------------


class PastKeyValuesLM(LlamaForCausalLM):
    """A causal LM whose forward takes `past_key_values`, not a cache object, as remote-code models of older
    transformers releases do: the decode loop's `cache=` would land in its **kwargs, unused."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, **kwargs):
        kwargs.pop("cache", None)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=past_key_values, **kwargs)


def test_a_model_whose_forward_takes_no_cache_object_goes_through_generate_said_once(capsys):
    tokenizer = ppo.build_tokenizer()
    torch.manual_seed(0)
    model = PastKeyValuesLM(ppo.build_tiny_model(tokenizer).config).eval()
    queries = ppo.left_pad([tokenizer("3+4=").input_ids, tokenizer("12+30=").input_ids], tokenizer.pad_token_id)
    _, greedy = ppo.generation_configs(ppo.GenArgs(max_new_tokens=8), tokenizer, 1.0)
    ppo.print_once.cache_clear()
    for _ in range(2):
        responses, _, _, _, _ = ppo.generate(model, tokenizer, queries, greedy, [])
    assert capsys.readouterr().out == ("generation through model.generate: PastKeyValuesLM's forward takes no cache "
                                       "object, so the sampler's logprobs are unknown: no sampling/* metrics, no "
                                       "--sampler-correction-cap\n")
    mask = ((queries != tokenizer.pad_token_id).cumsum(1) > 0).long()
    expected = model.generate(input_ids=queries, attention_mask=mask, generation_config=greedy)[:, queries.shape[1]:]
    assert torch.equal(responses, ppo.cut_responses(tokenizer, expected, [])[0])
    plain = ppo.build_tiny_model(tokenizer)  # transformers' own model: the decode loop, nothing said
    ppo.generate(plain, tokenizer, queries, greedy, [])
    assert capsys.readouterr().out == ""


def compile_config() -> ppo.CompileConfig:
    """--compile's setting, with the graphs of tests before forgotten."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ppo.decode_step.cache_clear()
    return ppo.CompileConfig(fullgraph=True, dynamic=False, mode="default")


def test_compiled_step_gives_the_eager_tokens():
    """--compile's decode step (torch.compile, fullgraph, fixed shapes) decodes the same greedy tokens, compiling
    once for two calls of the same shape, which also share one cache (same memory, as CUDA graphs need)."""
    model = tiny(LlamaConfig)
    queries, mask = left_padded([1, 5, 6, 7], [1, 9, 10, 11, 12, 13, 14])
    gen = GenerationConfig(do_sample=False, max_new_tokens=6, **SPECIAL)
    eager = ppo.decode_loop(model, queries, mask, gen)[0]
    assert "decode_caches" not in model.__dict__  # eager: nothing kept between calls
    gen.compile_config = compile_config()
    assert torch.equal(ppo.decode_loop(model, queries, mask, gen)[0], eager)
    (cache,) = model.decode_caches.values()
    keys = cache.layers[0].keys.data_ptr()
    assert torch.equal(ppo.decode_loop(model, queries.flip(0), mask.flip(0), gen)[0], eager.flip(0))
    assert list(model.decode_caches.values()) == [cache] and cache.layers[0].keys.data_ptr() == keys
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_a_run_of_compiled_decodes_keeps_its_graphs_and_caches_bounded():
    """A run's decode batches: prompts of 3 to 8-120 tokens, 16 rows a rollout and 50 an evaluation, rows ending at
    varied steps (so half and a quarter of the rows step on). A graph a (rows, cache length) met dynamo's recompile
    limit (8) within the first batches, a hard failure under fullgraph; with dynamic shapes, at most 2 graphs, and a
    static cache (one CUDA graph on a GPU) a row count and length of the ladder 16, 24, 32, 48, 64, 96, ..., at most
    1.5 times the tokens needed. Under
    dynamo's eager backend: inductor's guards and recompile limit, without its compile time."""
    model = ppo.build_tiny_model(ppo.build_tokenizer()).eval()
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=24, compact_below=0.5,
                           **SPECIAL)
    gen.compile_config = compile_config()
    rng, needed, rows_stepped = random.Random(0), {}, []
    torch.compiler.set_default_backend("eager")
    try:
        for i in range(12):
            longest = rng.choice([8, 30, 60, 120])
            queries = ppo.left_pad([[rng.randrange(4, 20) for _ in range(rng.randint(3, longest))]
                                    for _ in range(50 if i % 4 == 0 else 16)], 0)
            responses, _, stepped = ppo.decode_loop(model, queries, (queries != 0).long(), gen)
            needed[queries.shape[1] + 24] = queries.shape[0]
            rows_stepped.append(stepped / responses.numel())
    finally:
        torch.compiler.set_default_backend(None)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
    assert min(rows_stepped) < 0.9  # rows left the batch: the half and quarter sizes were met
    lengths = {length for _, length, _ in model.decode_caches}
    assert len({n.bit_length() for n in needed}) >= 3 and len(lengths) >= 3  # several lengths met
    ladder = {2 ** k for k in range(4, 12)} | {3 * 2 ** k for k in range(3, 11)}
    assert lengths <= ladder and all(n <= min(x for x in lengths if x >= n) <= 1.5 * n for n in needed)
    assert {rows for rows, _, _ in model.decode_caches} <= {50, 25, 13, 16, 8, 4}


def test_compiled_gpt2_gives_the_eager_tokens():
    """GPT-2's learned positions under the compiled step: model.generate's greedy tokens, with left padding."""
    model = tiny(GPT2Config)
    queries, mask = left_padded([1, 5, 6, 7], [1, 9, 10, 11, 12, 13, 14], [1, 20])
    gen = GenerationConfig(do_sample=False, max_new_tokens=6, **SPECIAL)
    expected = model.generate(input_ids=queries, attention_mask=mask, generation_config=gen)[:, queries.shape[1]:]
    gen.compile_config = compile_config()
    assert torch.equal(ppo.decode_loop(model, queries, mask, gen)[0], expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_sliding_window_layers_decode_eagerly_under_compile_said_once(capsys):
    """A sliding-window layer's static cache counts its tokens in a Python int, which a compiled step would keep at its
    first value (wrong tokens, silently). Under --compile such a model (Mistral; its window longer than the cache, or
    shorter) runs the decode loop eagerly, said once, with model.generate's tokens, and compiles nothing."""
    tokenizer = ppo.build_tokenizer()
    queries = ppo.left_pad([tokenizer("3+4=").input_ids, tokenizer("12+5=").input_ids], tokenizer.pad_token_id)
    mask = (queries != tokenizer.pad_token_id).long()
    _, greedy = ppo.generation_configs(ppo.GenArgs(max_new_tokens=12), tokenizer, 1.0)
    greedy.compile_config = compile_config()
    ppo.print_once.cache_clear()
    for window in (4096, 8):
        model = tiny(MistralConfig, vocab_size=len(tokenizer), sliding_window=window)
        expected = model.generate(input_ids=queries, attention_mask=mask,
                                  generation_config=GenerationConfig(**greedy.to_diff_dict()))[:, queries.shape[1]:]
        responses, _, _, _, _ = ppo.generate(model, tokenizer, queries, greedy, [])
        assert torch.equal(responses, ppo.cut_responses(tokenizer, expected.cpu(), [])[0]), window
    assert capsys.readouterr().out == ("--compile: MistralForCausalLM keeps a sliding window (or another cache than a "
                                       "plain static one) in some layer, which the compiled decode step cannot take: "
                                       "it decodes eagerly\n")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


def test_sampling_never_draws_a_token_of_probability_zero(monkeypatch):
    """torch.rand returns exactly 0 about once in 2^24 draws: the inverse CDF must then still pick a token the
    filters kept (before the fix, searchsorted picked token 0, filtered out or not)."""
    logits = torch.tensor([[5.0, 1.0, 4.0, 3.0], [0.0, 2.0, 1.0, 3.0]])  # top-2: tokens 0 and 2, then 1 and 3
    gen = GenerationConfig(do_sample=True, top_k=2, temperature=1.0)
    seen = torch.zeros(2, 0, dtype=torch.long)
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.zeros(*shape, **kw))
    assert ppo.next_token(logits, seen, gen, 0)[0].tolist() == [2, 3]  # the last kept token of each row
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.full(shape, 1 - 2 ** -24, **kw))  # rand's largest
    assert ppo.next_token(logits, seen, gen, 0)[0].tolist() == [0, 1]  # the first kept token of each row
