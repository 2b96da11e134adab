"""What ``swiftkv distill fit`` tells its user when a step does not fit the device: one line, where and when, and
the recipe's keys that lower the memory (on a GPU for real: test_gpu.py)."""

import re

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from swiftkv_core.runtime import storage_bytes
from swiftkv_distill import SwiftKVDistillation
from swiftkv_distill.build import resident_bytes
from swiftkv_distill.cli import main
from swiftkv_distill.console import Phases
from tests.distill.conftest import llama_70b_parameters


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
    advice = str(exit_.value.code).partition(". Checkpoints written")[0]
    assert "activation_checkpointing" not in advice and "frozen_dtype" not in advice
    assert advice.count("; or ") == 2  # the logits' chunks, batch / length, more GPUs


class OutOfMemoryInFirstForward(Callback):
    """The allocator's error (a CPU has none) in the first forward after the fit starts: before the first step,
    in the phase the run's settings put first."""

    def on_train_start(self, trainer, pl_module):
        def raise_out_of_memory(*_):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

        pl_module.swiftkv_model.model.layers[0].register_forward_pre_hook(raise_out_of_memory)


@pytest.mark.parametrize(
    ("settings", "phase", "advised", "not_advised"),
    [
        (["--model.kv_init", "least_squares", "--model.evaluate_before_training", "false"],
         "fitting the least-squares K/V init", ["data.batch_size"],
         ["activation_checkpointing", "logits_chunk_size", "val_batch_size"]),
        (["--model.kv_init", "published", "--model.evaluate_before_training", "true"],
         "evaluating the model before training", ["data.val_batch_size (8 rows", "logits_chunk_size (512 positions"],
         ["activation_checkpointing", "data.batch_size"]),
    ],
)  # fmt: skip
def test_out_of_memory_before_the_first_step_names_its_phase_and_what_lowers_it(
    tmp_path, tiny_model, text_file, settings, phase, advised, not_advised
):
    """The K/V fit and the measurements before training run without gradients: activation checkpointing would not
    help them, and the K/V fit computes no logits. Each is named, with the keys that lower its memory."""
    args = ["fit", "--config", "smollm2-135m-cpu", "--model.model", str(tiny_model),
            "--model.num_key_value_layers", "2", *settings, "--data.train_files", f"[{text_file}]",
            "--data.val_files", f"[{text_file}]", "--data.max_length", "16", "--data.batch_size", "2",
            "--trainer.max_steps", "2", "--trainer.precision", "32-true", "--trainer.default_root_dir", str(tmp_path),
            "--trainer.callbacks+=tests.distill.test_console.OutOfMemoryInFirstForward"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main(args)
    advice = str(exit_.value.code).partition(". Checkpoints written")[0]
    assert f"before the first step, {phase}. To fit: " in advice
    assert all(key in advice for key in advised) and not any(key in advice for key in not_advised)


def test_a_run_that_cannot_hold_its_weights_is_refused_before_reading_them(
    weightless_70b, text_file, tmp_path
):
    """Llama-3.1-70B in fp32 (280 GB of weights) on this machine: refused before the data is read and tokenised
    (here it would be refused: no text in its records), sized on the meta device from the config alone (the folder
    holds no weights: reading them would fail otherwise)."""
    no_text = tmp_path / "no-text.jsonl"
    no_text.write_text('{"x": 1}\n' * 4)
    args = ["fit", "--config", "smollm2-135m-cpu", "--model.model", str(weightless_70b),
            "--model.num_key_value_layers", "40", "--model.kv_init", "published", "--data.train_files",
            f"[{no_text}]", "--data.val_files", f"[{text_file}]", "--data.max_length", "16",
            "--data.batch_size", "2", "--trainer.max_steps", "1", "--trainer.precision", "32-true",
            "--trainer.default_root_dir", str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main(args)
    message = str(exit_.value.code)
    assert "\n" not in message
    assert (
        message.startswith(f"swiftkv distill: {weightless_70b} does not fit the ")
        and " GiB of CPU (" in message
    )
    frozen, trained = llama_70b_parameters(40)  # 70.6B in fp32; 40 x 83.9M
    assert (
        f"({frozen * 4 / 2**30:.1f} GiB in float32)" in message
        and f"{trained / 1e6:,.0f}M trained" in message
    )
    assert "model.frozen_dtype: bfloat16" in message and "a machine with more memory, or a GPU" in message
    assert not list(tmp_path.rglob("*.ckpt"))


def test_the_size_check_counts_what_a_real_step_holds(tiny_model):
    """The step built on the meta device (no weight read) sizes what the real one holds after an AdamW update: its
    weights, and its trained parameters' gradients and optimizer moments (adapters and early-exit head included)."""
    module = SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, early_exit=True, lora_rank=2)
    with torch.device("meta"):
        sized = resident_bytes(module.build_step(weights=False))
    step = module.build_step()
    trained = [p for p in step.parameters() if p.requires_grad]
    for p in trained:
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.AdamW(trained)
    optimizer.step()
    moments = [
        t for state in optimizer.state.values() for t in state.values() if t.ndim
    ]  # not the step count
    assert sized == storage_bytes([*step.parameters(), *(p.grad for p in trained), *moments])


def test_a_kv_fit_that_cannot_hold_its_normal_equations_is_refused_before_reading_weights(
    tiny_model, text_file, tmp_path
):
    """The least-squares K/V fit holds float64 normal equations whole on every process: with attention weighting,
    one ``hidden x hidden`` matrix per layer group and KV head (at Llama-3.1-70B 177 GB), which ran out of memory after
    the weights were read. A weightless model of hidden size 8192 with 64 KV heads (34 GB of them per group) and as
    many groups as this machine's memory takes to overflow, its weights well within it: refused, with the weighting
    that fits."""
    from transformers import AutoTokenizer, LlamaConfig

    from swiftkv_core.runtime import device_memory_bytes

    groups = device_memory_bytes("cpu") // (64 * 8193**2 * 8) + 1
    path = tmp_path / "wide"
    LlamaConfig(vocab_size=49152, hidden_size=8192, intermediate_size=1024, num_hidden_layers=1 + groups,
                num_attention_heads=64, num_key_value_heads=64).save_pretrained(path)  # fmt: skip
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
    args = ["fit", "--config", "smollm2-135m-cpu", "--model.model", str(path), "--model.num_key_value_layers", "1",
            "--data.train_files", f"[{text_file}]", "--data.val_files", f"[{text_file}]", "--data.max_length", "16",
            "--trainer.max_steps", "1", "--trainer.precision", "32-true", "--trainer.default_root_dir",
            str(tmp_path / "run")]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--model.kv_init_weighting", "attention"])
    message = str(exit_.value.code)
    assert f"{path}'s least-squares K/V fit (attention weighting) holds " in message, message
    assert re.search(
        r"To fit: model.kv_init_weighting: uniform \(\d+\.\d GiB\); or model.kv_init: published", message
    )
    # the same model as a SwiftKV checkpoint fits nothing (its K/V are already initialised): not refused for it,
    # it goes on to read the weights, which this folder has not
    from swiftkv_core.configuration import LlamaSwiftKVConfig

    config = LlamaSwiftKVConfig(
        **LlamaConfig.from_pretrained(path).to_dict(), swiftkv=True, num_key_value_layers=1
    )
    config.save_pretrained(path)
    with pytest.raises(Exception) as error:
        main([*args, "--model.kv_init_weighting", "attention"])
    assert "K/V fit" not in str(error.value) and "model.safetensors" in str(error.value)


def test_processes_sharing_a_cpu_are_each_counted(tiny_model, tmp_path):
    """A CPU's memory is shared by the processes a trainer runs on it, each holding the whole model under DDP: a
    weightless model sized to fit this machine once (three quarters of its memory) is refused for a trainer of two
    processes, saying so, before any weight is read; one process is not refused."""
    import lightning as L
    from transformers import AutoTokenizer, LlamaConfig

    from swiftkv_distill.build import check_fits
    from swiftkv_distill.console import OutOfMemory

    def sized(layers: int):
        path = tmp_path / f"layers-{layers}"
        LlamaConfig(vocab_size=49152, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                    num_attention_heads=32, num_key_value_heads=8).save_pretrained(path)  # fmt: skip
        AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
        run = SwiftKVDistillation(str(path), num_key_value_layers=1, kv_init="published")
        with torch.device("meta"):
            return run, run.build_step(weights=False)

    from swiftkv_core.runtime import device_memory_bytes

    total = device_memory_bytes("cpu")
    if not 6 * 2**30 <= total <= 512 * 2**30:  # a layer is about 1 GiB, the rest 1.5 GiB: 4 to 400 layers
        pytest.skip(f"sized for a machine of 6 to 512 GiB, not {total / 2**30:.0f} GiB")
    two, three = (resident_bytes(sized(layers)[1]) for layers in (2, 3))
    layers = round((0.75 * total - (two - 2 * (three - two))) / (three - two))
    run, step = sized(layers)
    assert 0.5 * total < resident_bytes(step) <= total
    check_fits(torch.device("cpu"), step, run, L.Trainer(accelerator="cpu", devices=1, logger=False))
    two_processes = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    with pytest.raises(OutOfMemory) as error:
        check_fits(torch.device("cpu"), step, run, two_processes)
    message = str(error.value)
    assert re.search(
        r"GiB per process before any activation, and 2 processes share this machine's memory \(\d+\.\d GiB "
        r"together\)",
        message,
    )
    assert "or 1 process on this machine, not 2 (trainer.devices)" in message


def test_each_phase_counts_its_peak_memory_afresh_on_a_gpu(monkeypatch):
    """The module's phase, set as each phase begins, starts the GPU's peak-memory count afresh: the peak that the
    advice gives is the phase's own (a real one: test_gpu.py). A CPU has no count to start."""
    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)  # no CUDA here to reset

    class OnAGpu(Phases):
        device = torch.device("cuda", 0)

    class OnACpu(Phases):
        device = torch.device("cpu")

    gpu, cpu = OnAGpu(), OnACpu()
    gpu.phase = "fitting the least-squares K/V init"
    gpu.phase = None
    cpu.phase = "evaluating the K/V init"
    assert (
        resets == [torch.device("cuda", 0)] * 2
        and gpu.phase is None
        and cpu.phase == "evaluating the K/V init"
    )
    assert issubclass(SwiftKVDistillation, Phases)
