"""One process of ``test_tensor_parallel.py`` (launched by ``torchrun``): loads each checkpoint folder given with
transformers' tensor-parallel plan, runs a prefill and the next token, and (rank 0) saves the logits beside it, or
the error that refused the load."""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DistributedConfig

import swiftkv_core  # noqa: F401  (registers the SwiftKV classes)

PROMPT = torch.tensor([[5, 17, 3, 99, 42, 7, 64, 11]])


def logits(model) -> dict:
    """The last 2 prompt positions' logits (kept rows), then the next token's, read from the cache."""
    with torch.no_grad():
        prefill = model(PROMPT, use_cache=True, logits_to_keep=2)
        following = model(torch.tensor([[23]]), past_key_values=prefill.past_key_values, use_cache=True)
    return {"prefill": prefill.logits, "next": following.logits}


def main(folders: list[str]) -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    for folder in map(Path, folders):
        try:
            model = AutoModelForCausalLM.from_pretrained(
                folder, distributed_config=DistributedConfig(tp_plan="auto")
            )
            result = {**logits(model), "tp_size": model.tp_size}
        except ValueError as error:
            result = {"error": str(error)}
        if rank == 0:
            torch.save(result, folder / "tensor_parallel.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
