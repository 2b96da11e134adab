"""Atomic HF export of a distilled model (full or serving), with the early-exit head beside it when trained."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from swiftkv_core.convert import export_for_serving, save_checkpoint


def write_checkpoint(
    model, out_dir: str | os.PathLike, tokenizer=None, serving: bool = False, early_exit_head=None
) -> Path:
    """Write ``model`` (+ tokenizer, + ``early_exit_head``) to ``out_dir``: everything is written into a temporary
    folder beside it and renamed into place at the end, so a failure leaves an earlier export intact."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging.", dir=out_dir.parent))
    try:
        target = staging / "checkpoint"
        was_swiftkv = model.config.swiftkv
        model.swiftkv(True)
        try:
            if serving:
                export_for_serving(model, target, tokenizer)
            else:
                save_checkpoint(model, target, tokenizer)
        finally:
            model.config.swiftkv = was_swiftkv
        if early_exit_head is not None:
            early_exit_head.save(target)
        if out_dir.exists():
            old = staging / "old"
            os.replace(out_dir, old)
        os.replace(target, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir
