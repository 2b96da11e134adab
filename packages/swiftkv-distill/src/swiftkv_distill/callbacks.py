"""Callbacks: a JSON summary and a PNG of the metrics at the end of fit, the HF export, and a live progress bar for a
run budgeted in training time; a CSV logger whose metrics go on across a resume."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import lightning as L
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from swiftkv_core.atomic import atomic_file, atomic_write_text
from swiftkv_core.runtime import Stopwatch


def _log_dir(trainer: L.Trainer) -> Path:
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger):
            return Path(logger.log_dir)
    return Path(trainer.default_root_dir)


class ResumableCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger`` (same arguments) for a run that resumes into the same version folder (a fixed
    ``version``, as ``budgeted_fit`` gives): Lightning's deletes the folder's ``metrics.csv`` (with a warning), so
    the curves and ``metrics.png`` of a resumed run started at the resume. Here the earlier rows stay, but those
    from the step the resumed run logs first on, which it logs again."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuedWriter(log_dir=self.log_dir)
        return self._experiment


class _ContinuedWriter(ExperimentWriter):
    _trimmed = False

    def _check_log_dir_exists(self) -> None:
        """Lightning's deletes ``metrics.csv``: kept here, trimmed at the first row logged."""

    def log_metrics(self, metrics_dict: dict, step: int | None = None) -> None:
        if not self._trimmed and step is not None:
            self._trimmed = True
            self._keep_rows_before(step)
        super().log_metrics(metrics_dict, step)

    def _keep_rows_before(self, step: int) -> None:
        path = Path(self.metrics_file_path)
        if not path.is_file():
            return
        with path.open(newline="") as file:
            reader = csv.DictReader(file)
            rows = [row for row in reader if row.get("step") and int(float(row["step"])) < step]
            self.metrics_keys = list(reader.fieldnames or [])  # sorted, as Lightning writes them
        with atomic_file(path) as file:  # a kill here leaves the earlier rows whole
            writer = csv.DictWriter(file, fieldnames=self.metrics_keys)
            writer.writeheader()
            writer.writerows(rows)


class RunReport(L.Callback):
    """At the end of fit (rank 0): ``summary.json`` (before/after metrics, tokens, time) and ``metrics.png``
    (training loss and agreement, validation KL and agreement, the undistilled values as dashed lines), in the
    CSV logger's folder."""

    def __init__(self, plot: bool = True):
        self.plot = plot
        self._watch: Stopwatch | None = None

    def on_fit_start(self, trainer, pl_module) -> None:
        self._watch = Stopwatch(pl_module.device).start()  # the device's queued work waited for at each end

    def on_fit_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.save()
        folder = _log_dir(trainer)
        folder.mkdir(parents=True, exist_ok=True)
        after = dict(getattr(pl_module, "last_val_metrics", {})) or {
            k.removeprefix("val/"): float(v)
            for k, v in trainer.callback_metrics.items()
            if k.startswith("val/")
        }
        seconds = self._watch.stop() if self._watch else None
        # both over the whole run, across resumes: time since the first step, tokens since then
        train_seconds = getattr(pl_module, "train_seconds", None)
        tokens = getattr(pl_module, "tokens_seen", None)
        summary = {
            "before": getattr(pl_module, "before_metrics", {}),
            "init": getattr(pl_module, "init_metrics", {}),
            "kv_init": getattr(pl_module, "kv_init_report", {}),
            "after": after,
            "global_step": trainer.global_step,
            "train_tokens": tokens,
            "fit_seconds": seconds,
            "train_seconds": train_seconds,
            "train_tokens_per_s": tokens / train_seconds if tokens and train_seconds else None,
            "hparams": {
                k: v for k, v in dict(pl_module.hparams).items() if isinstance(v, (int, float, str, bool))
            },
        }
        # atomically: the main job reads it back
        atomic_write_text(folder / "summary.json", json.dumps(summary, indent=2))
        if self.plot and (folder / "metrics.csv").is_file():
            plot_metrics(folder / "metrics.csv", folder / "metrics.png", summary["before"], summary["init"])


def plot_metrics(
    csv_path: Path, png_path: Path, before: dict | None = None, init: dict | None = None
) -> Path:
    """Plot the CSV logger's metrics: train loss/agreement per step, val KL/agreement per validation; the
    undistilled model (``before``) and the least-squares K/V init (``init``) as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[float, float]]] = {}
    with open(csv_path) as f:
        for row in csv.DictReader(f):
            step = float(row.get("step") or 0)
            for key, value in row.items():
                if key != "step" and value not in (None, ""):
                    series.setdefault(key, []).append((step, float(value)))
    panels = [
        ("train/loss", "val/kl", "KL to teacher (nats)", "before/kl"),
        ("train/agreement", "val/agreement", "top-1 agreement", "before/agreement"),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (train_key, val_key, title, before_key) in zip(axes, panels, strict=True):
        name = before_key.split("/")[1]
        # every validation set: val/kl (the first set) and val/<set>/kl (the others, e.g. chat)
        val_keys = [val_key] + sorted(
            k for k in series if k.startswith("val/") and k.endswith(f"/{name}") and k != val_key
        )
        for key, style in [(train_key, "-")] + [(k, "o-") for k in val_keys]:
            if key in series:
                xs, ys = zip(*series[key], strict=True)
                if style == "-" and len(ys) > 20:  # smooth the noisy per-step curve
                    k = max(1, len(ys) // 20)
                    ys = [
                        sum(ys[max(0, i - k) : i + 1]) / len(ys[max(0, i - k) : i + 1])
                        for i in range(len(ys))
                    ]
                ax.plot(xs, ys, style, label=key)
        for values, color, label in (
            (before, "gray", "undistilled"),
            (init, "tab:green", "least-squares init"),
        ):
            for key in [k.removeprefix("val/") for k in val_keys]:
                if values and key in values and not math.isnan(values[key]):
                    set_name = f" {key.rsplit('/', 1)[0]}" if "/" in key else ""
                    ax.axhline(
                        values[key],
                        ls=":" if set_name else "--",
                        color=color,
                        label=f"{label}{set_name} ({values[key]:.3f})",
                    )
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


class ExportHF(L.Callback):
    """At the end of fit, export the distilled model as HF SwiftKV checkpoints (written atomically).

    Args:
        dirpath: output folder; ``full`` goes to ``dirpath/hf`` and ``serving`` to ``dirpath/hf-serving``.
        full: the full checkpoint (teacher weights kept: can still run ``swiftkv(False)``).
        serving: the smaller serving export (no teacher q/k/v for layers >= l).
    """

    def __init__(self, dirpath: str = "outputs/distill/export", full: bool = True, serving: bool = True):
        self.dirpath, self.full, self.serving = Path(dirpath), full, serving

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Refuse export folders the export would lose (each is replaced whole), before any weight is read."""
        from swiftkv_core.checkpoints import check_replaceable

        if stage != "fit":
            return
        for name, wanted in (("hf", self.full), ("hf-serving", self.serving)):
            if wanted:
                check_replaceable(self.dirpath / name, pl_module.model_path, f"ExportHF's {name}/ folder")

    def on_fit_end(self, trainer, pl_module) -> None:
        from .export import export_checkpoints

        folders = {self.dirpath / "hf": False} if self.full else {}
        if self.serving:
            folders[self.dirpath / "hf-serving"] = True
        for path in export_checkpoints(pl_module, folders):
            if path is not None:
                print(f"exported {path}")


class BudgetProgress(L.Callback):
    """One line, updated every step: time spent / budget, step, tokens/s, loss, ETA. Stops the fit at the budget.

    The clock is the module's ``train_seconds`` (from the first step, summed over resumed runs), the same clock as
    the learning-rate schedule under ``schedule_seconds``: a resumed run continues the bar and the schedule alike.
    """

    def __init__(self, budget_seconds: float):
        self.budget = float(budget_seconds)
        self._bar = None

    def on_train_start(self, trainer, pl_module) -> None:
        # after the module's own on_train_start (evaluation before training, K/V fit): Lightning calls callbacks first,
        # so the bar is opened lazily at the first step instead
        self._bar = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not trainer.is_global_zero:
            return self._stop_if_spent(trainer, pl_module, batch_idx)
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=round(self.budget), unit="s", desc="   distill", dynamic_ncols=True,
                bar_format="{desc} {percentage:3.0f}%|{bar}| {n:.0f}/{total} s{postfix}",
            )  # fmt: skip
        spent = min(pl_module.train_seconds, self.budget)
        metrics = trainer.callback_metrics
        postfix = {"step": trainer.global_step}
        if "train/tokens_per_s" in metrics:
            postfix["tok/s"] = f"{float(metrics['train/tokens_per_s']):.0f}"
        if "train/loss" in metrics:
            postfix["loss"] = f"{float(metrics['train/loss']):.4f}"
        postfix["ETA"] = f"{(self.budget - spent) / 60:.1f} min"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(round(spent) - self._bar.n)
        self._stop_if_spent(trainer, pl_module, batch_idx)

    def _stop_if_spent(self, trainer, pl_module, batch_idx: int) -> None:
        # Only where an optimizer step just ended: a stop inside a gradient-accumulation window would drop its
        # batches' gradients (or end a run before its first step). Rank 0's clock decides for every process (each
        # reads its own): processes that stopped at different steps would wait for each other in the next collective.
        done = batch_idx + 1
        if done % trainer.accumulate_grad_batches and done != trainer.num_training_batches:
            return
        if trainer.strategy.broadcast(pl_module.train_seconds >= self.budget):
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
