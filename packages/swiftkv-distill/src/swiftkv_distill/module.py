"""The SwiftKV distillation LightningModule, on the one model definition of swiftkv_core.

One copy of the base weights, frozen; the SwiftKV projections (and an optional early-exit head) train. The model is
built in build.py, the step and its loss in step.py, the FSDP2 sharding in parallelize.py, the learning-rate
schedule in schedule.py, the HF export in export.py; this file wires them into Lightning's hooks.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

from swiftkv_core.checkpoints import check_checkpoint, model_identity
from swiftkv_core.convert import SWIFTKV_FAMILIES
from swiftkv_core.faults import pause_point
from swiftkv_core.kv_init import KVLeastSquares
from swiftkv_core.runtime import DTYPES, Stopwatch

from .build import (
    attention_for,
    check_activation_checkpointing,
    check_kv_init,
    check_lora,
    check_same_run,
    compile_layers,
    distillation_step,
    run_device,
    sized_step,
    warn_if_bf16_emulated,
)
from .checkpointing import TrainedWeightsOnly
from .console import Phases
from .parallelize import check_data_parallel_only, shard_from_rank0, sum_over_processes
from .schedule import StepSchedule, check_optimizer_settings, check_run_length, total_steps
from .step import (
    AccumulationWindow,
    DistillationStep,
    LossSettings,
    TokenCount,
    ValidationMetrics,
    sampled_positions,
)


class SwiftKVDistillation(TrainedWeightsOnly, Phases, L.LightningModule):
    """Distil a SwiftKV model from its own base model (teacher = the same weights with SwiftKV off).

    Args:
        model: base model (Llama / Mistral / Qwen2 HF checkpoint folder, or ``"default"`` for SmolLM2-135M-Instruct)
            or a SwiftKV checkpoint to continue from.
        num_key_value_layers: ``l``: layers ``>= l`` get their K/V from the hidden state entering layer ``l``.
        key_value_group_size: AcrossKV group size (1: no sharing across layers).
        temperature: softening temperature T of the KL (the loss is scaled by T^2).
        hidden_loss_weight: weight of the MSE between teacher and student hidden states entering the last layer.
        early_exit: also train an LM head on the hidden state entering layer ``l`` (saved with the checkpoint).
        early_exit_weight: weight of the early-exit head's distillation loss.
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        warmup_fraction: linear warm-up over this fraction of the steps.
        min_lr_ratio: the cosine schedule decays to ``learning_rate * min_lr_ratio``.
        logits_chunk_size: positions per chunk of full-vocabulary logits (memory vs speed).
        model_dtype: dtype the weights are loaded in (``float32``; ``bfloat16`` for large models on GPU).
        frozen_dtype: dtype the frozen weights (all but the trained SwiftKV ones) are kept in (default:
            ``model_dtype``). ``bfloat16`` with ``float32`` weights and ``bf16-mixed`` keeps fp32 master weights for
            what trains and halves the teacher's memory (an 8B model distils on one 80 GB GPU:
            benchmarks/results/gpu-llama-3.1-8b.md) and its FSDP2 gathers. A checkpoint stored in this dtype is
            read in it (only the trained weights widened).
        evaluate_before_training: log the undistilled model's validation metrics (``before/*``) before training.
        reshard_after_forward: FSDP2 (ModelParallelStrategy only): free gathered layer weights after each forward.
        attn_implementation: ``auto`` (``build.attention_for``: flash-attn's variable-length kernels on a GPU where
            installed, else ``flex_attention``; ``sdpa`` on a CPU), or one of ``sdpa``, ``eager``,
            ``flex_attention``, ``flash_attention_2``, ``flash_attention_3``. Each gives the same numbers.
        schedule_seconds: run the warm-up + cosine schedule over this much wall time (from the first step, summed
            over resumed runs) instead of over ``max_steps``, for a run with a time budget (pair with
            ``trainer.max_time``). The schedule then depends on the machine's speed: runs are not bit-identical.
        kv_init: how ``k/v_proj_swiftkv`` start: ``"least_squares"`` fits them in closed form to the teacher's K/V
            on ``kv_init_tokens`` training tokens before the first step (swiftkv_core.kv_init; a fresh run from a
            base model only); ``"published"`` keeps the published copy-of-``k/v_proj`` initialisation.
        kv_init_tokens: training tokens (over all processes) the least-squares fit reads.
        kv_init_ridge: ridge penalty of the fit, relative to the mean diagonal of ``x^T x``.
        kv_init_weighting: ``"attention"``: weight each token's K/V error by the attention the teacher pays it (more
            exact where it matters; eager attention during the fit and one hidden x hidden matrix per layer and KV
            head); ``"uniform"``: plain least squares (one such matrix in all: for large models).
        position_fraction: distil a random fraction of each row's positions per step (a new draw every step). The
            student's layers >= l and both LM heads then run for those positions only (the SwiftKV saving, applied
            to training), while the K/V of every position still gets gradient as keys and values. 1: all.
        hard_label_weight: weight of an added hard-label term, the student's cross-entropy on the teacher's top-1
            token (loss.py). 0 (default): pure KL (measurements: benchmarks/results/recipe-notes.md).
        lora_rank: rank of student-only adapters on o_proj and the MLP of layers >= l (0: Q/K/V only).
        lora_prefix: adapters on the MLP of layers ``< l`` too (the prefix then runs twice per step).
        activation_checkpointing: recompute the activations of every n-th decoder layer in the backward pass
            (0: off; 1: every layer: each of the student's layers >= l keeps its input alone, for one more forward
            of them per step; ``build.checkpoint_activations``). For long rows and large models (the 70B recipe);
            measured in distill-memory-cpu-8b-widths.md.
        compile_layers: ``torch.compile`` each decoder layer when training starts (``build.compile_layers``).
            Measured in distill-compile.md and gpu-llama-3.1-8b-distill.md.
    """

    def __init__(
        self,
        model: str = "default",
        num_key_value_layers: int = 15,
        key_value_group_size: int = 1,
        temperature: float = 2.0,
        hidden_loss_weight: float = 0.0,
        early_exit: bool = False,
        early_exit_weight: float = 1.0,
        learning_rate: float = 2e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_fraction: float = 0.05,
        min_lr_ratio: float = 0.1,
        logits_chunk_size: int = 512,
        model_dtype: str = "float32",
        frozen_dtype: str | None = None,
        evaluate_before_training: bool = True,
        reshard_after_forward: bool = True,
        attn_implementation: str = "auto",
        schedule_seconds: float | None = None,
        kv_init: str = "least_squares",
        kv_init_tokens: int = 32768,
        kv_init_ridge: float = 1e-4,
        kv_init_weighting: str = "attention",
        position_fraction: float = 1.0,
        hard_label_weight: float = 0.0,
        lora_rank: int = 0,
        lora_prefix: bool = False,
        activation_checkpointing: int = 0,
        compile_layers: bool = False,
    ):
        super().__init__()
        check_kv_init(kv_init, kv_init_tokens, kv_init_ridge, kv_init_weighting)
        check_optimizer_settings(
            learning_rate, weight_decay, betas, warmup_fraction, min_lr_ratio, schedule_seconds
        )
        if not 0 < position_fraction <= 1:
            raise ValueError(f"position_fraction must be in (0, 1], got {position_fraction}.")
        check_lora(lora_rank, lora_prefix)  # these and an unknown attention fail before any weight is loaded
        check_activation_checkpointing(activation_checkpointing)
        attention_for("cpu", attn_implementation)
        for name, value in (("model_dtype", model_dtype), ("frozen_dtype", frozen_dtype or model_dtype)):
            if value not in DTYPES:
                raise ValueError(f"{name} must be one of {sorted(DTYPES)}, got {value!r}.")
        self.save_hyperparameters()
        self.loss_settings = LossSettings(  # checks its values
            temperature=temperature,
            hidden_loss_weight=hidden_loss_weight,
            early_exit_weight=early_exit_weight,
            hard_label_weight=hard_label_weight,
            chunk_size=logits_chunk_size,
        )
        # Fails here, before any weight is loaded, for an unknown family or an l out of range.
        self.model_path, self.model_config = check_checkpoint(
            model, num_key_value_layers, key_value_group_size
        )
        self.step: DistillationStep | None = None
        self.resume_from: str | None = None  # the checkpoint fit resumes from (recipe.py's fits): no K/V init
        self.val_metrics = nn.ModuleList([ValidationMetrics()])  # one per validation set (grown on demand)
        self.before_metrics: dict[str, float] = {}  # the converted model (published init), before training
        self.init_metrics: dict[str, float] = {}  # after the least-squares K/V init, before training
        self.kv_init_report: dict[str, float] = {}
        self.last_val_metrics: dict[str, float] = {}
        self.last_val_step = -1
        self._tokens = TokenCount()
        self._window = AccumulationWindow()  # the gradient-accumulation window (made anew as each fit starts)
        self._step_started: float | None = None
        self._step_ended: float | None = None  # after the optimizer step, before the callbacks' batch end
        self._fit_started: float | None = None  # the clock (_now) at the first step, less resumed time
        self._fit_ended: float | None = None  # the clock when training stopped, before the final evaluation
        self._resumed_seconds = 0.0  # train_seconds when the resumed checkpoint was written
        self._model_identity: dict | None = None  # of model_path, written into checkpoints (rank 0)

    # --- model -------------------------------------------------------------------------------------------------
    def build_step(self, weights: bool = True) -> DistillationStep:
        """A fresh, unsharded step (``build.distillation_step``; ``weights=False``: from the config alone)."""
        trainer = self._trainer
        return distillation_step(self.hparams, run_device(trainer), trainer, self.loss_settings, weights)

    def configure_model(self) -> None:
        if self.step is not None:
            return
        # the model the frozen weights are read from, as now, for checkpoints: a resume refuses another one
        # (build.check_same_model); on the one rank that writes them
        if self._trainer is None or self._trainer.is_global_zero:
            self._model_identity = model_identity(self.model_path)
        sized = sized_step(self, self._trainer)
        check_data_parallel_only(self.device_mesh)
        if self.device_mesh is None:
            self.step = self.build_step()
        else:  # ModelParallelStrategy: shard with FSDP2; only rank 0 reads the weights
            mesh, reshard = self.device_mesh["data_parallel"], self.hparams.reshard_after_forward
            device = run_device(self._trainer)
            self.step = shard_from_rank0(sized, self.build_step, mesh, device, reshard)

    @property
    def swiftkv_model(self):
        return self.step.model

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    # --- training ----------------------------------------------------------------------------------------------
    # ``self.trainer`` raises when no Trainer is attached (load_from_checkpoint): these read ``_trainer``
    def _world_size(self) -> int:
        return self._trainer.world_size if self._trainer is not None else 1

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        world, window = self._world_size(), self.trainer.accumulate_grad_batches
        length, fraction = batch["input_ids"].shape[1], self.hparams.position_fraction
        positions = sampled_positions(length, fraction, self.global_step, batch["input_ids"].device)
        distilled = batch["loss_mask"] if positions is None else batch["loss_mask"][:, positions]
        # each distilled position's weight: the step's gradient is their mean over every process and batch
        tokens = sum_over_processes(distilled.sum(), world)
        row_scale = self._window.row_scale(tokens, world, window)
        out = self.step(batch, row_scale, positions=positions)
        pause_point("training-step")  # mid-step: the forward done, the backward and the update to come
        # this process's share of each of the step's means, and its real tokens: ONE all-reduce sums them all (in
        # float32: the tokens are exact up to 2**24 a step, 16.8M)
        shares = self._window.shares(out, row_scale, tokens)
        local = torch.stack([*shares.values(), batch["token_mask"].sum().float()])
        *means, real = sum_over_processes(local, world)
        self._tokens.add(real)
        for name, value in zip(shares, means, strict=True):
            self.log(f"train/{name}", value, prog_bar=name in ("loss", "agreement"), on_step=True, on_epoch=False,
                     batch_size=batch["input_ids"].shape[0])  # fmt: skip
        return out["loss"]

    @property
    def tokens_seen(self) -> int:
        """The real tokens trained on, by every process, since the first step (summed over resumed runs)."""
        return self._tokens.seen

    @property
    def train_seconds(self) -> float:
        """Wall time since the first training step, until training stopped (the final evaluation is not training),
        summed over a resume's interrupted runs (the schedule's clock under ``schedule_seconds``)."""
        if self._fit_started is None:
            return self._resumed_seconds
        return (self._now() if self._fit_ended is None else self._fit_ended) - self._fit_started

    def _now(self) -> float:
        """The training timers' clock, read once the device's queued work is done (a GPU step: its kernels)."""
        return Stopwatch(self.device).now()

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._step_started = self._now()
        if self._fit_started is None:  # a resumed run's clock goes on from the checkpoint's elapsed time
            self._fit_started = self._step_started - self._resumed_seconds

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        def closure():  # the window's last batch, then its mean before any hook, the clipping or the update
            loss = optimizer_closure()
            self._window.normalise(self.trainable_parameters())
            return loss

        super().optimizer_step(epoch, batch_idx, optimizer, closure)
        self._step_ended = self._now()  # before the callbacks' batch-end work (a checkpoint's write)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        log = dict(on_step=True, on_epoch=False, batch_size=1)
        ended, self._step_ended = self._step_ended or self._now(), None
        if self._step_started is not None:  # the batch's real tokens on every process, as tokens_seen
            seconds = max(ended - self._step_started, 1e-9)
            self.log("train/tokens_per_s", float(self._tokens.last) / seconds, **log)
        self.log("train/tokens_seen", float(self.tokens_seen), **log)
        # stopped by a callback (a spent budget): Lightning validates next, inside its training loop, not training
        if self.trainer.should_stop:
            self._fit_ended = ended

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.trainable_parameters(), lr=hp.learning_rate, betas=tuple(hp.betas),
                                      weight_decay=hp.weight_decay)  # fmt: skip
        if self._trainer is not None:
            check_run_length(self._trainer)  # (refused before the weights are read by `swiftkv distill fit`)
        total = max(1, int(total_steps(self._trainer))) if self._trainer is not None else 1

        def elapsed() -> float | None:
            return self.train_seconds if hp.schedule_seconds and self._fit_started is not None else None

        scheduler = StepSchedule(
            optimizer, total, hp.warmup_fraction, hp.min_lr_ratio, hp.schedule_seconds, elapsed
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # --- validation --------------------------------------------------------------------------------------------
    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._set_metrics(dataloader_idx).update(self.step.evaluate(batch))

    def _set_metrics(self, index: int) -> ValidationMetrics:
        while len(self.val_metrics) <= index:
            self.val_metrics.append(ValidationMetrics().to(self.device))
        return self.val_metrics[index]

    def _metric_names(self, index: int, metrics: dict[str, float]) -> dict[str, float]:
        """The first validation set's names (``kl``...); another's prefixed by its ``val_set_names`` (``chat/kl``)."""
        if index == 0:
            return metrics
        names = getattr(getattr(self.trainer, "datamodule", None), "val_set_names", [])
        name = names[index] if index < len(names) else str(index)
        return {f"{name}/{k}": v for k, v in metrics.items()}

    def _compute_val_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for index, metrics in enumerate(self.val_metrics):
            if metrics.means["kl"].update_count:
                out.update(self._metric_names(index, metrics.compute(self.hparams.early_exit)))
        return out

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            for metrics in self.val_metrics:
                metrics.reset()
            return
        self.last_val_metrics = self._compute_val_metrics()
        self.last_val_step = self.global_step
        for name, value in self.last_val_metrics.items():
            self.log(f"val/{name}", value, prog_bar=name in ("kl", "agreement"), sync_dist=False)

    @torch.no_grad()
    def evaluate(self, dataloaders) -> dict[str, float]:
        """The validation metrics over ``dataloaders`` (one loader or a list: one per validation set), outside
        Lightning's loops (e.g. before training)."""
        was_training = self.training
        self.eval()
        loaders = dataloaders if isinstance(dataloaders, (list, tuple)) else [dataloaders]
        for index, loader in enumerate(loaders):
            for batch in loader:
                batch = self.transfer_batch_to_device(batch, self.device, index)
                self._set_metrics(index).update(self.step.evaluate(batch))
        self.train(was_training)
        return self._compute_val_metrics()

    def _val_loader(self):
        datamodule = getattr(self.trainer, "datamodule", None)
        return datamodule.val_dataloader() if datamodule is not None else self.trainer.val_dataloaders

    def on_fit_start(self) -> None:
        warn_if_bf16_emulated(self.device, str(self.trainer.precision))

    def on_train_start(self) -> None:
        """A fresh run: measure the converted model (``before/*``), fit the K/V init, measure again (``init/*``); a
        resumed run's checkpoint holds the trained weights and these metrics. Then ``compile_layers``, after the
        fit (its hooks observe eager layers)."""
        self._window = AccumulationWindow()  # a window a stopped fit left open counts for nothing
        if self.global_step == 0:
            self._measure_and_init_kv()
        self.phase = None  # training (a resumed run's peak memory from here too)
        compile_layers(self.swiftkv_model, self.hparams.compile_layers)

    def _measure_and_init_kv(self) -> None:
        hp = self.hparams
        # not when continuing from a SwiftKV checkpoint: its K/V projections are already initialised or trained
        fresh = self.model_config.model_type not in SWIFTKV_FAMILIES
        loader = self._val_loader() if hp.evaluate_before_training else None
        if loader is not None and not self.before_metrics:
            what = "converted, published init" if fresh else "the SwiftKV checkpoint, before training"
            self.phase = "evaluating the model before training"
            self.before_metrics = self._evaluate_and_log(loader, "before", what)
        if hp.kv_init == "least_squares" and fresh and not self.kv_init_report:
            started, self.phase = self._now(), "fitting the least-squares K/V init"
            report = self.kv_init_report = self.fit_kv_init()
            report["seconds"] = seconds = self._now() - started
            for logger in self.loggers:
                logger.log_metrics({f"kv_init/{k}": v for k, v in report.items()}, step=0)
            if self.trainer.is_global_zero:
                print(
                    f"least-squares K/V init: {int(report['tokens'])} tokens, {seconds:.0f} s, teacher K/V "
                    f"energy explained {report['explained_mean']:.3f} on average, {report['explained_min']:.3f} "
                    "at worst"
                )
            if loader is not None:
                self.phase = "evaluating the K/V init"
                self.init_metrics = self._evaluate_and_log(loader, "init", "after the least-squares K/V init")
        self.phase = None

    def _evaluate_and_log(self, loader, prefix: str, what: str) -> dict[str, float]:
        metrics = self.evaluate(loader)
        for logger in self.loggers:
            logger.log_metrics({f"{prefix}/{k}": v for k, v in metrics.items()}, step=0)
        if self.trainer.is_global_zero:
            print(f"{what}: " + ", ".join(f"{k}={v:.5g}" for k, v in metrics.items()))
        return metrics

    @torch.no_grad()
    def fit_kv_init(self) -> dict[str, float]:
        """Fit ``k/v_proj_swiftkv`` to the teacher's K/V by least squares (swiftkv_core.kv_init), in place.

        Every process reads its share of the same ``kv_init_tokens`` training tokens; the normal equations are summed
        over processes, so all of them (and a single-process run) get the same solution."""
        hp = self.hparams
        datamodule = getattr(self.trainer, "datamodule", None)
        if not hasattr(datamodule, "kv_init_dataloader"):
            raise ValueError(
                "kv_init='least_squares' reads its training tokens through DistillDataModule.kv_init_dataloader; "
                "with other data, set model.kv_init: published."
            )
        was_training = self.training
        self.eval()
        with KVLeastSquares(self.swiftkv_model, hp.kv_init_ridge, hp.kv_init_weighting) as fit:
            for batch in datamodule.kv_init_dataloader(hp.kv_init_tokens):
                batch = self.transfer_batch_to_device(batch, self.device, 0)
                fit.mask = batch["token_mask"]  # every real token's K/V (answer-only losses included)
                self.step.teacher_pass(batch)
                fit.collect()
            if (world := self._world_size()) > 1:
                fit.all_reduce(lambda value: sum_over_processes(value, world))
            report = fit.solve_and_apply()
        self.train(was_training)
        return report

    def on_train_end(self) -> None:
        """Make sure the final weights are measured: validate once more unless the last validation was at the end."""
        self._fit_ended = self._fit_ended or self._now()  # unless a callback's stop ended training already
        if self.last_val_step == self.global_step or self.trainer.limit_val_batches == 0:
            return
        if (loader := self._val_loader()) is None:
            return
        self.last_val_metrics = self.evaluate(loader)
        self.last_val_step = self.global_step
        metrics = {f"val/{k}": v for k, v in self.last_val_metrics.items()}
        for logger in self.loggers:
            logger.log_metrics(metrics, step=self.global_step)

    # --- checkpoints -------------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        for key in ("before_metrics", "init_metrics", "kv_init_report"):  # measured before the first step
            checkpoint[key] = getattr(self, key)
        # a resumed run goes on with the wall-time schedule (schedule_seconds) and the token count from here
        checkpoint["train_seconds"] = self.train_seconds
        checkpoint["tokens_seen"] = self.tokens_seen
        if self._model_identity is not None:  # on the rank that writes (configure_model)
            checkpoint["model_identity"] = self._model_identity

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        datamodule = getattr(self._trainer, "datamodule", None)
        check_same_run(checkpoint, self.hparams, datamodule)
        self.configure_model()  # load_from_checkpoint() does not call it; a no-op inside trainer.fit
        for key in ("before_metrics", "init_metrics", "kv_init_report"):
            setattr(self, key, checkpoint.get(key, {}))
        self._resumed_seconds = checkpoint.get("train_seconds", 0.0)
        self._tokens = TokenCount(checkpoint.get("tokens_seen", 0))
        self._fit_started = self._fit_ended = None  # set at the next step, from _resumed_seconds; at the stop
