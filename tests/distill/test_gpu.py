"""Distillation on a CUDA GPU: the same step as on the CPU, a Lightning fit in bf16-mixed whose export loads on
the CPU, and the FSDP2 strategy of the GPU recipes on one GPU (skipped without a GPU)."""

import lightning as L
import pytest
import torch
from lightning.fabric.utilities import move_data_to_device

from swiftkv_core.convert import swiftkv_parameter_names
from swiftkv_distill import DistillDataModule, SwiftKVDistillation
from swiftkv_distill.batches import collate, pack
from swiftkv_distill.export import export
from tests.distill.conftest import llama_70b_parameters, quiet_trainer

pytestmark = pytest.mark.gpu


def test_distillation_step_on_cuda_matches_cpu(tiny_model, fp32_matmuls):
    module = SwiftKVDistillation(
        str(tiny_model), num_key_value_layers=2, kv_init="published", temperature=2.0, logits_chunk_size=5
    )
    module.configure_model()
    with torch.no_grad():  # make the student differ from the teacher
        for name, p in module.named_parameters():
            if "swiftkv" in name:
                p.add_(0.05 * torch.randn_like(p))
    batch = collate(pack([[5, 17, 300, 42, 9, 8], [77, 1000, 3, 4, 5], [12, 13, 14, 15]], max_length=8), 0, 8)

    def loss_and_grads(device, autocast: bool):
        module.to(device)
        on = move_data_to_device(batch, device)
        module.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = module.step(on, 1.0 / on["loss_mask"].sum())
        out["loss"].backward()
        # copies: moving the module moves its .grad tensors in place
        grads = [p.grad.detach().to("cpu", torch.float32, copy=True) for p in module.trainable_parameters()]
        return out["loss"].item(), grads

    cpu_loss, cpu_grads = loss_and_grads("cpu", False)
    cuda_loss, cuda_grads = loss_and_grads("cuda", False)
    bf16_loss, _ = loss_and_grads("cuda", True)
    assert cuda_loss == pytest.approx(cpu_loss, rel=1e-4)
    for got, want in zip(cuda_grads, cpu_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-6)
    assert bf16_loss == pytest.approx(cpu_loss, rel=0.1)


def test_fit_on_gpu_bf16_mixed_then_export_loads_on_cpu(tiny_model, text_file, tmp_path):
    from transformers import AutoModelForCausalLM

    module = SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, learning_rate=1e-2)
    dm = DistillDataModule(str(tiny_model), [str(text_file)], max_length=32, batch_size=2, val_fraction=0.2)
    trainer = quiet_trainer(tmp_path, accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=4)
    module.configure_model()
    frozen = {
        n: p.detach().clone()
        for n, p in module.swiftkv_model.named_parameters()
        if n not in set(swiftkv_parameter_names(module.swiftkv_model))
    }
    trainer.fit(module, dm)
    # trained on the GPU (Lightning moves the module back to the CPU at the end)
    assert trainer.strategy.root_device.type == "cuda"
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert module.init_metrics["kl"] < module.before_metrics["kl"]  # the K/V fit ran on the GPU before step 1
    for name, p in module.swiftkv_model.named_parameters():
        if name in frozen:
            assert torch.equal(p.detach().cpu(), frozen[name].cpu()), f"frozen {name} changed"

    folder = export(module, tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    ids = torch.tensor([[5, 17, 300, 42, 9, 8]])
    # on the CPU with the export's attention: the run's flex_attention or flash-attn is the GPU's
    module.swiftkv_model.config._attn_implementation = loaded.config._attn_implementation
    with torch.no_grad():
        want = module.swiftkv_model.cpu().float()(ids, use_cache=False).logits
        got = loaded(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("compiled", "recompute"),
    [(False, 0), (True, 0), (True, 1)],
    ids=["eager", "compiled", "compiled-recomputed"],
)
def test_fsdp2_strategy_on_one_gpu_matches_unsharded(
    compiled, recompute, tiny_model, text_file, tmp_path, fp32_matmuls
):
    """The GPU recipes' strategy (FSDP2 through ModelParallelStrategy, NCCL) on one GPU: the K/V fit into DTensor
    shards, the sharded steps and the gathered export give what the plain strategy gives; ``compiled``: the sharded
    run with compiled layers (``model.compile_layers``, flex_attention's packed rows; the 8B and 7B recipes),
    ``recompute``: with activation checkpointing too (the 70B recipe), against the plain eager one."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from swiftkv_distill.export import trained_state_dict

    class Record(L.Callback):
        def __init__(self):
            self.losses, self.trained = [], {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

        def on_train_end(self, trainer, pl_module):
            self.trained = trained_state_dict(pl_module)  # collective under FSDP2: before the teardown

    def fit(strategy, compile_layers=False, activation_checkpointing=0):
        L.seed_everything(0)
        module = SwiftKVDistillation(
            str(tiny_model),
            num_key_value_layers=2,
            compile_layers=compile_layers,
            activation_checkpointing=activation_checkpointing,
            learning_rate=3e-3,
            warmup_fraction=0.0,
            min_lr_ratio=1.0,
            evaluate_before_training=False,
        )
        dm = DistillDataModule(
            str(tiny_model),
            [str(text_file)],
            max_length=16,
            batch_size=4,
            val_fraction=0.1,
            max_train_rows=16,
        )
        record = Record()
        trainer = quiet_trainer(
            tmp_path,
            accelerator="gpu",
            devices=1,
            strategy=strategy,
            max_steps=4,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            callbacks=[record],
        )
        trainer.fit(module, dm)
        return record

    plain = fit("auto")
    sharded = fit(ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), compiled, recompute)
    rtol = 1e-3 if compiled else 1e-4  # compiled kernels sum in another order (test_module's tolerance)
    assert len(plain.losses) == len(sharded.losses) == 4
    torch.testing.assert_close(torch.tensor(sharded.losses), torch.tensor(plain.losses), rtol=rtol, atol=1e-6)
    assert plain.trained.keys() == sharded.trained.keys() and plain.trained
    for name, value in plain.trained.items():
        torch.testing.assert_close(sharded.trained[name], value, rtol=rtol, atol=1e-5, msg=name)


def test_a_fit_that_does_not_fit_the_gpu_says_what_to_change(tiny_model, text_file, tmp_path):
    """A real CUDA out-of-memory error: the process may use 1e-5 of the GPU (under 1 MiB; the tiny model's weights
    alone are 26 MB). ``swiftkv distill fit`` ends with one line: where, when, and what to change."""
    from swiftkv_distill.cli import main

    torch.cuda.set_per_process_memory_fraction(1e-5)
    try:
        with pytest.raises(SystemExit) as exit_:
            main(["fit", "--config", "smollm2-135m-gpu", "--model.model", str(tiny_model),
                  "--model.num_key_value_layers", "2", "--model.kv_init", "published",
                  "--model.evaluate_before_training", "false", "--data.train_files", f"[{text_file}]",
                  "--data.val_files", f"[{text_file}]", "--data.max_length", "16", "--data.batch_size", "2",
                  "--trainer.max_steps", "2", "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    message = str(exit_.value.code)
    assert (
        message.startswith("swiftkv distill: out of memory on ")
        and "GiB of tensors at its peak in this phase" in message
    )
    assert "before the first step ended" in message and "2 x 16 tokens per step" in message


def test_a_run_that_cannot_hold_its_weights_on_the_gpu_is_refused_before_reading_them(
    weightless_70b, text_file, tmp_path
):
    """Llama-3.1-70B with bf16 frozen weights on one GPU: refused from its config alone, with the GPUs it needs."""
    from swiftkv_distill.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", "smollm2-135m-gpu", "--model.model", str(weightless_70b),
              "--model.num_key_value_layers", "40", "--model.kv_init", "published", "--model.frozen_dtype",
              "bfloat16", "--data.train_files", f"[{text_file}]", "--data.val_files", f"[{text_file}]",
              "--data.max_length", "16", "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip
    message = str(exit_.value.code)
    assert (
        message.startswith(f"swiftkv distill: {weightless_70b} does not fit the ")
        and f"({llama_70b_parameters(40)[0] * 2 / 2**30:.1f} GiB in bfloat16)" in message
    )
    assert "or more GPUs with FSDP2" in message and "frozen_dtype" not in message.split("To fit:")[1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_windows_half_gradients_are_divided_in_fp32_on_cuda(dtype):
    """On a GPU a 0-d divisor on the device takes the gradient's dtype: a window of 70,000 distilled positions would
    be inf in fp16 (every gradient 0), and rounded in bf16. ``normalise`` divides half gradients in fp32."""
    from swiftkv_distill.step import AccumulationWindow

    window, param = AccumulationWindow(), torch.nn.Parameter(torch.zeros(4, device="cuda", dtype=dtype))
    # 6144 is exact in both dtypes: the only rounding expected is the quotient's, once
    param.grad = torch.full((4,), 6144.0, device="cuda", dtype=dtype)
    window.row_scale(torch.tensor(70001, device="cuda"), processes=1, window=2)
    window.normalise([param])
    assert param.grad.tolist() == [torch.tensor(6144.0 / 70001, dtype=dtype).item()] * 4
