"""What ``swiftkv distill fit`` tells its user when a step does not fit the device: one line, where and when, and
the recipe's keys that lower the memory (on a GPU for real: test_gpu.py)."""

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from swiftkv_distill.cli import main


class OutOfMemoryInStep2(Callback):
    """Raises what the CUDA caching allocator raises when a step does not fit (a CPU has no such error)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")


def test_a_step_out_of_memory_ends_with_what_to_change(tmp_path, tiny_model, text_file):
    args = ["fit", "--config", "smollm2-135m-cpu", "--model.model", str(tiny_model),
            "--model.num_key_value_layers", "2", "--model.kv_init", "published", "--model.evaluate_before_training",
            "false", "--data.train_files", f"[{text_file}]", "--data.val_files", f"[{text_file}]",
            "--data.max_length", "16", "--data.batch_size", "2", "--trainer.max_steps", "4",
            "--trainer.precision", "32-true", "--trainer.default_root_dir", str(tmp_path),
            "--trainer.callbacks+=tests.distill.test_console.OutOfMemoryInStep2"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main(args)
    message = str(exit_.value.code)
    assert "\n" not in message
    assert (
        message.startswith("swiftkv distill: out of memory on CPU (")
        and "in step 2 (the 1 before it fit)" in message
    )
    assert "model.activation_checkpointing: 1" in message and "model.frozen_dtype: bfloat16" in message
    assert "2 x 16 tokens per step and process" in message and "FSDP2" in message

    # the knobs a run already uses are not suggested again
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--model.activation_checkpointing", "1", "--model.frozen_dtype", "bfloat16",
              "--trainer.precision", "bf16-mixed"])  # fmt: skip
    message = str(exit_.value.code)
    assert "activation_checkpointing" not in message and "frozen_dtype" not in message
    assert message.count("; or ") == 1  # batch / length, more GPUs
