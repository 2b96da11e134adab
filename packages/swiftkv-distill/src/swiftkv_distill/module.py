"""The SwiftKV distillation LightningModule, on the one model definition of swiftkv_core.

One copy of the base weights, frozen. A training step:

    h_l, ctx = prefix(tokens)                   # embeddings + layers < l, no grad, ONCE (same in both passes)
    teacher  = suffix(h_l, swiftkv=False)        # original layers >= l, no grad
    student  = suffix(h_l, swiftkv=True)         # SwiftKV layers >= l, the only pass with a graph
    loss = T^2 KL(teacher || student)            # chunked over positions (loss.py), real tokens only
         + hidden_loss_weight * MSE(hidden entering the last layer)
         + early_exit_weight * T^2 KL(teacher || early_exit_head(h_l))   (optional)

The published trainer runs the whole teacher and the whole student, so layers < l run twice; here they run once
and without autograd (nothing before layer l is trainable, so nothing there needs a graph).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torchmetrics import MeanMetric

from swiftkv_core.convert import FAMILIES, SWIFTKV_FAMILIES, convert
from swiftkv_core.early_exit import EarlyExitHead
from swiftkv_core.kv_init import KVLeastSquares

from .loss import distillation_kl, eval_stats

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_INITS = ("least_squares", "published")


def check_model_config(model: str, num_key_value_layers: int, key_value_group_size: int = 1):
    """The model's HF config, after checking family and ``l`` (cheap: reads config.json only)."""
    from transformers import AutoConfig

    import swiftkv_core  # noqa: F401  (registers the SwiftKV configs)
    from swiftkv_core.generation import resolve_model_path

    path = resolve_model_path(model)
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in FAMILIES and config.model_type not in SWIFTKV_FAMILIES:
        raise ValueError(
            f"Unknown model family model_type={config.model_type!r} in {path}: swiftkv-distill "
            f"supports {sorted(FAMILIES)} (and their SwiftKV checkpoints)."
        )
    layers = config.num_hidden_layers
    if not 1 <= num_key_value_layers < layers:
        raise ValueError(
            f"num_key_value_layers={num_key_value_layers} is out of range for {path}: it must be in "
            f"[1, {layers - 1}] (the model has {layers} layers; l={layers} would skip nothing)."
        )
    if key_value_group_size < 1 or (layers - num_key_value_layers) % key_value_group_size:
        raise ValueError(
            f"key_value_group_size={key_value_group_size} must divide the {layers - num_key_value_layers} "
            f"layers >= l={num_key_value_layers}."
        )
    if config.model_type in SWIFTKV_FAMILIES and (
        config.num_key_value_layers != num_key_value_layers
        or config.key_value_group_size != key_value_group_size
    ):
        raise ValueError(
            f"{path} is a SwiftKV checkpoint with num_key_value_layers={config.num_key_value_layers}, "
            f"key_value_group_size={config.key_value_group_size}; the run asks for "
            f"{num_key_value_layers}, {key_value_group_size}."
        )
    return path, config


def build_swiftkv_model(
    model: str, num_key_value_layers: int, key_value_group_size: int = 1, dtype: torch.dtype = torch.float32
):
    """A SwiftKV model ready to distil: converted from a base checkpoint, or a SwiftKV checkpoint loaded as is."""
    from transformers import AutoModelForCausalLM

    path, config = check_model_config(model, num_key_value_layers, key_value_group_size)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if config.model_type in SWIFTKV_FAMILIES:
        for name, param in loaded.named_parameters():
            param.requires_grad_("swiftkv" in name)
        return loaded.swiftkv(True)
    return convert(loaded, num_key_value_layers, key_value_group_size)


def warmup_cosine(progress: float, warmup_fraction: float, min_lr_ratio: float) -> float:
    """Learning-rate factor at ``progress`` (0..1) through the run: linear warm-up, then cosine to ``min_lr_ratio``."""
    progress = min(progress, 1.0)
    if progress < warmup_fraction:
        return progress / warmup_fraction
    decay = (progress - warmup_fraction) / max(1e-9, 1 - warmup_fraction)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * decay))


class DistillationStep(nn.Module):
    """Teacher + student forward and the loss, as ONE module call (the FSDP2 root: its call gathers the
    embeddings, norms and LM head; each decoder layer is its own FSDP2 unit)."""

    def __init__(self, model: nn.Module, early_exit_head: EarlyExitHead | None = None):
        super().__init__()
        self.model = model
        self.early_exit_head = early_exit_head

    def forward(
        self,
        batch: dict,
        row_scale: float | torch.Tensor,
        temperature: float,
        hidden_loss_weight: float,
        early_exit_weight: float,
        chunk_size: int,
        evaluate: bool = False,
        teacher_only: bool = False,
        positions: torch.Tensor | None = None,
        hard_label_weight: float = 0.0,
    ) -> dict:
        """``positions``: distil only these sequence positions (sorted indices; None: all). Every position still
        gets its K/V; the student's layers >= l and both LM heads run for these positions only."""
        inner, head_weight = self.model.model, self.model.lm_head.weight
        mask = batch["loss_mask"] if positions is None else batch["loss_mask"][:, positions]
        with torch.no_grad():
            hidden, context = inner.forward_prefix(
                input_ids=batch["input_ids"],
                position_ids=batch["position_ids"],
                attention_mask=None,
                use_cache=False,
                keep_positions=positions,
            )
            teacher, teacher_last_input = inner.forward_suffix(
                hidden, context, swiftkv=False, return_last_layer_input=True
            )
            if teacher_only:  # the K/V least-squares fit only needs the teacher's layers (kv_init.py)
                return {}
            teacher = inner.norm(teacher)[mask]
        with torch.set_grad_enabled(torch.is_grad_enabled() and not evaluate):
            student, student_last_input = inner.forward_suffix(
                hidden, context, swiftkv=True, return_last_layer_input=True
            )
            student = inner.norm(student)[mask]
            kept = hidden if positions is None else hidden[:, positions]
            early = self.early_exit_head.norm(kept[mask]) if self.early_exit_head is not None else None
        out: dict = {"tokens": mask.sum()}
        if evaluate:
            out["stats"] = eval_stats(student, teacher, head_weight, batch["labels"][mask], chunk_size)
            if early is not None:
                out["early_agree"] = _top1_agreement(
                    early, self.early_exit_head.lm_head.weight, teacher, head_weight, chunk_size
                )
            return out
        rows = torch.full((student.shape[0],), 1.0, device=student.device) * row_scale
        kl_sum, kl_rows, agree = distillation_kl(
            student, teacher, head_weight, rows, temperature, chunk_size, hard_weight=hard_label_weight
        )
        diff = (student_last_input - teacher_last_input)[mask].float()
        mse_rows = diff.pow(2).mean(-1)
        loss = kl_sum + hidden_loss_weight * (mse_rows * rows).sum() if hidden_loss_weight else kl_sum
        out.update(
            kl=kl_rows.detach().mean(), agreement=agree.float().mean(), hidden_mse=mse_rows.detach().mean()
        )
        if early is not None:
            early_sum, early_kl, early_agree = distillation_kl(
                early,
                teacher,
                self.early_exit_head.lm_head.weight,
                rows,
                temperature,
                chunk_size,
                teacher_weight=head_weight,
            )
            loss = loss + early_exit_weight * early_sum
            out.update(early_kl=early_kl.mean(), early_agreement=early_agree.float().mean())
        out["loss"] = loss
        return out


@torch.no_grad()
def _top1_agreement(hidden_a, weight_a, hidden_b, weight_b, chunk_size: int) -> torch.Tensor:
    agree = torch.empty(hidden_a.shape[0], dtype=torch.bool, device=hidden_a.device)
    for start in range(0, hidden_a.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        agree[rows] = (hidden_a[rows] @ weight_a.T).argmax(-1) == (hidden_b[rows] @ weight_b.T).argmax(-1)
    return agree


class SwiftKVDistillation(L.LightningModule):
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
        evaluate_before_training: run the validation metrics once before the first step (the undistilled model)
            and log them as ``before/*``.
        reshard_after_forward: FSDP2 (ModelParallelStrategy only): free gathered layer weights after each forward.
        schedule_seconds: run the warm-up + cosine schedule over this much wall time (from the first step) instead
            of over ``max_steps``, for a run with a time budget (pair with ``trainer.max_time``). The schedule then
            depends on the machine's speed, so a resumed run is no longer bit-identical to an uninterrupted one.
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
            token (loss.py). 0 (default): pure KL; measured on SmolLM2 it lowered agreement (0.05, 0.5 and 2:
            benchmarks/results/distill-variants-gpu*.md).
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
        evaluate_before_training: bool = True,
        reshard_after_forward: bool = True,
        schedule_seconds: float | None = None,
        kv_init: str = "least_squares",
        kv_init_tokens: int = 32768,
        kv_init_ridge: float = 1e-4,
        kv_init_weighting: str = "attention",
        position_fraction: float = 1.0,
        hard_label_weight: float = 0.0,
    ):
        super().__init__()
        if kv_init not in _KV_INITS:
            raise ValueError(f"kv_init must be one of {_KV_INITS}, got {kv_init!r}.")
        if kv_init_tokens < 1 or kv_init_ridge < 0:
            raise ValueError(
                f"kv_init_tokens must be >= 1 and kv_init_ridge >= 0, got {kv_init_tokens} and {kv_init_ridge}."
            )
        if not 0 < position_fraction <= 1:
            raise ValueError(f"position_fraction must be in (0, 1], got {position_fraction}.")
        if model_dtype not in _DTYPES:
            raise ValueError(f"model_dtype must be one of {sorted(_DTYPES)}, got {model_dtype!r}.")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}.")
        if hard_label_weight < 0:
            raise ValueError(f"hard_label_weight must be >= 0, got {hard_label_weight}.")
        self.save_hyperparameters()
        # Fails here, before any weight is loaded, for an unknown family or an l out of range.
        self.model_path, self.model_config = check_model_config(
            model, num_key_value_layers, key_value_group_size
        )
        self.step: DistillationStep | None = None
        self.strict_loading = (
            False  # Lightning checkpoints hold the trainable weights only (see on_save_checkpoint)
        )
        self.val_metrics = nn.ModuleDict(
            {
                name: MeanMetric()
                for name in ("kl", "agreement", "student_nll", "teacher_nll", "early_exit_agreement")
            }
        )
        self.before_metrics: dict[str, float] = {}  # the converted model (published init), before training
        self.init_metrics: dict[str, float] = {}  # after the least-squares K/V init, before training
        self.kv_init_report: dict[str, float] = {}
        self.last_val_metrics: dict[str, float] = {}
        self.last_val_step = -1
        self._tokens_seen = 0
        self._step_started: float | None = None
        self._fit_started: float | None = None

    # --- model -------------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.step is not None:
            return
        hp = self.hparams
        model = build_swiftkv_model(
            hp.model, hp.num_key_value_layers, hp.key_value_group_size, _DTYPES[hp.model_dtype]
        )
        model.train()  # dropout is 0 in these families; train() only matters for the module flags
        head = EarlyExitHead.from_model(model) if hp.early_exit else None
        self.step = DistillationStep(model, head)
        mesh = self.device_mesh
        if (
            mesh is not None
        ):  # ModelParallelStrategy: shard with FSDP2, one unit per decoder layer plus the root
            from torch.distributed.fsdp import fully_shard

            data_parallel = mesh["data_parallel"]
            kwargs = dict(mesh=data_parallel, reshard_after_forward=hp.reshard_after_forward)
            for layer in model.model.layers:
                # The shared K/V projections run outside their layer's forward (all at once, from the input of
                # layer l): they need their own FSDP2 units, or their weights would still be sharded when called.
                for name in ("k_proj_swiftkv", "v_proj_swiftkv"):
                    if hasattr(layer.self_attn, name):
                        fully_shard(getattr(layer.self_attn, name), **kwargs)
                fully_shard(layer, **kwargs)
            fully_shard(self.step, **kwargs)

    @property
    def swiftkv_model(self):
        return self.step.model

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    # --- training ----------------------------------------------------------------------------------------------
    def _global_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.trainer is not None and self.trainer.world_size > 1:
            tokens = self.trainer.strategy.reduce(tokens.float(), reduce_op="sum")
        return tokens

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        hp = self.hparams
        world = self.trainer.world_size if self._trainer is not None else 1
        # Normalise by the GLOBAL number of real tokens: data-parallel gradient averaging then gives exactly the
        # single-process gradient of the same global batch.
        positions = self.step_positions(batch["input_ids"].shape[1], batch["input_ids"].device)
        distilled = batch["loss_mask"] if positions is None else batch["loss_mask"][:, positions]
        row_scale = world / self._global_tokens(distilled.sum()).clamp(min=1)
        out = self.step(
            batch,
            row_scale,
            hp.temperature,
            hp.hidden_loss_weight,
            hp.early_exit_weight,
            hp.logits_chunk_size,
            positions=positions,
            hard_label_weight=hp.hard_label_weight,
        )
        batch_size = batch["input_ids"].shape[0]
        log = dict(on_step=True, on_epoch=False, batch_size=batch_size)
        self.log(
            "train/loss", out["loss"].detach() / world, prog_bar=True, sync_dist=True, reduce_fx="sum", **log
        )
        self.log("train/kl", out["kl"], sync_dist=True, **log)
        self.log("train/agreement", out["agreement"], prog_bar=True, sync_dist=True, **log)
        self.log("train/hidden_mse", out["hidden_mse"], sync_dist=True, **log)
        if "early_kl" in out:
            self.log("train/early_exit_kl", out["early_kl"], sync_dist=True, **log)
        self._tokens_seen += int(batch["loss_mask"].sum()) * world
        return out["loss"]

    def step_positions(self, length: int, device, step: int | None = None) -> torch.Tensor | None:
        """The positions distilled at ``step`` (default: the current one): all (None), or a random
        ``position_fraction`` of them drawn from the step number (the same on every process and after a resume)."""
        fraction = self.hparams.position_fraction
        if fraction >= 1:
            return None
        generator = torch.Generator().manual_seed(self.global_step if step is None else step)
        count = max(1, round(length * fraction))
        return torch.randperm(length, generator=generator)[:count].sort().values.to(device)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._step_started = time.perf_counter()
        if self._fit_started is None:
            self._fit_started = self._step_started

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self._step_started is not None:
            seconds = time.perf_counter() - self._step_started
            tokens = batch["input_ids"].numel() * self.trainer.world_size
            self.log(
                "train/tokens_per_s", tokens / max(seconds, 1e-9), on_step=True, on_epoch=False, batch_size=1
            )
        self.log("train/tokens_seen", float(self._tokens_seen), on_step=True, on_epoch=False, batch_size=1)

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            self.trainable_parameters(),
            lr=hp.learning_rate,
            betas=tuple(hp.betas),
            weight_decay=hp.weight_decay,
        )
        total = max(1, int(self.trainer.estimated_stepping_batches)) if self._trainer is not None else 1
        budget = hp.schedule_seconds

        def factor(step: int) -> float:
            # progress through the run: by steps, or (schedule_seconds) by wall time, whichever is further
            progress = step / total
            if budget and self._fit_started is not None:
                progress = max(progress, (time.perf_counter() - self._fit_started) / budget)
            value = warmup_cosine(progress, hp.warmup_fraction, hp.min_lr_ratio)
            # never a zero learning rate at the first warm-up step
            return max(value, 1.0 / (total + 1), 0.01) if progress < hp.warmup_fraction else value

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # --- validation --------------------------------------------------------------------------------------------
    def _update_metrics(self, batch: dict) -> None:
        hp = self.hparams
        out = self.step(
            batch,
            1.0,
            hp.temperature,
            hp.hidden_loss_weight,
            hp.early_exit_weight,
            hp.logits_chunk_size,
            evaluate=True,
        )
        stats, m = out["stats"], self.val_metrics
        m["kl"].update(stats.kl)
        m["agreement"].update(stats.agree.float())
        valid = ~torch.isnan(stats.student_nll)
        if valid.any():
            m["student_nll"].update(stats.student_nll[valid])
            m["teacher_nll"].update(stats.teacher_nll[valid])
        if "early_agree" in out:
            m["early_exit_agreement"].update(out["early_agree"].float())

    def _compute_metrics(self) -> dict[str, float]:
        m = self.val_metrics
        values = {"kl": m["kl"].compute(), "agreement": m["agreement"].compute()}
        if m["student_nll"].update_count:
            values["student_ppl"] = m["student_nll"].compute().exp()
            values["teacher_ppl"] = m["teacher_nll"].compute().exp()
        if m["early_exit_agreement"].update_count or self.hparams.early_exit:
            values["early_exit_agreement"] = m["early_exit_agreement"].compute()
        for metric in m.values():
            metric.reset()
        return {k: float(v) for k, v in values.items()}

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._update_metrics(batch)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            for metric in self.val_metrics.values():
                metric.reset()
            return
        self.last_val_metrics = self._compute_metrics()
        self.last_val_step = self.global_step
        for name, value in self.last_val_metrics.items():
            self.log(f"val/{name}", value, prog_bar=name in ("kl", "agreement"), sync_dist=False)

    @torch.no_grad()
    def evaluate(self, dataloader) -> dict[str, float]:
        """The validation metrics over ``dataloader``, outside Lightning's loops (e.g. before training)."""
        was_training = self.training
        self.eval()
        for batch in dataloader:
            self._update_metrics(self.transfer_batch_to_device(batch, self.device, 0))
        self.train(was_training)
        return self._compute_metrics()

    def _val_loader(self):
        datamodule = getattr(self.trainer, "datamodule", None)
        return datamodule.val_dataloader() if datamodule is not None else self.trainer.val_dataloaders

    def on_train_start(self) -> None:
        """A fresh run: measure the converted model (``before/*``), fit the K/V init, measure again (``init/*``).

        A resumed run skips all of it: its checkpoint holds the trained weights and these metrics."""
        if self.global_step > 0:
            return
        hp = self.hparams
        loader = self._val_loader() if hp.evaluate_before_training else None
        if loader is not None and not self.before_metrics:
            self.before_metrics = self._evaluate_and_log(loader, "before", "converted, published init")
        # not when continuing from a SwiftKV checkpoint: its K/V projections are already trained
        fresh = self.model_config.model_type not in SWIFTKV_FAMILIES
        if hp.kv_init == "least_squares" and fresh and not self.kv_init_report:
            started = time.perf_counter()
            report = self.kv_init_report = self.fit_kv_init()
            report["seconds"] = seconds = time.perf_counter() - started
            for logger in self.loggers:
                logger.log_metrics({f"kv_init/{k}": v for k, v in report.items()}, step=0)
            if self.trainer.is_global_zero:
                print(
                    f"least-squares K/V init: {int(report['tokens'])} tokens, {seconds:.0f} s, teacher K/V "
                    f"energy explained {report['explained_mean']:.3f} on average, {report['explained_min']:.3f} "
                    "at worst"
                )
            if loader is not None:
                self.init_metrics = self._evaluate_and_log(loader, "init", "after the least-squares K/V init")

    def _evaluate_and_log(self, loader, prefix: str, what: str) -> dict[str, float]:
        metrics = self.evaluate(loader)
        for logger in self.loggers:
            logger.log_metrics({f"{prefix}/{k}": v for k, v in metrics.items()}, step=0)
        if self.trainer.is_global_zero:
            print(f"{what}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
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
                fit.mask = batch["loss_mask"]
                self.step(batch, 1.0, hp.temperature, 0.0, 0.0, hp.logits_chunk_size, teacher_only=True)
                fit.collect()
            if self.trainer.world_size > 1:
                fit.all_reduce(lambda t: self.trainer.strategy.reduce(t, reduce_op="sum"))
            report = fit.solve_and_apply()
        self.train(was_training)
        return report

    def on_train_end(self) -> None:
        """Make sure the final weights are measured: validate once more unless the last validation was at the end."""
        if self.last_val_step == self.global_step or self.trainer.limit_val_batches == 0:
            return
        loader = self._val_loader()
        if loader is None:
            return
        self.last_val_metrics = self.evaluate(loader)
        self.last_val_step = self.global_step
        for logger in self.loggers:
            logger.log_metrics(
                {f"val/{k}": v for k, v in self.last_val_metrics.items()}, step=self.global_step
            )

    # --- checkpoints -------------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # The frozen base weights are the pretrained checkpoint (hparams.model): keep only what training changed.
        # Under FSDP2 (a distributed checkpoint: each rank writes its own shards) the loader wants every key, so
        # the sharded state is kept whole there.
        if self.device_mesh is None:
            checkpoint["state_dict"] = {
                k: v for k, v in checkpoint["state_dict"].items() if _is_trained_name(k)
            }
        checkpoint["before_metrics"] = self.before_metrics
        checkpoint["init_metrics"] = self.init_metrics
        checkpoint["kv_init_report"] = self.kv_init_report

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.configure_model()  # load_from_checkpoint() does not call it; a no-op inside trainer.fit
        self.before_metrics = checkpoint.get("before_metrics", {})
        self.init_metrics = checkpoint.get("init_metrics", {})
        self.kv_init_report = checkpoint.get("kv_init_report", {})


def _is_trained_name(name: str) -> bool:
    parts = name.split(".")
    return (len(parts) >= 2 and "swiftkv" in parts[-2]) or ".early_exit_head." in name


def trained_state_dict(module: SwiftKVDistillation) -> dict[str, torch.Tensor]:
    """Full (unsharded) trained weights, keyed as in the HF model / ``early_exit_head.*``; collective under FSDP."""
    step = module.step
    if module.device_mesh is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(step, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = step.state_dict()
    return {k: v.detach().cpu() for k, v in state.items() if _is_trained_name("step." + k)}


def export(
    module: SwiftKVDistillation, out_dir: str | Path, serving: bool = False, tokenizer=None
) -> Path | None:
    """Write the distilled model as a HF SwiftKV checkpoint (full, or the smaller serving export) atomically.

    The early-exit head, when trained, is written beside it (``early_exit_head.safetensors``). Under FSDP every
    rank must call this (the weights are gathered); rank 0 writes. Returns the folder (``None`` on other ranks).
    """
    from .export import write_checkpoint

    state = trained_state_dict(module)
    if module.trainer is not None and module._trainer is not None and not module.trainer.is_global_zero:
        return None
    hp = module.hparams
    if (
        module.device_mesh is not None
    ):  # the in-memory model is sharded: rebuild a plain one, load what trained
        model = build_swiftkv_model(
            hp.model, hp.num_key_value_layers, hp.key_value_group_size, _DTYPES[hp.model_dtype]
        )
        head = EarlyExitHead.from_model(model) if hp.early_exit else None
        DistillationStep(model, head).load_state_dict(state, strict=False)
    else:
        model, head = module.step.model, module.step.early_exit_head
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(module.model_path)
    return write_checkpoint(model, out_dir, tokenizer=tokenizer, serving=serving, early_exit_head=head)
