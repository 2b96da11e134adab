"""Packed rows through flex_attention (a block mask of the packed sequences, the GPU recipe's attention) and through
transformers' flash-attn path (variable-length kernels) give the numbers of the dense mask that sdpa gets: the
distillation loss, the held-out statistics and the gradients of the SwiftKV parameters (flex_attention's on CUDA
only: PyTorch's CPU flex_attention is forward-only; flash-attn's path on the CPU through ``tests/flash_reference``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from lightning.fabric.utilities import move_data_to_device

from swiftkv_core.convert import convert
from swiftkv_distill import DistillDataModule, SwiftKVDistillation
from swiftkv_distill.batches import collate, pack
from swiftkv_distill.build import attention_for, compile_layers
from swiftkv_distill.step import DistillationStep
from tests.conftest import FLEX_HEADS, tiny_base
from tests.distill.conftest import quiet_trainer
from tests.flash_reference import flash_attention_2_on_the_reference


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    """flex_attention compiles its kernels per shape; after a few recompilations in one process torch 2.13's CPU
    code generation can fail (an inductor bug, CPU only): every test starts from empty compile caches."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def packed_batch(device="cpu") -> dict:
    torch.manual_seed(1)
    sequences = [torch.randint(1, 128, (n,)).tolist() for n in (20, 35, 9, 40, 17, 23)]
    batch = collate(pack(sequences, 48), pad_to=48)  # rows holding several sequences, positions restarting
    assert (batch["position_ids"][:, 1:] == 0).any()
    return move_data_to_device(batch, device)


def step_results(model, batch, implementation: str, positions=None, backward: bool = False) -> dict:
    model.config._attn_implementation = implementation
    model.zero_grad(set_to_none=True)
    step = DistillationStep(model)
    out = step(batch, 1.0 / batch["loss_mask"].sum(), positions=positions)
    grads = {}
    if backward:
        out["loss"].backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    evaluation = step.evaluate(batch)
    model.config._attn_implementation = "sdpa"
    return {
        "loss": out["loss"].detach(),
        "kl": evaluation.stats.kl,
        "agree": evaluation.stats.agree,
        "grads": grads,
    }


def assert_same_gradients(got: dict, want: dict, atol: float, rtol: float) -> None:
    """The same parameters have gradients, each close to ``want``'s; a failure lists every gradient's largest
    difference beside its largest value (how far off, and where)."""
    assert want and set(got) == set(want)

    def all_differences(message: str) -> str:
        each = (
            f"{name}: max |diff| {(got[name] - g).abs().max():.2e} of max |grad| {g.abs().max():.2e}"
            for name, g in want.items()
        )
        return f"{message}\nall: {'; '.join(each)}"

    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=atol, rtol=rtol, msg=all_differences)


def test_packed_rows_through_flex_attention_equal_the_dense_mask_on_cpu():
    model = convert(tiny_base("llama", **FLEX_HEADS), 2, 1)
    batch = packed_batch()
    with torch.no_grad():
        dense = step_results(model, batch, "sdpa")
        flex = step_results(model, batch, "flex_attention")
        kept = torch.tensor([3, 10, 30, 47])  # the student's layers >= l for a subset of positions
        dense_kept = step_results(model, batch, "sdpa", kept)
        flex_kept = step_results(model, batch, "flex_attention", kept)
    torch.testing.assert_close(flex["loss"], dense["loss"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(flex["kl"], dense["kl"], atol=1e-6, rtol=1e-5)
    assert torch.equal(flex["agree"], dense["agree"])
    torch.testing.assert_close(flex_kept["loss"], dense_kept["loss"], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flash_attention_3"])
def test_packed_rows_through_the_flash_attention_path_give_the_dense_step(implementation):
    """Several rows of packed sequences (the GPU recipes' batches): transformers' flash path finds packed sequences
    from the positions in a one-row batch only, so SwiftKV hands it the variable-length arguments of the flattened
    batch; without them the rows attended across their packed sequences (loss off by ~1 here). flash-attn's kernels
    are the plain-PyTorch reference (no flash-attn on a CPU; with flash-attn 2's signature under either name); the
    rest is transformers' flash path as it runs."""
    model = convert(tiny_base("llama"), 2, 1)
    batch = packed_batch()
    assert batch["input_ids"].shape[0] > 1
    dense = step_results(model, batch, "sdpa", backward=True)
    kept = torch.tensor([3, 10, 30, 47])
    with torch.no_grad():
        dense_kept = step_results(model, batch, "sdpa", kept)
    with flash_attention_2_on_the_reference() as calls:
        flash = step_results(model, batch, implementation, backward=True)
        with torch.no_grad():
            flash_kept = step_results(model, batch, implementation, kept)
    assert calls, "the flash-attn path did not run"
    torch.testing.assert_close(flash["loss"], dense["loss"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(flash["kl"], dense["kl"], atol=1e-6, rtol=1e-5)
    assert torch.equal(flash["agree"], dense["agree"])
    torch.testing.assert_close(flash_kept["loss"], dense_kept["loss"], atol=1e-6, rtol=1e-5)
    assert_same_gradients(flash["grads"], dense["grads"], atol=1e-6, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kept", [None, [3, 10, 30, 47]], ids=["every-position", "kept-positions"])
def test_packed_rows_through_flex_attention_give_the_dense_gradients_on_gpu(kept):
    """Every position, and a subset (position_fraction < 1: layers >= l through the kept rows' block mask)."""
    model = convert(tiny_base("llama"), 2, 1).cuda()
    batch = packed_batch("cuda")
    positions = None if kept is None else torch.tensor(kept, device="cuda")
    dense = step_results(model, batch, "sdpa", positions, backward=True)
    flex = step_results(model, batch, "flex_attention", positions, backward=True)
    assert_same_gradients(flex["grads"], dense["grads"], atol=1e-5, rtol=1e-3)
    torch.testing.assert_close(flex["loss"], dense["loss"], atol=1e-6, rtol=1e-5)


def test_compiled_layers_run_flex_attention_outside_their_graph():
    """``compile_layers`` with flex_attention: each layer's attention module runs eagerly, one graph break per layer
    (lowered inside the layers' graphs, flex_attention gave a loss 17% off on an H100); the norms and MLP stay
    compiled, and the forward gives the eager loss (PyTorch's CPU flex_attention has no backward: the gradients
    are the gpu test's below)."""
    from torch._dynamo.utils import counters

    model = convert(tiny_base("llama", **FLEX_HEADS), 2, 1)
    batch = packed_batch()
    with torch.no_grad():
        eager = step_results(model, batch, "flex_attention")
        compile_layers(model)
        counters.clear()
        compiled = step_results(model, batch, "flex_attention")
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert counters["stats"]["unique_graphs"] > 0  # the layers ran compiled
    breaks = [reason for reason in counters["graph_break"] if "_attend_outside_the_graph" in reason]
    assert breaks, dict(counters["graph_break"])  # and their attention outside the graph
    torch.testing.assert_close(compiled["loss"], eager["loss"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(compiled["kl"], eager["kl"], atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["sdpa", "flex_attention"])
def test_compiled_layers_give_the_eager_step_on_gpu(implementation, fp32_matmuls):
    """``compile_layers`` (``build.compile_layers``) with packed rows (flex_attention, outside the layers' graphs:
    inside them it gave a loss 17% off on an H100; sdpa beside it, which tells a fault of the compiled layer from
    one of the attention): the loss and gradients of the eager layers."""

    model = convert(tiny_base("llama"), 2, 1).cuda()
    batch = packed_batch("cuda")
    eager = step_results(model, batch, implementation, backward=True)
    compile_layers(model)
    compiled = step_results(model, batch, implementation, backward=True)
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    torch.testing.assert_close(compiled["loss"], eager["loss"], atol=1e-6, rtol=1e-5)  # the loss first
    assert_same_gradients(compiled["grads"], eager["grads"], atol=1e-5, rtol=1e-3)


def test_the_gpu_recipes_flash_attention_with_fp32_weights_evaluates_and_fits_kv_in_fp32(
    tiny_model, text_file, tmp_path, monkeypatch
):
    """The GPU recipes: fp32 weights, bf16-mixed, flash-attn where it is installed. The training steps compute in
    bf16 under autocast and attend through flash-attn. The evaluations (in the weights' own dtype) and the K/V fit's
    teacher pass (outside autocast) compute in fp32, which flash-attn refuses: they attend with sdpa, so the figures
    before training are the sdpa run's, exactly. flash-attn's kernels: the reference, refusing fp32 as flash-attn
    does (before, the first evaluation raised its error)."""
    monkeypatch.setattr("swiftkv_distill.build.cpu_has_fast_bf16", lambda: False)

    def fit(attention: str):
        dm = DistillDataModule(
            str(tiny_model), [str(text_file)], max_length=32, batch_size=2, val_fraction=0.2
        )
        module = SwiftKVDistillation(
            str(tiny_model),
            num_key_value_layers=2,
            attn_implementation=attention,
            kv_init_weighting="uniform",
        )
        trainer = quiet_trainer(
            tmp_path / attention, max_steps=2, precision="bf16-mixed", num_sanity_val_steps=0
        )
        with pytest.warns(UserWarning, match="bf16 is emulated here"):
            trainer.fit(module, dm)
        assert torch.isfinite(trainer.callback_metrics["train/loss"])
        return module

    sdpa = fit("sdpa")
    with flash_attention_2_on_the_reference(half_only=True) as seen:
        flash = fit("flash_attention_2")
    assert seen and set(seen) == {torch.bfloat16}  # the training steps attended through flash-attn, in bf16
    assert (
        flash.swiftkv_model.config._attn_implementation == "flash_attention_2"
    )  # as configured, after the passes
    assert flash.kv_init_report["tokens"] == sdpa.kv_init_report["tokens"] > 0
    assert flash.before_metrics == sdpa.before_metrics
    assert flash.init_metrics == sdpa.init_metrics
    assert set(flash.last_val_metrics) == set(sdpa.last_val_metrics)
    # training in fp32 with flash-attn asked for by name: refused before any weight is read, saying what to set
    dm = DistillDataModule(str(tiny_model), [str(text_file)], max_length=32, batch_size=2)
    fp32 = SwiftKVDistillation(
        str(tiny_model), num_key_value_layers=2, attn_implementation="flash_attention_2"
    )
    with pytest.raises(ValueError, match="flash_attention_2 computes in fp16 and bf16 only"):
        quiet_trainer(tmp_path / "fp32", max_steps=1).fit(fp32, dm)


def test_the_run_picks_fast_packed_attention_for_its_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # an A100 (compute capability 8.0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    assert attention_for("cpu") == "sdpa"  # fastest on a CPU; packed rows get a dense mask there
    installed = importlib.util.find_spec("flash_attn") is not None  # flash-attn where it is installed
    assert attention_for("cuda") == ("flash_attention_2" if installed else "flex_attention")
    assert attention_for("cuda", "sdpa") == "sdpa"  # a recipe may ask for one
    with pytest.raises(ValueError, match="attn_implementation must be one of"):
        attention_for("cpu", "flash")
    with pytest.raises(ValueError, match="flash_attention_2 computes in fp16 and bf16 only.*bf16-mixed"):
        attention_for("cuda", "flash_attention_2", half=False)
    find_spec = importlib.util.find_spec  # flash-attn installed (it has no CPU build)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: object() if name == "flash_attn" else find_spec(name, *args),
    )
    assert attention_for("cuda") == "flash_attention_2"
    assert (
        attention_for("cuda", half=False) == "flex_attention"
    )  # training in fp32: flash-attn computes no fp32
    # a T4 (7.5) in fp16: flash-attn runs on Ampere and newer only
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (7, 5))
    assert attention_for("cuda") == "flex_attention"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    with pytest.raises(ValueError, match="flash_attention_3 computes in fp16 and bf16 only"):
        attention_for("cuda", "flash_attention_3", half=False)
    # FlashAttention-3's package too: picked on a Hopper GPU only, where transformers takes it
    import transformers.utils

    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: (
            object() if name in ("flash_attn", "flash_attn_interface") else find_spec(name, *args)
        ),
    )
    monkeypatch.setattr(transformers.utils, "is_flash_attn_3_available", lambda: True)
    for capability, expected in (((9, 0), "flash_attention_3"), ((8, 0), "flash_attention_2")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        assert attention_for("cuda") == expected, capability
    monkeypatch.setattr(transformers.utils, "is_flash_attn_3_available", lambda: False)
    assert attention_for("cuda:0") == "flash_attention_2"  # flash_attn_interface from another package
