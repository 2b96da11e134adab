"""Recipes: the distillation YAMLs (``recipes/*.yaml``, shipped with the package) and the one way a recipe becomes a
module, a data module and a Trainer. ``swiftkv distill fit``, the main job and every benchmark go through ``build``
(LightningCLI's own parser: one schema, the same defaults, interpolations and checks everywhere).

A recipe is named by a path, or by its name (``smollm2-135m-cpu``) from any folder. Overrides are dotted keys,
``{"model.num_key_value_layers": 15, "trainer.max_steps": 20}``, as on the command line.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import LightningCLI

from swiftkv_core.runtime import current_device

from .build import check_same_run, sized_step
from .checkpointing import last_checkpoint, saved_run
from .console import quiet_lightning, told_out_of_memory
from .datamodule import DistillDataModule
from .launch import check_launch, check_world_size, meet_at_start, wait_as
from .module import SwiftKVDistillation
from .schedule import check_run_length

RECIPES_DIR = Path(__file__).parent / "recipes"


class RecipeError(ValueError):
    """A recipe that cannot be found or parsed; the message says which and how to fix it."""


TRAINER_DEFAULTS = {
    # The data module builds its own DistributedSampler (a seeded permutation per epoch, also for one process).
    # Loggers (CSV + TensorBoard) and callbacks (RunReport, ExportHF, ModelCheckpoint) are set by each recipe.
    "use_distributed_sampler": False,
}


class DistillCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # One model path for the module (weights) and the data (tokenizer, context length).
        parser.link_arguments("model.model", "data.model")

    def instantiate_classes(self) -> None:
        trainer = self.config.get(self.subcommand, self.config).trainer
        check_launch(trainer, os.environ)
        check_world_size(trainer, os.environ)
        super().instantiate_classes()
        wait_as(self.trainer)

    def before_validate(self) -> None:
        """A checkpoint to evaluate that is not there refused, then every process is up, or none goes on (``fit``
        meets after its own checks): Lightning reads the checkpoint once the process group exists."""
        check_checkpoint(
            self.config_init[self.subcommand].get("ckpt_path"), "Give a Lightning checkpoint to evaluate."
        )
        meet_at_start()

    before_test = before_predict = before_validate

    def fit(self, model, datamodule=None, ckpt_path=None, **kwargs) -> None:
        """``Trainer.fit``, continuing from the last checkpoint in the run's checkpoint folder when no
        ``--ckpt_path`` is given (or ``last``): running the same command again resumes an interrupted run. On one
        process, before the Trainer writes anything (its config, logs): a run its device cannot compute or hold is
        refused (``sized_step``, knowing whether it resumes: a resume fits no K/V), then the data is read, checked,
        tokenised and packed, so bad data is refused with nothing left in the output folder. (Several processes
        leave the data to Lightning, which prepares it on one process first.)"""
        datamodule = datamodule or self.datamodule
        if ckpt_path in (None, "last"):  # found here, for the checks below
            ckpt_path = last_checkpoint(self.trainer)
        model.resume_from = ckpt_path  # a resume fits no K/V init
        check_run_length(self.trainer)
        if self.trainer.world_size == 1:
            sized_step(model, self.trainer)
            # the run's GPU (--trainer.devices [1]) generates any teacher answers the data needs, not GPU 0
            with current_device(self.trainer.strategy.root_device):
                datamodule.prepare_data()
                datamodule.setup("fit")
            datamodule.check_batches(1)
        if ckpt_path and self.trainer.is_global_zero:
            print(
                f"resuming from {ckpt_path} (another --trainer.default_root_dir starts a new run)", flush=True
            )
        check_resume(ckpt_path, self.trainer, model, datamodule)
        meet_at_start()  # every process's checks passed, or none goes on
        with told_out_of_memory(self.trainer, model, datamodule):
            self.trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, **kwargs)


# the checkpoints Lightning's ``ckpt_path`` names rather than gives a path to
LIGHTNING_CHECKPOINT_NAMES = ("last", "best", "hpc", "registry")


def check_resume(ckpt_path, trainer, module, datamodule) -> None:
    """Before the model is built or any weight read: refuse a checkpoint to resume from that is not there, or that
    a run with other settings wrote (``build.check_same_run``, checked again as Lightning restores it: a data module
    on several processes is set up only then, and the data files' row count with it)."""
    fix = (
        "Give the last.ckpt (file or folder) of an earlier run, or leave --ckpt_path out: a run resumes from its own "
        "folder's last checkpoint by itself."
    )
    if check_checkpoint(ckpt_path, fix):
        check_same_run(saved_run(ckpt_path), module.hparams, datamodule, trainer)


def check_checkpoint(ckpt_path, fix: str) -> bool:
    """Whether ``ckpt_path`` names a checkpoint file or folder, which must then be there (``FileNotFoundError``
    with ``fix``); False for none, or for one Lightning finds by name (``last``, ``best``, a registry's)."""
    if (
        not ckpt_path
        or str(ckpt_path) in LIGHTNING_CHECKPOINT_NAMES
        or str(ckpt_path).startswith("registry:")
    ):
        return False
    if not Path(ckpt_path).exists():
        raise FileNotFoundError(f"--ckpt_path {ckpt_path}: no checkpoint there. {fix}")
    return True


def with_recipe_paths(args: list[str]) -> list[str]:
    """``args`` with each ``--config NAME`` (or ``-c NAME``) of a shipped recipe replaced by its file (paths that
    exist stay)."""
    out = list(args)
    for i, arg in enumerate(out):
        apart = arg in ("--config", "-c")
        name, value = (arg, out[i + 1] if i + 1 < len(out) else None) if apart else arg.partition("=")[::2]
        if name not in ("--config", "-c") or not value:
            continue
        try:
            resolved = str(recipe_path(value))
        except RecipeError:
            continue  # LightningCLI says that the file does not exist
        if apart:
            out[i + 1] = resolved
        else:
            out[i] = f"--config={resolved}"
    return out


def make_cli(args=None, run: bool = True, cli_class: type[LightningCLI] = DistillCLI) -> LightningCLI:
    """The distillation's LightningCLI over ``args`` (default: the command line), shipped recipes found by name."""
    # the recipes' interpolations name keys from the config's own root (``trainer.``), also under a subcommand
    set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
    args = with_recipe_paths(sys.argv[1:] if args is None else list(args))
    for config in _config_files(args):
        _check_yaml(config)
    quiet_lightning()
    with warnings.catch_warnings():
        # Lightning warns when ``args`` are given while the process has command-line arguments of its own: here
        # they are given on purpose (a recipe name resolved, or a caller such as the main job building a run).
        warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
        return cli_class(
            SwiftKVDistillation,
            DistillDataModule,
            trainer_defaults=TRAINER_DEFAULTS,
            args=args,
            run=run,
            save_config_kwargs={"overwrite": True},
            # ``${trainer.default_root_dir}/...`` in the recipes: one output folder per file, resolved after the
            # command line (an overridden default_root_dir moves everything under it)
            # a bad option raises (argparse.ArgumentError, one message) instead of printing the whole usage
            parser_kwargs={"parser_mode": "omegaconf+", "exit_on_error": False},
            seed_everything_default=0,
        )


def _config_files(args: list[str]) -> list[str]:
    files = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg in ("--config", "-c")]
    return files + [arg.split("=", 1)[1] for arg in args if arg.startswith("--config=")]


def _check_yaml(path: str) -> None:
    """Raise ``RecipeError`` naming the file and the place when a recipe is not valid YAML (jsonargparse's own
    message names neither)."""
    import yaml

    if not Path(path).is_file():
        return  # LightningCLI says that the file does not exist
    try:
        yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(error, "problem", None) or "not valid YAML"
        raise RecipeError(f"recipe {path}: {problem}{where}: fix the YAML.") from None


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def recipe_path(recipe: str | os.PathLike) -> Path:
    """The YAML of ``recipe``: an existing file, else a shipped recipe by name (``smollm2-135m-cpu``, with or
    without ``.yaml``; a path like ``configs/distill/NAME.yaml`` resolves the same from any folder)."""
    path = Path(recipe).expanduser()
    if path.is_file():
        return path.resolve()
    shipped = RECIPES_DIR / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    if shipped.is_file():
        return shipped
    raise RecipeError(
        f"recipe {recipe}: no such file, and not a shipped recipe ({', '.join(recipe_names())}). Give a recipe's "
        "name or the path of a YAML."
    )


def arguments(overrides: dict | None) -> list[str]:
    """``{"model.l": 15, "trainer.callbacks": [...]}`` -> ``["--model.l=15", '--trainer.callbacks=[...]']``."""
    out = []
    for key, value in (overrides or {}).items():
        text = value if isinstance(value, str) else json.dumps(value)
        out.append(f"--{key}={text}")
    return out


def _cli(recipe, overrides: dict | None, instantiate: bool):
    class ParseOnly(DistillCLI):
        def instantiate_classes(self) -> None:
            pass

    args = ["--config", str(recipe_path(recipe)), *arguments(overrides)]
    try:
        return make_cli(args, run=False, cli_class=DistillCLI if instantiate else ParseOnly)
    except SystemExit as error:  # jsonargparse exits on a bad value, after printing why
        raise RecipeError(
            f"recipe {recipe} with {overrides or {}}: not valid (see the message above)."
        ) from error


SHORT_KEYS = {  # short names of the recipe keys that benchmarks vary most
    "lr": "model.learning_rate",
    "temperature": "model.temperature",
    "batch_size": "data.batch_size",
    "position_fraction": "model.position_fraction",
    "hard_weight": "model.hard_label_weight",
    "min_lr_ratio": "model.min_lr_ratio",
    "lora_rank": "model.lora_rank",
    "lora_prefix": "model.lora_prefix",
}


def parse_overrides(text: str, extra: tuple[str, ...] = ()) -> dict:
    """``"lr=1e-3,lora_rank=16"`` -> ``{"model.learning_rate": 0.001, "model.lora_rank": 16}``: recipe overrides from
    comma-separated ``key=value`` pairs (a recipe key ``model.X`` / ``data.X`` or a name of ``SHORT_KEYS``; values
    are JSON lists/objects, true/false, integers, floats or strings). Keys in ``extra`` are kept as they are (a
    caller's own settings); any other unknown key raises ``ValueError``."""
    overrides = {}
    for item in filter(None, text.replace(" ", "").split(",")):
        key, _, value = item.partition("=")
        if key not in SHORT_KEYS and "." not in key and key not in extra:
            raise ValueError(
                f"unknown key {key!r}; use a recipe key (model.X, data.X) or one of {sorted(SHORT_KEYS)}."
            )
        overrides[SHORT_KEYS.get(key, key)] = _value(value)
    return overrides


def _value(text: str):
    if text[:1] in "[{" or text in ("true", "false"):
        return json.loads(text)
    try:
        return int(text)  # an integer setting (lora_rank, batch_size) stays one
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def parse(recipe: str | os.PathLike, overrides: dict | None = None):
    """The recipe with ``overrides``, parsed and type-checked (a jsonargparse Namespace); nothing is built."""
    return _cli(recipe, overrides, instantiate=False).config


@dataclass
class Built:
    module: object  # SwiftKVDistillation
    datamodule: object  # DistillDataModule
    trainer: object  # lightning.Trainer


def build(recipe: str | os.PathLike, overrides: dict | None = None) -> Built:
    """The recipe's LightningModule, data module and Trainer, with ``overrides`` applied."""
    cli = _cli(recipe, overrides, instantiate=True)
    return Built(cli.model, cli.datamodule, cli.trainer)


def budgeted_fit(
    recipe: str | os.PathLike,
    folder: Path,
    seconds: float | None = None,
    overrides: dict | None = None,
    checkpoint_seconds: float | None = None,
    steps: int | None = None,
) -> tuple[Built, dict]:
    """Distil with ``recipe`` for ``seconds`` of training (warm-up + cosine over that time; a live bar that stops
    the run when the time is spent), or for ``steps`` optimizer steps (the schedule over the steps), with logs in
    ``folder/logs/version_0`` (a resumed run's rows after the earlier ones: ``ResumableCSVLogger``) and no export.
    With ``checkpoint_seconds``, the trainable weights are checkpointed in ``folder/checkpoints`` at the first step
    end that many seconds after the last checkpoint (0: every step), and a run that finds ``last.ckpt`` there
    resumes from it. Returns what was built and the run's summary (``RunReport``,
    rank 0's on every process).

    The recipe's numerics (accelerator, precision, clipping, validation cadence) stay; its length, loggers,
    callbacks and output folder are replaced by these. A bf16 precision on a CPU without native bf16 trains in
    ``32-true`` (``cpu_precision``)."""
    from .build import cpu_precision

    if (seconds is None) == (steps is None):
        raise ValueError("budgeted_fit: give either seconds or steps.")
    folder = Path(folder)
    given = dict(overrides or {})
    settings = parse(recipe, given)
    precision = settings.trainer.precision
    if settings.trainer.accelerator in ("cpu", None) and precision is not None:
        precision = cpu_precision(precision)
    callbacks = [{"class_path": "swiftkv_distill.callbacks.RunReport"}]
    if seconds is not None:
        callbacks.insert(0, {"class_path": "swiftkv_distill.callbacks.BudgetProgress",
                             "init_args": {"budget_seconds": seconds}})  # fmt: skip
    checkpointing = checkpoint_seconds is not None
    if checkpointing:
        callbacks.insert(0, {
            "class_path": "swiftkv_distill.checkpointing.ModelCheckpoint",
            "init_args": {"dirpath": str(folder / "checkpoints"), "save_last": True, "save_top_k": 0,
                          "train_time_interval": str(timedelta(seconds=checkpoint_seconds)),  # "0:01:00"
                          "every_n_train_steps": None},  # not the recipe's (jsonargparse merges the two)
        })  # fmt: skip
    run = {
        "model.schedule_seconds": seconds,
        "trainer.precision": precision,
        "trainer.max_steps": steps or 1_000_000,  # with seconds, a bound only: BudgetProgress stops the run
        "trainer.max_time": None,
        "trainer.max_epochs": None,
        "trainer.default_root_dir": str(folder),
        "trainer.logger": {"class_path": "swiftkv_distill.callbacks.ResumableCSVLogger",
                           "init_args": {"save_dir": str(folder), "name": "logs", "version": 0}},
        "trainer.callbacks": callbacks,
        "trainer.enable_checkpointing": checkpointing,
        "trainer.enable_progress_bar": steps is not None,  # BudgetProgress is the bar of a run in seconds
        "trainer.enable_model_summary": False,
        "trainer.num_sanity_val_steps": 0,
    }  # fmt: skip
    built = build(recipe, {**run, **given, "trainer.precision": precision})
    resume = last_checkpoint(built.trainer) if checkpointing else None
    if resume:
        print(f"   resuming from {resume}", flush=True)
    check_resume(resume, built.trainer, built.module, built.datamodule)
    built.module.resume_from = resume
    with told_out_of_memory(built.trainer, built.module, built.datamodule):
        built.trainer.fit(built.module, built.datamodule, ckpt_path=resume)
    # rank 0 alone writes the summary (RunReport), and nothing waits for it after fit: every process gets its copy,
    # or the reason rank 0 has none (the others would wait for it until the process group's timeout)
    trainer, summary = built.trainer, None
    if trainer.is_global_zero:
        try:
            summary = json.loads((folder / "logs" / "version_0" / "summary.json").read_text())
        except (OSError, ValueError) as error:
            summary = f"budgeted_fit: the run's summary could not be read: {error}"
    summary = trainer.strategy.broadcast(summary)
    if isinstance(summary, str):
        raise RuntimeError(summary)
    return built, {**summary, "resumed": bool(resume)}
