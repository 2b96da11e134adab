"""FSDP2 sharding of the distillation step, applied after the model is built (the model code stays single-device)."""

from __future__ import annotations

from .step import DistillationStep

# DistillationStep methods besides forward that run the model: FSDP2 must gather the root's weights for them too
FORWARD_METHODS = ("evaluate", "teacher_pass")


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
