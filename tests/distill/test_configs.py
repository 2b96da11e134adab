"""Every shipped recipe (swiftkv_distill/recipes/, linked from configs/distill/) parses against the CLI's signatures;
the CPU recipe builds its objects; a recipe is found by name from any folder."""

import json
import logging
import re
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.strategies import ModelParallelStrategy

from swiftkv_distill.build import cpu_has_fast_bf16
from swiftkv_distill.recipe import RECIPES_DIR, DistillCLI, make_cli

CONFIGS = sorted(RECIPES_DIR.glob("*.yaml"))


class ParseOnly(DistillCLI):
    """Parses and type-checks the whole config; instantiates nothing (GPU recipes name models not present here)."""

    def instantiate_classes(self) -> None:
        pass


def test_configs_distill_is_the_shipped_recipes(tmp_path, monkeypatch):
    """``configs/distill/NAME.yaml`` (the paths the docs use) are the package's files, and ``--config NAME`` (``-c``)
    or that path resolves to them from a folder that has no configs/."""
    from swiftkv_distill.recipe import recipe_path

    linked = Path(__file__).parents[2] / "configs" / "distill"
    assert linked.resolve() == RECIPES_DIR.resolve()
    monkeypatch.chdir(tmp_path)
    for name in ("smollm2-135m-cpu", "smollm2-135m-cpu.yaml", "configs/distill/smollm2-135m-cpu.yaml"):
        assert recipe_path(name) == RECIPES_DIR / "smollm2-135m-cpu.yaml"
    for given in (
        ["--config", "smollm2-135m-cpu"],
        ["-c", "smollm2-135m-cpu"],
        ["--config=smollm2-135m-cpu"],
    ):
        cli = make_cli(given, run=False, cli_class=ParseOnly)
        assert cli.config.model.num_key_value_layers == 20, given
    with pytest.raises(ValueError, match="not a shipped recipe"):
        recipe_path("smollm3")


def test_the_four_recipes_exist():
    assert {p.stem for p in CONFIGS} >= {
        "smollm2-135m-cpu",
        "llama-3.1-8b-instruct",
        "llama-3.1-70b-instruct",
        "qwen2.5-7b-instruct",
    }


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_recipe_parses_and_every_option_is_commented(path):
    cli = make_cli(["--config", str(path)], run=False, cli_class=ParseOnly)
    config = cli.config
    assert config.model.num_key_value_layers >= 1 and config.data.max_length >= 2
    # every option with a value carries a comment (nested init_args of callbacks/loggers excepted)
    for line in path.read_text().splitlines():
        option = re.match(r"^(\s*)([a-z_]+):\s*(\S.*)?$", line)
        if (
            option
            and option.group(3)
            and option.group(2) not in ("class_path", "init_args")
            and len(option.group(1)) <= 6
        ):
            assert "#" in line, f"uncommented option in {path.name}: {line}"
    raw = yaml.safe_load(path.read_text())
    assert "model" not in raw["data"], "data.model is linked from model.model"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_one_output_folder_per_recipe(path):
    """The recipe names its output folder once (trainer.default_root_dir); loggers, checkpoints and exports are
    interpolated under it, so overriding it on the command line moves all of them."""
    root = yaml.safe_load(path.read_text())["trainer"]["default_root_dir"]
    assert path.read_text().count(root) == 1

    class Parse(ParseOnly):
        def _run_subcommand(self, subcommand) -> None:
            pass

    for args, where in (
        (["--config", str(path)], root),
        (["--config", str(path), "--trainer.default_root_dir", "/x"], "/x"),
    ):
        for subcommand in ([], ["fit"]):
            cli = make_cli([*subcommand, *args], run=bool(subcommand), cli_class=Parse)
            trainer = (cli.config.fit if subcommand else cli.config).trainer
            assert trainer.default_root_dir == where
            assert [logger.init_args.save_dir for logger in trainer.logger] == [where, where]
            dirpaths = [c.init_args.dirpath for c in trainer.callbacks if "dirpath" in c.init_args]
            assert dirpaths == [f"{where}/checkpoints", f"{where}/export"]


def test_cpu_recipe_instantiates():
    path = next(p for p in CONFIGS if p.stem == "smollm2-135m-cpu")
    cli = make_cli(["--config", str(path)], run=False)
    assert cli.model.hparams.num_key_value_layers == 20 and cli.datamodule.model_path == "default"
    assert cli.trainer.max_steps > 0


def test_several_nodes_without_a_launcher_are_refused_before_anything_starts(monkeypatch):
    """The 70B recipe (2 nodes) started on one node as a plain command would wait 30 minutes for the other node's
    processes: refused at once, saying how to launch it on each node or run it on one. Under a launcher (here
    MASTER_ADDR, as set by hand or torchrun) the same settings instantiate."""
    from swiftkv_distill.cli import main
    from swiftkv_distill.launch import MULTI_NODE_LAUNCH

    for name in MULTI_NODE_LAUNCH:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(
        SystemExit,
        match=r"trainer.num_nodes is 2.*fabric run --num_nodes 2 --node_rank RANK.*"
        r"--devices 8 .*--trainer.strategy.data_parallel_size 8 .*accumulate_grad_batches 2 "
        r"--trainer.val_check_interval 1000 keep it",
    ):
        main(["fit", "--config", "llama-3.1-70b-instruct", "--model.model", "/models/Llama-3.1-70B-Instruct"])
    two_nodes = ["--config", "smollm2-135m-cpu", "--trainer.num_nodes", "2"]
    with pytest.raises(ValueError, match="trainer.num_nodes is 2"):
        make_cli(two_nodes, run=False)
    monkeypatch.setenv("MASTER_ADDR", "node-0")
    assert make_cli(two_nodes, run=False).trainer.num_nodes == 2


def test_a_sharding_that_is_not_the_processes_started_is_refused_before_they_start(monkeypatch):
    """The 8-GPU recipe's FSDP2 over 8 processes, run with one device: refused when parsed, naming the fix with what
    keeps the recipe's global batch and validations (Lightning itself finds it only once the processes are up);
    matching sizes and Lightning's "auto" pass. Under `fabric run` without --devices (it starts 1 process a node,
    which apps/distill.py passes on as trainer.devices) the fix is first fabric run's --devices."""
    from apps.distill import job_arguments

    one_device = [
        "--config",
        "llama-3.1-8b-instruct",
        "--model.model",
        "default",
        "--trainer.accelerator",
        "cpu",
        "--data.train_files",
        "[dataset:brown_train]",
    ]
    with pytest.raises(
        ValueError,
        match=r"data_parallel_size 8 x tensor_parallel_size 1 = 8 processes, but trainer.devices 1 x num_nodes 1 "
        r"start 1: set --trainer.strategy.data_parallel_size 1, or --trainer.strategy auto \(the global batch is "
        r"then 8x smaller: --trainer.accumulate_grad_batches 8 --trainer.val_check_interval 4000 keep it",
    ):
        make_cli([*one_device, "--trainer.devices", "1"], run=False)
    for fix in (["--trainer.strategy.data_parallel_size", "1"], ["--trainer.strategy", "auto"]):
        assert make_cli([*one_device, "--trainer.devices", "1", *fix], run=False).trainer.world_size == 1
    launched = {"LT_ACCELERATOR": "cpu", "LT_DEVICES": "1", "LT_NUM_NODES": "1"}  # what `fabric run` exports
    for name, value in launched.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        ValueError, match=r"start 1: give `fabric run` --devices 8 \(it started 1 a node\); or set"
    ):
        make_cli(job_arguments(one_device, launched)[1:], run=False)
    # the 70B recipe's 16 processes launched on one node of 8 GPUs (fabric run without --num_nodes 2): more nodes,
    # or a sharding over 8; never more processes than the node has GPUs (this machine: none)
    launched = {"LT_ACCELERATOR": "cuda", "LT_DEVICES": "8", "LT_NUM_NODES": "1"}
    for name, value in launched.items():
        monkeypatch.setenv(name, value)
    seventy_b = ["--config", "llama-3.1-70b-instruct", "--model.model", "default"]
    with pytest.raises(
        ValueError,
        match=r"start 8: give `fabric run` --num_nodes 2 \(it started 1\); or set "
        r"--trainer.strategy.data_parallel_size 8 \(the global batch is then 2x smaller",
    ) as refused:
        make_cli(
            job_arguments([*seventy_b, "--data.train_files", "[dataset:brown_train]"], launched)[1:],
            run=False,
        )
    assert "--devices 16" not in str(refused.value) or torch.cuda.device_count() >= 16


def test_gpu_recipe_strategy_is_fsdp2():
    path = next(p for p in CONFIGS if p.stem == "llama-3.1-8b-instruct")
    raw = yaml.safe_load(path.read_text())
    assert raw["trainer"]["strategy"]["class_path"].endswith(ModelParallelStrategy.__name__)
    assert raw["trainer"]["precision"] == "bf16-mixed" and raw["model"]["num_key_value_layers"] == 16


def test_cli_fit_writes_logs_plot_summary_and_exports(
    tmp_path, tiny_model, text_file, chat_file, recwarn, caplog, request
):
    from swiftkv_distill.cli import main

    out = tmp_path / "run"
    # what Lightning says goes to its own logger, which propagates to the root (pytest's handler) or not depending
    # on whether the root had a handler when lightning was first imported: listen on Lightning's logger itself.
    # Its level is the one a fresh process has (INFO, set when lightning is imported): a quickstart test run
    # earlier in this worker quietened it to ERROR
    lightning_logger = logging.getLogger("lightning.pytorch")
    caplog.set_level(logging.INFO, logger=lightning_logger.name)
    lightning_logger.addHandler(caplog.handler)
    request.addfinalizer(lambda: lightning_logger.removeHandler(caplog.handler))
    main(
        [
            "fit",
            "--model.model",
            str(tiny_model),
            "--model.num_key_value_layers",
            "2",
            "--model.early_exit",
            "true",
            "--data.train_files",
            f"[{text_file}, {chat_file}]",
            "--data.val_files",
            f"{{text: [{text_file}], chat: [{chat_file}]}}",
            "--data.max_length",
            "16",
            "--data.batch_size",
            "2",
            "--trainer.max_steps",
            "3",
            "--trainer.accelerator",
            "cpu",  # the warnings checked below are the CPU's, on a machine with a GPU too
            "--trainer.precision",
            "bf16-mixed",
            "--trainer.log_every_n_steps",
            "1",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.logger+=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={out}",
            "--trainer.logger+=lightning.pytorch.loggers.TensorBoardLogger",
            f"--trainer.logger.save_dir={out}",
            "--trainer.callbacks+=swiftkv_distill.callbacks.RunReport",
            "--trainer.callbacks+=swiftkv_distill.callbacks.ExportHF",
            f"--trainer.callbacks.dirpath={out}/export",
            f"--trainer.default_root_dir={out}",
        ]
    )
    # the output is what a user can act on: no warning Python shows by default (deprecations inside the libraries
    # are hidden outside __main__), no advertisement
    hidden = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
    shown = [f"{w.category.__name__}: {w.message}" for w in recwarn if not issubclass(w.category, hidden)]
    # our own, with what to do, on a CPU that emulates the recipe's bf16 (AVX2 only: no AVX512-BF16, no AMX)
    emulated = [w for w in shown if "bf16 is emulated here" in w and "--trainer.precision 32-true" in w]
    assert len(emulated) == (0 if cpu_has_fast_bf16() else 1), shown
    assert not [w for w in shown if w not in emulated], shown
    assert "Tip" not in caplog.text and "GPU available" in caplog.text
    (log_dir,) = [p.parent for p in out.rglob("metrics.csv")]
    summary = json.loads((log_dir / "summary.json").read_text())
    assert {"kl", "agreement", "student_ppl", "teacher_ppl", "early_exit_agreement"} <= summary[
        "before"
    ].keys()
    assert {"kl", "agreement", "early_exit_agreement"} <= summary["after"].keys()
    # the second validation set (chat) is measured and reported beside the first, under its name
    assert {"chat/kl", "chat/agreement", "chat/tokens"} <= summary["before"].keys() & summary["after"].keys()
    assert summary["after"]["chat/tokens"] < summary["after"]["tokens"]
    assert summary["init"]["kl"] < summary["before"]["kl"]  # the least-squares K/V init, before any step
    assert summary["kv_init"]["tokens"] > 0 and 0 < summary["kv_init"]["explained_mean"] <= 1
    assert (log_dir / "metrics.png").stat().st_size > 1000
    assert list(out.rglob("events.out.tfevents.*"))
    assert (out / "export" / "hf" / "early_exit_head.safetensors").is_file()
    assert (out / "export" / "hf-serving" / "config.json").is_file()


def test_parse_overrides_of_the_benchmarks():
    from swiftkv_distill.recipe import parse_overrides

    assert parse_overrides('lr=1e-3, lora_rank=16,lora_prefix=true,data.val_files={"a":[1]}') == {
        "model.learning_rate": 0.001,
        "model.lora_rank": 16,
        "model.lora_prefix": True,
        "data.val_files": {"a": [1]},
    }
    with pytest.raises(ValueError, match=r"unknown key 'rank'; use a recipe key"):
        parse_overrides("rank=4")
