"""Precisions: bf16 only where the device computes it (and the advice where it does not), bf16-mixed training,
bf16-true's fp32 sums, and validation in the weights' dtype."""

from types import SimpleNamespace

import lightning as L
import pytest
import torch

from swiftkv_core.weights import is_swiftkv_parameter
from swiftkv_distill import DistillDataModule, SwiftKVDistillation
from swiftkv_distill.batches import collate, pack
from tests.distill.conftest import quiet_trainer


def test_validation_is_computed_in_the_weights_dtype_under_autocast(tiny_model):
    """bf16-mixed trains in bf16 but validates in the weights' dtype: the held-out figures do not depend on it."""
    module = SwiftKVDistillation(str(tiny_model), num_key_value_layers=2)
    module.configure_model()
    with torch.no_grad():
        for name, p in module.swiftkv_model.named_parameters():
            if is_swiftkv_parameter(name):
                p.add_(0.05 * torch.randn_like(p))
    batch = collate(pack([[5, 17, 300, 42, 9, 8], [77, 1000, 3, 4, 5]], max_length=8), 0, 8)
    plain = module.step.evaluate(batch).stats
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = module.step.evaluate(batch).stats
        trained = module.step(batch, 1.0 / batch["loss_mask"].sum())  # the training step does run in bf16
    for name in ("kl", "agree", "student_nll", "teacher_nll"):
        a, b = getattr(plain, name), getattr(under_autocast, name)
        assert (
            torch.equal(a, b) if name == "agree" else torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
        ), name
    assert not torch.allclose(trained["kl"] / trained["tokens"], plain.kl.mean(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("native", [True, False])
def test_bf16_precision_only_where_the_cpu_has_bf16(monkeypatch, native):
    from swiftkv_distill.build import cpu_precision

    monkeypatch.setattr("swiftkv_distill.build.cpu_has_fast_bf16", lambda: native)
    assert cpu_precision("bf16-mixed") == ("bf16-mixed" if native else "32-true")
    assert cpu_precision("32-true") == "32-true"


class ComputedDtypes(L.Callback):
    """The dtypes the last layer's MLP computes in during the training steps."""

    def __init__(self):
        self.seen, self.in_step = set(), False

    def on_train_start(self, trainer, pl_module):
        mlp = pl_module.swiftkv_model.model.layers[-1].mlp
        mlp.register_forward_hook(lambda module, args, output: self.in_step and self.seen.add(output.dtype))

    def on_train_batch_start(self, *args):
        self.in_step = True

    def on_train_batch_end(self, *args):
        self.in_step = False


def test_bf16_mixed_trains(tiny_model, text_file, tmp_path, monkeypatch):
    """bf16-mixed: the steps compute in bf16 and update fp32 master weights."""
    # as on a CPU without native bf16, where the run also says how to run faster
    monkeypatch.setattr("swiftkv_distill.build.cpu_has_fast_bf16", lambda: False)
    module = SwiftKVDistillation(
        str(tiny_model), num_key_value_layers=2, learning_rate=1e-2, evaluate_before_training=False,
        kv_init="published",
    )  # fmt: skip
    dm = DistillDataModule(str(tiny_model), [str(text_file)], max_length=32, batch_size=2)
    dtypes = ComputedDtypes()
    trainer = quiet_trainer(
        tmp_path,
        max_steps=2,
        precision="bf16-mixed",
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[dtypes],
    )
    with pytest.warns(UserWarning, match="bf16 is emulated here.*--trainer.precision 32-true"):
        trainer.fit(module, dm)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert dtypes.seen == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in module.trainable_parameters())  # fp32 master weights
    start = dict(module.build_step().named_parameters())  # the published init, as the run started
    trained = {name: p for name, p in module.step.named_parameters() if p.requires_grad}
    assert trained and all(not torch.equal(p, start[name]) for name, p in trained.items())


def test_bf16_true_keeps_the_position_weights_and_the_validation_sums_in_fp32(
    tiny_model, text_file, tmp_path
):
    """bf16-true converts the whole LightningModule to bf16 and makes bf16 the default dtype in its steps: the
    weight of each distilled position (1 / their count: 6.14e-4 for 6.15e-4 at 13k in bf16) and the validation's
    running sums (3% high after 40 x 8192 values) stay fp32."""
    from swiftkv_distill.step import AccumulationWindow

    torch.set_default_dtype(torch.bfloat16)  # as in Lightning's bf16-true steps
    try:
        scale = AccumulationWindow().row_scale(torch.tensor(13001), processes=8, window=1)
    finally:
        torch.set_default_dtype(torch.float32)
    assert scale.dtype == torch.float32 and scale.item() == pytest.approx(8 / 13001, rel=1e-6)
    module = SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, evaluate_before_training=False)
    dm = DistillDataModule(
        str(tiny_model), [str(text_file)], val_files=[str(text_file)], max_length=32, batch_size=2
    )
    trainer = quiet_trainer(
        tmp_path, max_steps=2, precision="bf16-true", limit_val_batches=1, num_sanity_val_steps=0
    )
    trainer.fit(module, dm)
    assert torch.isfinite(trainer.callback_metrics["train/loss"]) and module.last_val_metrics["kl"] >= 0
    assert module.swiftkv_model.lm_head.weight.dtype == torch.bfloat16
    states = [
        t for m in module.val_metrics.modules() if hasattr(m, "_defaults") for t in m.metric_state.values()
    ]
    assert states and all(t.dtype == torch.float32 for t in states)


def test_bf16_on_a_gpu_without_it_is_refused_saying_what_to_set(monkeypatch):
    """A V100 or T4 (compute capability < 8.0) computes no bf16: a bf16 recipe there is refused before any weight is
    read, naming fp16's precision instead; other precisions, devices and GPUs pass."""
    from swiftkv_distill.build import check_precision

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda, bf16 = torch.device("cuda"), SimpleNamespace(precision="bf16-mixed")
    for major in (7, 8):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, major=major: (major, 0))
        supported = major >= 8
        if not supported:
            with pytest.raises(
                ValueError, match="Tesla V100-SXM2-16GB has no bf16.*trainer.precision: 16-mixed"
            ):
                check_precision(cuda, bf16)
        else:
            check_precision(cuda, bf16)
        check_precision(cuda, SimpleNamespace(precision="16-mixed"))
        check_precision(torch.device("cpu"), bf16)
    # FSDP2 (Lightning's ModelParallelStrategy) takes no 16-mixed: fp32 is named there instead
    from lightning.pytorch.strategies import ModelParallelStrategy

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    sharded = SimpleNamespace(precision="bf16-mixed", strategy=ModelParallelStrategy(1, 1))
    with pytest.raises(ValueError, match="has no bf16.*trainer.precision: 32-true"):
        check_precision(cuda, sharded)
