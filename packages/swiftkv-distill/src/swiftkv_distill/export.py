"""Atomic HF export of a distilled model (full or serving), with the early-exit head beside it when trained."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from swiftkv_core.atomic import atomic_directory
from swiftkv_core.convert import export_for_serving, save_checkpoint

from .step import is_trained_name

if TYPE_CHECKING:
    from .module import SwiftKVDistillation


def write_checkpoint(
    model, out_dir: str | os.PathLike, tokenizer=None, serving: bool = False, early_exit_head=None
) -> Path:
    """Write ``model`` (+ tokenizer, + ``early_exit_head``) to ``out_dir`` atomically (swiftkv_core.atomic): a
    failure at any point, the final renames included, leaves an earlier export there intact."""
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as staging, model.swiftkv_mode(True):
        if serving:
            export_for_serving(model, staging, tokenizer)
        else:
            save_checkpoint(model, staging, tokenizer)
        if early_exit_head is not None:
            early_exit_head.save(staging)
    return out_dir


def trained_state_dict(module: SwiftKVDistillation) -> dict[str, torch.Tensor]:
    """Full (unsharded) trained weights on the CPU, keyed as in the HF model / ``early_exit_head.*``. Under FSDP2
    every rank must call this: each trained weight is gathered in turn (the frozen ones never are: 3.4B weights, not
    74B, at 70B), and only rank 0 keeps them (the others get an empty dict)."""
    from torch.distributed.tensor import DTensor

    trainer = module._trainer  # the ``trainer`` property raises when none is attached
    keep = trainer is None or trainer.is_global_zero
    state = {}
    for name, param in module.step.named_parameters():
        if is_trained_name(name):
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            if keep:
                state[name] = whole.detach().cpu()
    return state


def export(
    module: SwiftKVDistillation, out_dir: str | Path, serving: bool = False, tokenizer=None
) -> Path | None:
    """Write the distilled model as a HF SwiftKV checkpoint (full, or the smaller serving export) atomically;
    ``export_checkpoints`` for both at once."""
    return export_checkpoints(module, {out_dir: serving}, tokenizer)[0]


def export_checkpoints(
    module: SwiftKVDistillation, folders: dict[str | Path, bool], tokenizer=None
) -> list[Path | None]:
    """Write the distilled model into each of ``folders`` (``True``: the serving export, ``False``: the full
    checkpoint) as a HF SwiftKV checkpoint, atomically.

    The early-exit head, when trained, is written beside it (``early_exit_head.safetensors``). Works with or
    without a Trainer (e.g. on a module from ``load_from_checkpoint``). Under FSDP every rank must call this (the
    trained weights are gathered); rank 0 rebuilds the model once (reading the pretrained weights) and writes.
    Returns the folders (``None`` on other ranks)."""
    if not folders:  # the same on every rank
        return []
    state = trained_state_dict(module)
    trainer = module._trainer
    if trainer is not None and not trainer.is_global_zero:
        return [None] * len(folders)
    step = module.step
    if module.device_mesh is not None:
        # the in-memory step is sharded: rebuild a plain one, load what trained
        step = module.build_step()
        keys = step.load_state_dict(state, strict=False)
        missing = [name for name in keys.missing_keys if is_trained_name(name)]
        if missing or keys.unexpected_keys:  # the export would hold the untrained init of those weights
            raise RuntimeError(
                f"the gathered trained weights do not match the rebuilt model's: missing {missing[:4]}, unexpected "
                f"{keys.unexpected_keys[:4]}; nothing was written."
            )
    model, head = step.model, step.early_exit_head
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(module.model_path)
    return [
        write_checkpoint(model, out_dir, tokenizer=tokenizer, serving=serving, early_exit_head=head)
        for out_dir, serving in folders.items()
    ]
