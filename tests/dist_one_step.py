"""Launched by tests/test_distributed.py, under torchrun or as one process: for each mode named, one ppo_step or
rloo_step on a fixed global batch, split over the processes (plain: data parallel; fsdp: FSDP2; lora: perturbed LoRA
adapters and no reference copy; fsdp+lora both), each from fresh models; rank 0 saves the resulting parameters and the
step's KL to the reference as OUT_FOLDER/MODE.pt. The modes share one launch: each costs no new process.

    torchrun --nproc_per_node 2 tests/dist_one_step.py ppo OUT_FOLDER plain fsdp lora fsdp+lora

rloo-masks: rloo_step with vespo's loss, the top half of the tokens by entropy (a quantile of all processes' tokens) and
off-policy sequence masking against sampler logprobs that differ from the policy's.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ppo  # noqa: E402
import rloo  # noqa: E402


def one_step(algo: str, out: Path, fsdp: bool, lora: bool, rank: int, world: int, device: torch.device) -> None:
    torch.manual_seed(0)
    tokenizer = ppo.build_tokenizer()
    policy, ref = ppo.build_tiny_model(tokenizer), ppo.build_tiny_model(tokenizer).requires_grad_(False)
    config = policy.config
    config.num_labels = 1
    value = ppo.disable_dropout(ppo.AutoModelForTokenClassification.from_config(config))
    if lora:  # adapters on the policy and the value model; the reference is the policy with its adapters off
        memory = ppo.MemoryArgs(lora_r=4)
        policy, value, ref = ppo.with_lora(policy, memory), ppo.with_lora(value, memory), None
        with torch.no_grad():  # adapters that change the policy (peft starts lora_B at 0), so that the reference,
            for name, p in policy.named_parameters():  # the policy with them off, is a model of its own
                if "lora_B" in name:
                    p.normal_(std=0.2)
    # the global batch: 4 prompts x 4 responses, identical in every process: the first 8 of different lengths, padded
    # enough that both steps pack their rows (rloo.py: rather than share each prompt's prefix), the last 8 of 16 tokens,
    # no padding (two processes: one batch padded, one not; they must take one route, else FSDP hangs, DDP breaks)
    gen = torch.Generator().manual_seed(1)
    queries = ppo.left_pad([tokenizer(f"{i}+{i * 3}=").input_ids for i in range(4)], tokenizer.pad_token_id)
    queries = queries.repeat_interleave(4, 0)
    responses = torch.randint(4, len(tokenizer), (16, 16), generator=gen)
    lengths = torch.randint(1, 6, (16,), generator=gen)
    lengths[0] = 11
    for row, n in enumerate(lengths.tolist()[:8]):
        responses[row, n] = tokenizer.eos_token_id
        responses[row, n + 1:] = tokenizer.pad_token_id
    rewards = torch.rand(16, generator=gen)
    mine = slice(rank * 16 // world, (rank + 1) * 16 // world)
    models = [policy, value] if algo == "ppo" else [policy]
    ppo.place([*models, ref], device, fsdp, world)
    optimizer = torch.optim.SGD([p for m in models for p in m.parameters() if p.requires_grad], lr=0.5)
    common = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    if algo == "ppo":
        metrics = ppo.ppo_step(policy, value, ref, optimizer, queries[mine], responses[mine], rewards[mine],
                               hp=ppo.PPOHParams(num_ppo_epochs=1, num_mini_batches=1, kl_coef=0.1), **common)
    elif algo == "rloo":
        metrics = rloo.rloo_step(policy, ref, optimizer, queries[mine], responses[mine], rewards[mine],
                                 hp=rloo.RLOOHParams(kl_coef=0.1), **common)
    else:
        sampler = -2 - 4 * torch.rand(16, 16, generator=gen)  # [B, T] logprobs around the policy's
        hp = rloo.RLOOHParams(kl_coef=0.1, loss_type="vespo", top_entropy_quantile=0.5, off_policy_mask_threshold=0.0)
        metrics = rloo.rloo_step(policy, ref, optimizer, queries[mine], responses[mine], rewards[mine], hp=hp,
                                 sampler_logprobs=sampler[mine], **common)
    weights = {f"{i}.{k}": v for i, m in enumerate(models) for k, v in ppo.full_state_dict(m).items()}
    weights["kl"] = ppo.average_metrics({"kl": metrics["objective/kl"]}, device)["kl"]  # the KL to the reference
    weights["loss_token_frac"] = metrics.get("policy/loss_token_frac", 1.0)  # this process's
    weights["packed"] = any(vars(m).get("checks", {}).get("packs", False) for m in models)  # the layout packed
    if rank == 0:
        torch.save(weights, out)


def main(algo: str, out: str, modes: list[str]) -> None:
    rank, world, device = ppo.setup_distributed()
    for mode in modes:
        one_step(algo, Path(out) / f"{mode}.pt", "fsdp" in mode, "lora" in mode, rank, world, device)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # as the scripts do: no process tears the group down while another still uses it
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
    if "LOCAL_RANK" in os.environ:  # under torchrun: all is saved and the group torn down; skip interpreter
        sys.stdout.flush()          # teardown, where gloo's leftover threads can abort the process (SIGABRT)
        sys.stderr.flush()
        os._exit(0)
