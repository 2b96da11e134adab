"""``swiftkv-distill fit --config configs/distill/<recipe>.yaml``: the LightningCLI of SwiftKV distillation."""

from __future__ import annotations

from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import LightningCLI

from .data import DistillDataModule
from .module import SwiftKVDistillation

TRAINER_DEFAULTS = {
    # The data module builds its own DistributedSampler (a seeded permutation per epoch, also for one process).
    # Loggers (CSV + TensorBoard) and callbacks (RunReport, ExportHF, ModelCheckpoint) are set by each recipe.
    "use_distributed_sampler": False,
}


class DistillCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # One model path for the module (weights) and the data (tokenizer, context length).
        parser.link_arguments("model.model", "data.model")


def make_cli(args=None, run: bool = True, cli_class: type[LightningCLI] = DistillCLI) -> LightningCLI:
    # the recipes' interpolations name keys from the config's own root (``trainer.``), also under a subcommand
    set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
    return cli_class(
        SwiftKVDistillation,
        DistillDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
        # ``${trainer.default_root_dir}/...`` in the recipes: one output folder per file, resolved after the
        # command line (an overridden default_root_dir moves everything under it)
        parser_kwargs={"parser_mode": "omegaconf+"},
        seed_everything_default=0,
    )


def main(args=None) -> None:
    make_cli(args)
    _end_process_group()


def _end_process_group() -> None:
    """Under a launcher, wait for every rank (rank 0 may still be writing the export) and tear the process group
    down before the interpreter exits: a rank that exits with it alive can abort in gloo's threads ("terminate
    called without an active exception"), and the launcher then kills the others mid-write."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
