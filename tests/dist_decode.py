"""Launched by tests/test_decode_compaction.py under torchrun: the decode loop on an FSDP2-sharded tiny model, rank 0's
rows stopped after two tokens, rank 1's left to run; each rank decodes with and without dropping finished rows, and
rank 0 saves every rank's tokens and rows stepped.

    torchrun --nproc_per_node 2 tests/dist_decode.py out.pt
"""

import sys
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ppo  # noqa: E402


def main(out: str) -> None:
    rank, world, device = ppo.setup_distributed()
    tokenizer = ppo.build_tokenizer()
    torch.manual_seed(0)
    model = ppo.build_tiny_model(tokenizer).eval()
    ppo.place([model], device, True, world)
    queries = torch.randint(4, len(tokenizer), (8, 5), generator=torch.Generator().manual_seed(rank))
    mask = torch.ones_like(queries)
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=16, pad_token_id=0,
                           eos_token_id=None)  # no EOS: rank 1's rows run to the end

    def stop(new_ids: torch.Tensor) -> torch.Tensor:  # rank 0's rows end after their second token
        return torch.full((len(new_ids),), rank == 0 and new_ids.shape[1] >= 2)

    results = {}
    for name, compact in (("whole", 0.0), ("kept", 0.9)):
        gen.compact_below = compact
        torch.manual_seed(7)
        tokens, _, steps = ppo.decode_loop(model, queries, mask, gen, stop)
        results[name], results[f"{name}_steps"] = tokens, steps
    parts = [None] * world
    torch.distributed.all_gather_object(parts, {"whole": results["whole"], "kept": results["kept"],
                                                "steps": results["kept_steps"]})
    if rank == 0:
        torch.save(parts, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
