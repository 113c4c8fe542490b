"""Logprobs at a large vocabulary without a [B, T, V] tensor: the chunked path (forward_to_head + over_logits)
equals the whole-logits path in values and gradients, with and without the sampler's filters, in fp32 and bf16,
with LoRA; and no op of ppo_step, rloo_step or sft_step (forward, rollout and backward passes) makes a tensor the
size of the logits, which the whole-logits path does (so the check can fail)."""

import copy
import weakref

import peft
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, LlamaConfig

import interleave
import ppo
import rloo

V = 8192  # vocabulary rows: the logits [B, T, V] dwarf every weight and activation of this model


def large_vocab_model(seed: int = 0, hidden: int = 4) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=1)
    return ppo.fp32_output_layer(AutoModelForCausalLM.from_config(config))


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op makes (forward, backward, no-grad alike) while the mode is on."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(x, torch.Tensor):
                self.numel = max(self.numel, x.numel())
        return out


def largest_saved(fn) -> int:
    """The most elements of a tensor autograd saves for the backward pass while fn runs."""
    sizes = [0]

    def pack(x):
        sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return max(sizes)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("support", [(0, 1.0, 0.0), (50, 0.9, 0.01)])
@pytest.mark.parametrize("lora", [False, True])
def test_chunked_logprobs_entropy_and_gradients_equal_the_whole_logits(dtype, support, lora):
    model = large_vocab_model(hidden=16)
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        for name, param in model.named_parameters():  # adapters that change the model (peft starts lora_B at 0)
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.5)
    ids = torch.randint(2, V, (3, 9))
    queries, query_mask, valid = ids[:, :-5], torch.ones_like(ids[:, :-5]), torch.ones_like(ids[:, -5:]).bool()
    results = []
    for chunk in (0, 5 * V):  # 0: the whole [B, T, V]; 5 x V: 5 positions a chunk, 3 chunks for 15 positions
        model.zero_grad()
        with ppo.autocast(dtype, torch.device("cpu")):
            logprobs, entropy = ppo.response_logprobs(model, queries, query_mask, ids[:, -5:], valid, 0.7, support,
                                                      True, True, chunk)
        (logprobs.sum() + entropy.sum()).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results.append((logprobs.detach(), entropy.detach(), grads))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    tol = 1e-5 if dtype == "fp32" else 1e-4
    assert (lp1 - lp0).abs().max() < tol and (ent1 - ent0).abs().max() < tol
    for a, b in zip(g0, g1):
        assert (a - b).norm() <= tol * b.norm() + 1e-7
    if lora:
        with model.disable_adapter():  # the reference: adapters off, chunked as well
            ref0 = ppo.response_logprobs(model, queries, query_mask, ids[:, -5:], valid, 0.7, support)[0]
            ref1 = ppo.response_logprobs(model, queries, query_mask, ids[:, -5:], valid, 0.7, support, chunk=5 * V)[0]
        assert (ref1 - ref0).abs().max() < tol and not torch.equal(ref0, lp0)


def test_each_prompt_once_logprobs_chunked_equal_whole():
    """rloo.py's layout (each prompt once, its k responses packed after it): chunked logits equal the whole ones."""
    model = large_vocab_model()
    queries, responses = torch.randint(2, V, (2, 4)), torch.randint(2, V, (6, 5))
    query_mask, valid = torch.ones_like(queries, dtype=torch.bool), torch.ones(6, 5, dtype=torch.bool)
    whole = rloo.response_logprobs(model, queries, query_mask, responses, valid, 0.7, (0, 0.9, 0.0), True)
    chunked = rloo.response_logprobs(model, queries, query_mask, responses, valid, 0.7, (0, 0.9, 0.0), True,
                                     chunk=3 * V)
    for a, b in zip(whole, chunked):
        assert (a - b).abs().max() < 1e-5


def batch(B: int = 4, Lq: int = 4, T: int = 16) -> tuple:
    torch.manual_seed(1)
    return torch.randint(2, V, (B, Lq)), torch.randint(2, V, (B, T)), torch.randn(B)


@pytest.mark.parametrize("chunk", [0, 2 * V])
def test_no_logits_sized_tensor_in_ppo_step(chunk):
    policy = large_vocab_model()
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    ref, value = copy.deepcopy(policy), ppo.disable_dropout(AutoModelForTokenClassification.from_config(config))
    queries, responses, rewards = batch()
    hp = ppo.PPOHParams(num_ppo_epochs=1, num_mini_batches=2, logits_chunk=chunk, ent_coef=0.01, top_p=0.9)
    optimizer = torch.optim.AdamW([*policy.parameters(), *value.parameters()], lr=1e-3)
    mode = LargestTensor()

    def step():
        with mode:
            ppo.ppo_step(policy, value, ref, optimizer, queries, responses, rewards, hp=hp, pad_token_id=0)

    saved, logits = largest_saved(step), responses.numel() * V // 2  # a mini-batch's [B / 2, T, V]
    limit = max(chunk, max(p.numel() for p in [*policy.parameters(), *value.parameters()]))  # a chunk, or a weight
    assert logits >= 4 * limit
    if chunk:
        assert mode.numel <= limit and saved <= limit
    else:
        assert mode.numel >= logits and saved >= logits


@pytest.mark.parametrize("chunk", [0, 2 * V])
def test_no_logits_sized_tensor_in_rloo_step_and_sft_step(chunk):
    policy = large_vocab_model()
    ref = copy.deepcopy(policy)
    queries, responses, rewards = batch()
    hp = rloo.RLOOHParams(rloo_k=2, num_ppo_epochs=2, num_mini_batches=2, logits_chunk=chunk, kl_coef=0.1)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    mode = LargestTensor()

    def step():
        with mode:
            rloo.rloo_step(policy, ref, optimizer, queries[::2], responses, rewards, hp=hp, pad_token_id=0)

    saved, logits = largest_saved(step), responses.numel() * V // 2  # a mini-batch's [B / 2, T, V]
    sft = LargestTensor()
    labels = torch.cat([torch.full_like(queries, -100), responses], 1)
    with sft:
        interleave.sft_step(policy, optimizer, torch.cat([queries, responses], 1), torch.ones_like(labels), labels,
                            logits_chunk=chunk)
    limit = max(chunk, max(p.numel() for p in policy.parameters()))  # a chunk, or a weight
    assert logits >= 4 * limit
    if chunk:
        assert mode.numel <= limit and saved <= limit and sft.numel <= limit
    else:
        assert mode.numel >= logits and saved >= logits and sft.numel >= logits


class LiveBytes(TorchDispatchMode):
    """The most bytes that tensors made by ops while the mode is on hold at once (each storage counted once, from its
    first op output until the last tensor on it is gone); storages in `known` (weights, inputs) are not counted."""

    def __init__(self, known: set[int]):
        super().__init__()
        self.known, self.storages, self.live, self.peak = known, {}, 0, 0

    def free(self, ptr: int) -> None:
        self.storages[ptr][0] -= 1
        if self.storages[ptr][0] == 0:
            self.live -= self.storages.pop(ptr)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else [out]:
            ptr = x.untyped_storage().data_ptr() if isinstance(x, torch.Tensor) else None
            if ptr is None or ptr in self.known:
                continue
            if ptr not in self.storages:
                self.storages[ptr] = [0, x.untyped_storage().nbytes()]
                self.live += x.untyped_storage().nbytes()
                self.peak = max(self.peak, self.live)
            self.storages[ptr][0] += 1
            weakref.finalize(x, self.free, ptr)
        return out


@pytest.mark.parametrize("script", ["ppo", "rloo"])
def test_no_grad_logprob_passes_keep_no_state_of_every_layer(script):
    """A model whose layers x hidden size is its vocabulary's size: the no-grad logprob pass (reference, old logprobs)
    holds no hidden state of every layer, and no key/value cache it does not need, so its peak live bytes do not grow
    with depth: 16 layers cost what 4 cost, within 2 hidden states [b, S, H] (with every layer's states kept, 12 more
    layers would add 12). rloo.py's layout (each prompt once, its k responses packed after it) keeps no cache
    either."""
    H, b, Lq, T = 256, 4, 32, 32
    peaks = []
    for layers in (4, 16):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=4096, hidden_size=H, intermediate_size=H, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=4, pad_token_id=0)
        model = ppo.fp32_output_layer(AutoModelForCausalLM.from_config(config)).eval()
        queries, responses = torch.randint(2, 4096, (b, Lq)), torch.randint(2, 4096, (b, T))
        query_mask, valid = torch.ones(b, Lq, dtype=torch.long), torch.ones(b, T, dtype=torch.bool)
        known = {x.untyped_storage().data_ptr() for x in [*model.parameters(), *model.buffers(), queries, responses,
                                                          query_mask, valid]}
        mode = LiveBytes(known)
        with torch.no_grad(), mode:
            if script == "ppo":
                ppo.response_logprobs(model, queries, query_mask, responses, valid, 1.0, chunk=16 * 4096)
            else:
                rloo.response_logprobs(model, queries[::2], query_mask[::2], responses, valid, 1.0, chunk=16 * 4096)
        peaks.append(mode.peak)
    state = b * (Lq + T) * H * 4  # one hidden state [b, S, H] in fp32
    assert peaks[1] - peaks[0] <= 2 * state, (peaks, state)
