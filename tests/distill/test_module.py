"""The LightningModule: shared prefix == separate passes, frozen/trainable split, clear errors before compute."""

import json
import time
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from swiftkv_core.weights import is_swiftkv_parameter, swiftkv_parameter_names
from swiftkv_distill import DistillDataModule, LossSettings, SwiftKVDistillation
from swiftkv_distill.batches import collate, pack
from swiftkv_distill.build import attention_for, checkpoint_activations, compile_layers
from swiftkv_distill.loss import distillation_kl
from swiftkv_distill.step import sampled_positions
from tests.distill.conftest import quiet_trainer


def test_shared_prefix_step_equals_two_full_passes(tiny_model):
    """Prefix once + two suffixes gives exactly the loss of a separate teacher forward and student forward."""
    module = SwiftKVDistillation(
        str(tiny_model), num_key_value_layers=2, temperature=2.0, hidden_loss_weight=0.0, logits_chunk_size=5
    )
    module.configure_model()
    model = module.swiftkv_model
    with torch.no_grad():  # make the student differ from the teacher
        for name, p in model.named_parameters():
            if is_swiftkv_parameter(name):
                p.add_(0.05 * torch.randn_like(p))
    batch = collate(pack([[5, 17, 300, 42, 9, 8], [77, 1000, 3, 4, 5], [12, 13, 14, 15]], max_length=8), 0, 8)
    out = module.step(batch, 1.0 / batch["loss_mask"].sum())

    mask = batch["loss_mask"]
    kwargs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    with torch.no_grad():
        teacher = model.swiftkv(False)(**kwargs).logits[mask]
    student = model.swiftkv(True)(**kwargs).logits[mask]
    log_ps, log_pt = torch.log_softmax(student / 2, -1), torch.log_softmax(teacher / 2, -1)
    expected = (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean() * 4
    torch.testing.assert_close(out["loss"], expected, rtol=1e-4, atol=1e-6)


def test_distilling_a_subset_of_positions_equals_the_full_forward_there(tiny_model):
    """positions=P: the loss AND its gradients equal those of full teacher/student forwards restricted to P (the
    student's later layers ran for P only, yet every position's K/V got its gradient as keys and values)."""
    module = SwiftKVDistillation(
        str(tiny_model), num_key_value_layers=2, temperature=2.0, position_fraction=0.5, logits_chunk_size=3
    )
    module.configure_model()
    model = module.swiftkv_model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_swiftkv_parameter(name):
                p.add_(0.05 * torch.randn_like(p))
    batch = collate(pack([[5, 17, 300, 42, 9, 8], [77, 1000, 3, 4, 5], [12, 13, 14, 15]], max_length=8), 0, 8)
    positions = sampled_positions(8, 0.5, 0, "cpu")
    assert len(positions) == 4 and torch.equal(
        positions, sampled_positions(8, 0.5, 0, "cpu")
    )  # seeded by step
    mask = batch["loss_mask"][:, positions]
    seen = []
    hook = model.model.layers[3].mlp.gate_proj.register_forward_hook(
        lambda m, args, out: seen.append(args[0].shape[1])
    )
    out = module.step(batch, 1.0 / mask.sum(), positions=positions)
    hook.remove()
    assert seen == [8, 4]  # the teacher's layer 3 saw every position, the student's only the 4 distilled
    out["loss"].backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    kwargs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    with torch.no_grad():
        teacher = model.swiftkv(False)(**kwargs).logits[:, positions][mask]
    student = model.swiftkv(True)(**kwargs).logits[:, positions][mask]
    log_ps, log_pt = torch.log_softmax(student / 2, -1), torch.log_softmax(teacher / 2, -1)
    expected = (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean() * 4
    expected.backward()
    torch.testing.assert_close(out["loss"], expected, rtol=1e-4, atol=1e-6)
    assert got and got.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, grad in got.items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, rtol=1e-3, atol=1e-6)


def test_early_exit_loss_and_hidden_loss_are_added(tiny_model):
    module = SwiftKVDistillation(
        str(tiny_model), num_key_value_layers=1, temperature=2.0, hidden_loss_weight=0.5, early_exit=True,
        early_exit_weight=1.0, logits_chunk_size=3,
    )  # fmt: skip
    module.configure_model()
    batch = collate(pack([[5, 17, 300, 42, 9, 8, 7, 6]], max_length=8), 0, 8)
    assert module.step.settings == LossSettings(
        temperature=2.0, hidden_loss_weight=0.5, early_exit_weight=1.0, chunk_size=3
    )
    out = module.step(batch, 1 / 8)
    # l = 1: the last layer's input differs from the teacher's (at l = L - 2 the converted layer l is the original)
    assert out["loss"].requires_grad and out["hidden_mse"] > 0 and out["early_exit_kl"] > 0
    # each distilled position weighs 1/8 (the metrics are sums over them); the KLs at T = 2 are scaled by T^2
    expected = (4 * out["kl"] + 0.5 * out["hidden_mse"] + 1.0 * 4 * out["early_exit_kl"]) / 8
    torch.testing.assert_close(out["loss"].detach(), expected.float(), rtol=1e-5, atol=1e-7)
    out["loss"].backward()
    head = module.step.early_exit_head
    assert head.lm_head.weight.grad is not None and head.norm.weight.grad is not None
    assert module.swiftkv_model.lm_head.weight.grad is None


def test_only_swiftkv_parameters_train_and_teacher_is_bit_identical(tiny_model, text_file, tmp_path):
    module = SwiftKVDistillation(
        str(tiny_model), num_key_value_layers=2, learning_rate=1e-2, evaluate_before_training=False
    )
    module.configure_model()
    model = module.swiftkv_model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(swiftkv_parameter_names(model)) and trainable
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    dm = DistillDataModule(str(tiny_model), [str(text_file)], max_length=32, batch_size=2)
    trainer = quiet_trainer(tmp_path, max_steps=4, limit_val_batches=0)
    trainer.fit(module, dm)
    after = model.state_dict()
    for name, value in before.items():
        if name in trainable:
            assert not torch.equal(value, after[name]), f"{name} did not train"
        else:
            assert torch.equal(value, after[name]), f"frozen {name} changed"


def test_the_modules_state_is_its_trained_weights_and_a_strict_load_wants_each(tiny_model):
    """What a checkpoint holds (one file, or FSDP2's shards): the trained weights alone. A checkpoint lacking one is
    refused, naming it; the frozen weights a checkpoint leaves out stay as loaded from the model."""
    module = SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, evaluate_before_training=False)
    module.configure_model()
    state = module.state_dict()
    trained = {f"step.model.{n}" for n, p in module.swiftkv_model.named_parameters() if p.requires_grad}
    assert set(state) == trained and trained
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    changed = {name: torch.randn_like(value) for name, value in state.items()}
    assert module.load_state_dict(changed).missing_keys == []
    for name, value in changed.items():
        assert torch.equal(module.get_parameter(name), value), name
    for name, value in frozen.items():
        assert torch.equal(module.get_parameter(name), value), name
    lacking = sorted(changed)[0]
    with pytest.raises(
        RuntimeError, match=rf"does not hold this run's trained weights: missing \['{lacking}'\]"
    ):
        module.load_state_dict({k: v for k, v in changed.items() if k != lacking})
    assert module.load_state_dict(changed | {"step.extra": torch.zeros(1)}, strict=False).unexpected_keys == [
        "step.extra"
    ]
    # inside a module holding it (Lightning's weight averaging), the holder's own entries stay
    holder = torch.nn.Module()
    holder.module = module
    holder.register_buffer("n_averaged", torch.tensor(0))
    assert set(holder.state_dict()) == {"n_averaged"} | {f"module.{name}" for name in trained}


def test_unknown_family_and_bad_l_fail_before_loading(tmp_path, tiny_model):
    config = json.loads((tiny_model / "config.json").read_text())
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2})
    )
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported.*llama"):
        SwiftKVDistillation(str(gpt2), num_key_value_layers=1)
    for l in (0, config["num_hidden_layers"], 99):
        with pytest.raises(ValueError, match="out of range"):
            SwiftKVDistillation(str(tiny_model), num_key_value_layers=l)
    with pytest.raises(ValueError, match="key_value_group_size=3"):
        SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, key_value_group_size=3)
    with pytest.raises(ValueError, match="nowhere does not exist"):
        SwiftKVDistillation(str(tmp_path / "nowhere"), num_key_value_layers=2)


def test_chunked_loss_memory_is_bounded():
    """The backward keeps only (N, H) gradients, never (N, V) logits: check the saved tensors."""
    student = torch.randn(64, 16, requires_grad=True)
    loss, _, _ = distillation_kl(student, torch.randn(64, 16), torch.randn(5000, 16), torch.ones(64), 2.0, 8)
    saved = [t for t in loss.grad_fn.saved_tensors if t is not None]
    assert all(t.numel() <= 64 * 16 for t in saved)


@pytest.mark.parametrize("kv_init", ["least_squares", "published"])
def test_kv_init_runs_once_before_training(tiny_model, text_file, tmp_path, kv_init):
    """least_squares: fitted before the first step, measured (init/*) and closer to the teacher than the published
    init (before/*); published: the converted weights are trained as they are."""
    module = SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, learning_rate=0.0, kv_init=kv_init)
    dm = DistillDataModule(str(tiny_model), [str(text_file)], max_length=32, batch_size=2, val_fraction=0.2)
    trainer = quiet_trainer(tmp_path, max_steps=1)
    trainer.fit(module, dm)
    before = module.before_metrics
    if kv_init == "published":
        assert not module.init_metrics and not module.kv_init_report
        return
    report, init = module.kv_init_report, module.init_metrics
    assert report["tokens"] == sum(len(r["input_ids"]) for r in dm.train_rows)  # fewer than kv_init_tokens
    assert 0 < report["explained_mean"] <= 1
    assert init["kl"] < 0.5 * before["kl"] and init["agreement"] >= before["agreement"]
    # lr 0: the one step changed nothing, so the final measurement is the init's
    assert module.last_val_metrics["kl"] == pytest.approx(init["kl"], rel=1e-5)


def test_bad_kv_init_and_position_fraction_are_refused(tiny_model):
    with pytest.raises(ValueError, match="kv_init must be one of"):
        SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, kv_init="random")
    with pytest.raises(ValueError, match="position_fraction must be in"):
        SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, position_fraction=0.0)
    with pytest.raises(ValueError, match="activation_checkpointing must be an integer >= 0"):
        SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, activation_checkpointing=True)


def test_activation_checkpointing_gives_the_same_step(tiny_model):
    """activation_checkpointing=1: the student's layers >= l are recomputed in the backward pass (HF's gradient
    checkpointing), the layers < l still run without a graph; the loss and the gradients are the same."""
    batch = collate(pack([[5, 17, 300, 42, 9, 8], [77, 1000, 3, 4, 5], [12, 13, 14, 15]], max_length=8), 0, 8)
    results = []
    for every in (0, 1):
        module = SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, activation_checkpointing=every)
        module.configure_model()
        model = module.swiftkv_model
        assert [layer.gradient_checkpointing for layer in model.model.layers] == [bool(every)] * 4
        torch.manual_seed(0)
        with torch.no_grad():  # make the student differ from the teacher
            for name, p in model.named_parameters():
                if is_swiftkv_parameter(name):
                    p.add_(0.05 * torch.randn_like(p))
        recomputed = []
        model.model.layers[3].mlp.gate_proj.register_forward_hook(lambda *_, seen=recomputed: seen.append(1))
        prefix_graph = []
        model.model.layers[1].register_forward_hook(
            lambda m, a, out, seen=prefix_graph: seen.append(out.requires_grad)
        )
        out = module.step(batch, 1.0 / batch["loss_mask"].sum())
        out["loss"].backward()
        assert prefix_graph == [False]  # the prefix ran once, without a graph
        assert len(recomputed) == 2 + every  # teacher, student, and the student's recompute
        results.append((out["loss"], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (plain_loss, plain_grads), (loss, grads) = results
    assert_close = torch.testing.assert_close
    assert_close(loss, plain_loss, rtol=0, atol=0)
    assert grads.keys() == plain_grads.keys() and grads
    for name, grad in plain_grads.items():
        assert_close(grads[name], grad, rtol=0, atol=0, msg=name)
    checkpoint_activations(model, 0)  # off again (benchmarks/gpu.py's setups after an out-of-memory one)
    assert not model.is_gradient_checkpointing
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)


def test_distillation_step_timer_waits_for_the_device(monkeypatch, tiny_model, text_file, tmp_path):
    """train/tokens_per_s of each step is timed from a clock read after the device finished what was queued before
    the step to one read after it finished the step's backward (module._now): each reading of the clock it uses
    follows a synchronisation at once. A checkpoint written at the step's end (Lightning runs the callbacks' batch-end
    hooks before the module's) is not the step's time."""
    from swiftkv_core import runtime

    events = []
    real = runtime.synchronize
    monkeypatch.setattr(runtime, "synchronize", lambda device: (events.append(("sync", None)), real(device)))

    def clock():
        events.append(("clock", time.perf_counter()))
        return events[-1][1]

    monkeypatch.setattr(runtime, "time", SimpleNamespace(perf_counter=clock))
    module = SwiftKVDistillation(
        str(tiny_model), num_key_value_layers=2, kv_init="published", evaluate_before_training=False
    )
    step, log = module.training_step, module.log

    def training_step(batch, batch_idx):
        events.append(("step", (module._step_started, int(batch["token_mask"].sum()))))
        return step(batch, batch_idx)

    def logged(name, value, *args, **kwargs):
        events.append((name, value))
        return log(name, value, *args, **kwargs)

    monkeypatch.setattr(module, "training_step", training_step)
    monkeypatch.setattr(module, "on_after_backward", lambda: events.append(("backward", None)))
    monkeypatch.setattr(module, "log", logged)
    save = module.on_save_checkpoint
    monkeypatch.setattr(
        module, "on_save_checkpoint", lambda c: (events.append(("checkpoint", None)), save(c))
    )
    data = DistillDataModule(str(tiny_model), [str(text_file)], max_length=32, batch_size=2, max_train_rows=4)
    every_step = ModelCheckpoint(
        dirpath=tmp_path / "checkpoints", every_n_train_steps=1, save_top_k=0, save_last=True
    )
    trainer = quiet_trainer(
        tmp_path, max_steps=2, limit_val_batches=0, enable_checkpointing=True, callbacks=[every_step]
    )
    trainer.fit(module, data)

    synced = [value for before, (kind, value) in pairwise(events) if kind == "clock" and before[0] == "sync"]
    starts = [i for i, (kind, _) in enumerate(events) if kind == "step"]
    rates = [i for i, (kind, _) in enumerate(events) if kind == "train/tokens_per_s"]
    assert len(starts) == len(rates) == 2
    for start, rate in zip(starts, rates, strict=True):
        started, tokens = events[start][1]
        assert started in synced  # the step's clock started after a synchronisation
        backward = max(i for i in range(start, rate) if events[i][0] == "backward")
        stopped = started + tokens / events[rate][1]  # the clock reading the rate was computed from
        checkpoint = next(i for i in range(start, rate) if events[i][0] == "checkpoint")
        after = [v for v in synced if backward < events.index(("clock", v)) < checkpoint]
        assert any(abs(v - stopped) < 1e-6 for v in after), (
            "timed before the backward, or after the checkpoint"
        )


@pytest.mark.parametrize("stop", ["max_steps", "budget"])
def test_train_seconds_stop_where_training_stops(monkeypatch, tiny_model, text_file, tmp_path, stop):
    """The final evaluation is not training: ``train_seconds`` (the summary's, and its tokens/s over the run) stops
    before it, and stays put after the fit. At ``max_steps`` the module's ``on_train_end`` evaluates; stopped by a
    callback (``BudgetProgress``: the main job's way) Lightning validates inside its training loop (before, those
    seconds counted: the main job's report said 14.1 min of training for its 12-minute budget)."""
    from swiftkv_distill.callbacks import BudgetProgress

    module = SwiftKVDistillation(
        str(tiny_model), num_key_value_layers=2, kv_init="published", evaluate_before_training=False
    )
    seen = {}

    def first_evaluation(method):
        def call(*args, **kwargs):
            seen.setdefault("started", module._now() - module._fit_started)
            return method(*args, **kwargs)

        return call

    monkeypatch.setattr(module, "evaluate", first_evaluation(module.evaluate))
    monkeypatch.setattr(module, "validation_step", first_evaluation(module.validation_step))
    data = DistillDataModule(
        str(tiny_model), [str(text_file)], val_files=[str(text_file)], max_length=32, batch_size=2,
        max_train_rows=8, max_val_rows=2,
    )  # fmt: skip
    # an epoch of 4 steps: no validation during the fit but the final one; the budget is spent at the first step
    callbacks = [BudgetProgress(1e-9)] if stop == "budget" else []
    quiet_trainer(tmp_path, max_steps=2, num_sanity_val_steps=0, callbacks=callbacks).fit(module, data)
    assert "started" in seen and module.global_step == (2 if stop == "max_steps" else 1)
    trained = module.train_seconds
    assert 0 < trained <= seen["started"]
    time.sleep(0.01)
    assert module.train_seconds == trained  # it no longer follows the clock


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_compiled_layers_train_as_the_eager_ones(accelerator, tiny_model, text_file, tmp_path, fp32_matmuls):
    """compile_layers=True: a real fit (the least-squares K/V init through its hooks, eager; then training and the
    final evaluation with every decoder layer torch.compiled) ends with the eager run's weights and metrics. On a
    GPU the run's own attention is flex_attention, in fp32 on both sides (flash-attn is for fp16 and bf16 only)."""
    runs = []
    tolerance = dict(rtol=1e-4, atol=1e-6) if accelerator == "cpu" else dict(rtol=1e-3, atol=1e-5)
    for compiled in (False, True):
        torch.manual_seed(0)
        module = SwiftKVDistillation(str(tiny_model), num_key_value_layers=2, compile_layers=compiled)
        data = DistillDataModule(
            str(tiny_model),
            [str(text_file)],
            max_length=32,
            batch_size=2,
            max_train_rows=8,
            val_fraction=0.25,
        )
        quiet_trainer(tmp_path / str(compiled), accelerator=accelerator, max_steps=3).fit(module, data)
        attention = module.swiftkv_model.config._attn_implementation
        assert attention == ("sdpa" if accelerator == "cpu" else attention_for("cuda", half=False))
        layers = module.swiftkv_model.model.layers
        assert [layer._compiled_call_impl is not None for layer in layers] == [compiled] * len(layers)
        wrappers = [layer._compiled_call_impl for layer in layers]
        compile_layers(module.swiftkv_model, compiled)  # a second call leaves compiled layers as they are
        assert [layer._compiled_call_impl for layer in layers] == wrappers
        trained = {
            n: p.detach().clone() for n, p in module.swiftkv_model.named_parameters() if p.requires_grad
        }
        runs.append((module.kv_init_report, module.last_val_metrics, trained))
    (eager_init, eager_val, eager_weights), (init, val, weights) = runs
    assert init.keys() == eager_init.keys() and init["tokens"] == eager_init["tokens"] > 0
    assert val.keys() == eager_val.keys() and val
    for name, value in eager_val.items():
        assert val[name] == pytest.approx(value, rel=tolerance["rtol"], abs=tolerance["atol"]), name
    assert weights.keys() == eager_weights.keys() and weights
    for name, weight in eager_weights.items():
        torch.testing.assert_close(weights[name], weight, **tolerance, msg=name)
