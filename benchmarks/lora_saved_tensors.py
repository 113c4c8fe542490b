"""What one training forward pass keeps for the backward pass, with and without LoRA adapters (issue 16).

Counts the bytes of the distinct storages that autograd saves (torch.autograd.graph.saved_tensors_hooks) during
ppo.py's policy forward (response_logprobs) and value forward (response_values), on vs_trl.py's models and sizes:
32 sequences of 8 prompt + 32 response tokens. This is the part of the peak that LoRA could change; the rest of a
process's peak is weights, optimizer states, transient buffers and the allocator.

    python benchmarks/lora_saved_tensors.py
"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import artifacts  # noqa: E402

import ppo  # noqa: E402


def saved_mb(fn, *args) -> float:
    """MB of the distinct storages autograd saves while fn(*args) runs."""
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(storages.values()) / 2**20


def main() -> None:
    art = artifacts.build()
    torch.manual_seed(0)
    ids = torch.randint(3, 4096, (32, 40))  # [B, 8 + 32]
    mask, responses = torch.ones_like(ids), ids[:, 8:]
    for r in (0, 16):
        memory = ppo.MemoryArgs(lora_r=r)
        policy = ppo.with_lora(AutoModelForCausalLM.from_pretrained(art / "policy"), memory)
        value = ppo.with_lora(AutoModelForTokenClassification.from_pretrained(art / "reward", num_labels=1), memory)
        policy_mb = saved_mb(ppo.response_logprobs, ppo.disable_dropout(policy), ids, mask, responses, 1.0, True)
        value_mb = saved_mb(ppo.response_values, ppo.disable_dropout(value), ids, mask, 32)
        name = f"LoRA r {r}" if r else "full"
        print(f"{name}: the policy's forward keeps {policy_mb:.0f} MB for backward, the value model's "
              f"{value_mb:.0f} MB")

if __name__ == "__main__":
    main()
