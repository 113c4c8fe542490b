"""The previous decode loop, kept only for benchmarks/vs_trl.py's generation line to compare against: `lean_decode`
(hand-written Llama decoder layers with fused q/k/v and gate/up projections) as
ppo.py had it at commit c120fc9 before the scripts moved to the model's own forward with a static cache
(ppo.decode_loop). Not used by the scripts; only Llama, Mistral and Qwen2 models with default RoPE."""

from collections.abc import Callable

import torch
from transformers import GenerationConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ppo import next_token, position_ids_from  # unchanged since c120fc9


def lean_decode(model, queries: torch.Tensor, attention_mask: torch.Tensor, gen: GenerationConfig,
                stop: Callable | None = None) -> torch.Tensor:
    """Responses [B, T] to left-padded queries [B, Lq], sampled as `generate` samples but with less work per token:
    one forward of the model over the prompts fills a key/value cache preallocated for all the new tokens, then each
    new token goes through the model's own layers (norms, projections, RoPE, scaled_dot_product_attention, MLP)
    with nothing else around them. Rows end at EOS (then pad) or when stop(new_ids [B, t]) says so."""
    B, Lq = queries.shape
    inner, T = model.model, gen.max_new_tokens
    prefill = model(input_ids=queries, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask),
                    use_cache=True, logits_to_keep=1)
    cache = [(layer.keys.new_zeros(*layer.keys.shape[:2], Lq + T, layer.keys.shape[-1]),
              layer.values.new_zeros(*layer.values.shape[:2], Lq + T, layer.values.shape[-1]))
             for layer in prefill.cache.layers]
    for (keys, values), layer in zip(cache, prefill.cache.layers):
        keys[:, :, :Lq], values[:, :, :Lq] = layer.keys, layer.values
    fused = [(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),  # one matmul for q, k and v
              torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None,
              torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]))  # one for the MLP's gate and up
             for layer in inner.layers for a in [layer.self_attn]]
    visible = torch.cat([attention_mask.bool(), attention_mask.new_ones(B, T).bool()], 1)  # [B, Lq + T]
    start = attention_mask.sum(1)  # [B] position of the first new token
    out = queries.new_full((B, T), gen.pad_token_id)
    done = torch.zeros(B, dtype=torch.bool, device=queries.device)
    logits = prefill.logits[:, -1]
    for t in range(T):
        token = next_token(logits, torch.cat([queries, out[:, :t]], 1), gen, t).masked_fill(done, gen.pad_token_id)
        out[:, t] = token
        done |= token == gen.eos_token_id
        if stop is not None:
            done |= stop(out[:, :t + 1])
        if done.all() or t == T - 1:
            return out[:, :t + 1]
        h = inner.embed_tokens(token[:, None])  # [B, 1, H]
        cos, sin = inner.rotary_emb(h, (start + t)[:, None])
        for layer, (keys, values), (w_qkv, b_qkv, w_gate_up) in zip(inner.layers, cache, fused):
            attn, x = layer.self_attn, layer.input_layernorm(h)
            qkv = torch.nn.functional.linear(x, w_qkv, b_qkv).view(B, 1, -1, attn.head_dim).transpose(1, 2)
            q, k, v = qkv.split([qkv.shape[1] - 2 * keys.shape[1], keys.shape[1], keys.shape[1]], 1)  # [B, heads, 1, D]
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys[:, :, Lq + t], values[:, :, Lq + t] = k[:, :, 0], v[:, :, 0]
            o = torch.nn.functional.scaled_dot_product_attention(
                q, keys[:, :, :Lq + t + 1], values[:, :, :Lq + t + 1], attn_mask=visible[:, None, None, :Lq + t + 1],
                scale=attn.scaling, enable_gqa=q.shape[1] != k.shape[1])
            h = h + attn.o_proj(o.transpose(1, 2).reshape(B, 1, -1))
            gate, up = torch.nn.functional.linear(layer.post_attention_layernorm(h), w_gate_up).chunk(2, -1)
            h = h + layer.mlp.down_proj(torch.nn.functional.silu(gate) * up)
        logits = model.lm_head(inner.norm(h))[:, -1]
    return out
