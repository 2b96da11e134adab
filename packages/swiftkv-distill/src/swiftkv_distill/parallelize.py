"""FSDP2 sharding of the distillation step (the model code stays single-device), its weights read by rank 0 alone;
and the collectives every process of a run meets at."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from .launch import bad_input, raise_stop, where
from .step import DistillationStep

T = TypeVar("T")

# DistillationStep methods besides forward that run the model: FSDP2 must gather the root's weights for them too
FORWARD_METHODS = ("evaluate", "teacher_pass")


def sum_over_processes(value: torch.Tensor, processes: int) -> torch.Tensor:
    """``value`` summed over the ``processes`` of the run, in place: one all-reduce, queued on the device (NCCL),
    which the host goes on past. Lightning's ``strategy.reduce`` and ``self.log(sync_dist=True)`` put a barrier first,
    and a barrier waits until the device has done all it was given: a training step would stall at each."""
    if processes > 1:
        torch.distributed.all_reduce(value)
    return value


def on_every_process(work: Callable[[], T]) -> T:
    """``work()`` on every process of the run (what it returned here), a failure on any process raised on every one:
    the others would go on to their next collective and wait there for the failed one until the process group's
    timeout (30 min), as no launcher stops them (a ``fabric run`` on each node watches that node's processes alone).
    Elsewhere than on the failed process it is named as that process's (``launch.raise_stop``)."""
    result, failure = None, None
    try:
        result = work()
    except Exception as error:
        failure = error
    if failure is not None:  # bad input or not, what it says, where it ran
        gathered((bad_input(failure), f"{type(failure).__name__}: {failure}", where()))
        raise failure
    for rank, told in enumerate(gathered(None)):
        if told is not None:
            raise_stop(rank, *told)
    return result


def gathered(value: T) -> list[T]:
    """``value`` of each process of the run, in rank order (one process: its own); each process must call it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def check_data_parallel_only(device_mesh) -> None:
    """Refuses the device mesh of Lightning's ModelParallelStrategy (``None`` under any other strategy) where it has
    a tensor-parallel dimension: FSDP2 shards over the data-parallel one alone, so each tensor-parallel rank would
    train its own unsharded replica on its own batches, its gradients never averaged. Lightning's ``auto`` sizes
    give tensor parallelism the GPUs of a node."""
    names = (device_mesh.mesh_dim_names or ()) if device_mesh is not None else ()
    tensor_parallel = device_mesh["tensor_parallel"].size() if "tensor_parallel" in names else 1
    if tensor_parallel != 1:
        raise ValueError(
            f"ModelParallelStrategy has tensor_parallel_size {tensor_parallel}, and distillation has no tensor "
            "parallelism (FSDP2 shards over the data-parallel processes): set --trainer.strategy.data_parallel_size "
            f"{device_mesh.size()} --trainer.strategy.tensor_parallel_size 1 (as the GPU recipes do)."
        )


def parallelize(step: DistillationStep, mesh, reshard_after_forward: bool = True) -> DistillationStep:
    """Shard ``step`` with FSDP2 over the 1-D data-parallel ``mesh``, in place: one unit per decoder layer, the
    shared K/V projections their own units, and the step itself as the root (embeddings, norms, LM heads)."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    for layer in step.model.model.layers:
        # The shared K/V projections run outside their layer's forward (all at once, from the input of layer l):
        # they need their own units, or their weights would still be sharded when called.
        for name in ("k_proj_swiftkv", "v_proj_swiftkv"):
            if hasattr(layer.self_attn, name):
                fully_shard(getattr(layer.self_attn, name), **kwargs)
        fully_shard(layer, **kwargs)
    fully_shard(step, **kwargs)
    for method in FORWARD_METHODS:
        register_fsdp_forward_method(step, method)
    return step


def shard_from_rank0(
    sized: DistillationStep,
    build: Callable[[], DistillationStep],
    mesh,
    device: torch.device,
    reshard_after_forward: bool = True,
) -> DistillationStep:
    """``sized`` (a step built on the meta device) sharded with FSDP2 on ``device`` and given the weights of
    ``build()``, the same step built with its weights, which only global rank 0 calls: the other processes never
    hold a whole copy of the model on the host. Weights cast on loading are each process's own copy (the 8B recipe's
    fp32 from a bf16 checkpoint: 32 GB per process, 256 GB for a node of eight), and the cast is done once. A resumed
    run reads them too: its checkpoint holds the trained weights alone (``checkpointing.TrainedWeightsOnly``), which
    Lightning loads over these right after."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    parallelize(sized, mesh, reshard_after_forward)
    sized.to_empty(device=device)
    # rank 0's failure raised on every rank: the others would wait for its weights until the process group's timeout
    whole = on_every_process(build if dist.get_rank() == 0 else lambda: None)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(sized, whole.state_dict() if whole is not None else {}, options=options)
    # A state dict leaves out non-persistent buffers (RoPE's frequencies): rank 0's, broadcast too
    with torch.no_grad():
        for name, buffer in sized.named_buffers():
            if whole is not None:
                buffer.copy_(whole.get_buffer(name))
            dist.broadcast(buffer, src=0)
    return sized
