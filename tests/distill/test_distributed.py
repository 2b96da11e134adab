"""Two CPU processes (gloo), FSDP2 through Lightning's ModelParallelStrategy, launched like a cluster job
(`fabric run apps/distill.py`; `lightning run model` before Lightning 2.3), with activation checkpointing and compiled
layers (``compile_layers``): the same losses and the same distilled weights as one unsharded eager process, with the
weights read by rank 0 alone, and checkpoints of the trained weights alone."""

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from tests.conftest import free_port

ROOT = Path(__file__).parents[2]


def _config(
    tmp_path, tiny_model, text_file, name, batch_size, strategy, checkpoint_dir=None, recompute=0, callbacks=(),
    **changes,
):  # fmt: skip
    out = tmp_path / name
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "max_steps": 4,
            "limit_val_batches": 0,
            "num_sanity_val_steps": 0,
            "log_every_n_steps": 1,
            "enable_progress_bar": False,
            "enable_checkpointing": checkpoint_dir is not None,
            "use_distributed_sampler": False,
            "default_root_dir": str(out),
            "strategy": strategy,
            "logger": [
                {
                    "class_path": "lightning.pytorch.loggers.CSVLogger",
                    "init_args": {"save_dir": str(out), "name": "logs"},
                }
            ],
            "callbacks": [
                {
                    "class_path": "swiftkv_distill.callbacks.ExportHF",
                    "init_args": {"dirpath": str(out / "export"), "serving": False},
                }
            ],
        },
    }
    if checkpoint_dir is not None:  # sharded (distributed) Lightning checkpoints every 2 steps, all kept
        config["trainer"]["callbacks"].append(
            {
                "class_path": "swiftkv_distill.checkpointing.ModelCheckpoint",
                "init_args": {"dirpath": str(checkpoint_dir), "save_top_k": -1, "every_n_train_steps": 2},
            }
        )
    config |= {
        "model": {
            "model": str(tiny_model),
            "num_key_value_layers": 2,
            "learning_rate": 3e-3,
            # a constant learning rate: the schedule must not depend on max_steps for the resume check below
            "warmup_fraction": 0.0,
            "min_lr_ratio": 1.0,
            "hidden_loss_weight": 0.5,
            "evaluate_before_training": False,
            # fitted before step 1 from each rank's share of the rows (FSDP2: into sharded parameters); the
            # summed normal equations must give the single-process weights, or the first losses would differ
            "kv_init": "least_squares",
            "activation_checkpointing": recompute,  # the sharded runs recompute every layer in the backward
            "compile_layers": strategy != "auto",  # the sharded runs compile each layer, the single run not
        },
        "data": {
            "train_files": [str(text_file)],
            "max_length": 16,
            "batch_size": batch_size,
            "val_fraction": 0.1,
            "max_train_rows": 16,
        },
    }
    config["trainer"]["callbacks"] += list(callbacks)
    for section, values in changes.items():  # e.g. trainer={"max_steps": 50}, model={"compile_layers": False}
        config[section] |= values
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, out


def _fsdp2(data_parallel: int = 2, tensor_parallel: int = 1, timeout: str | None = None) -> dict:
    """Lightning's ModelParallelStrategy (FSDP2 over the data-parallel processes), as a recipe names it."""
    init_args = {"data_parallel_size": data_parallel, "tensor_parallel_size": tensor_parallel}
    return {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
            "init_args": init_args | ({"timeout": timeout} if timeout else {})}  # fmt: skip


def _launch(config, cwd, *options, processes: int = 2, env=None, check: bool = True):
    """The distillation job (``apps/distill.py``) as a cluster launches it, ``fabric run`` on 2 CPU processes, or
    as one process; its output captured (shown when ``check`` and it fails)."""
    env = env or {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    app = [str(ROOT / "apps" / "distill.py"), "--config", str(config), *options]
    if processes == 1:
        command = [sys.executable, *app, "--trainer.devices", "1"]
    else:
        fabric = shutil.which("fabric", path=str(Path(sys.executable).parent))
        # a port of its own: fabric run's default (29400) is taken while another test's launch runs beside it
        command = [fabric, "run", "--accelerator", "cpu", "--devices", str(processes), "--main_port", str(free_port()),
                   *app]  # fmt: skip
    result = subprocess.run(command, env=env, cwd=cwd, timeout=300, capture_output=True, text=True)
    assert not check or result.returncode == 0, result.stdout + result.stderr
    return result


def _losses(out, name: str = "train/loss"):
    (metrics,) = out.glob("logs/*/metrics.csv")
    with open(metrics) as f:
        return [float(row[name]) for row in csv.DictReader(f) if row.get(name)]


def _metrics(out, prefixes) -> dict[str, float]:
    (metrics,) = out.glob("logs/*/metrics.csv")
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    return {k: float(v) for row in rows for k, v in row.items() if k.startswith(prefixes) and v}


def _trained(out):
    state = load_file(out / "export" / "hf" / "model.safetensors")
    return {k: v for k, v in state.items() if "swiftkv" in k}


class LoadFails(L.Callback):
    """``from_pretrained`` fails in rank 0 alone (``rank0``: a checkpoint it cannot read) or in every other process
    (under FSDP2 only rank 0 loads the model and sends each process its shards: ``parallelize.shard_from_rank0``),
    while the run builds its model: until training starts (ExportHF reads it again on rank 0 at the end)."""

    def __init__(self, rank0: bool):
        self.rank0 = rank0

    def setup(self, trainer, pl_module, stage):  # before configure_model, where the step is built
        if (trainer.global_rank == 0) == self.rank0:
            from transformers import AutoModelForCausalLM

            def fail(*args, **kwargs):
                raise OSError(f"rank {trainer.global_rank} may not load the model here (test)")

            self.restore = AutoModelForCausalLM.from_pretrained
            AutoModelForCausalLM.from_pretrained = fail

    def on_train_start(self, trainer, pl_module):
        if hasattr(self, "restore"):
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_pretrained = self.restore


@pytest.mark.distributed
def test_two_process_fsdp2_matches_single_process(tmp_path, tiny_model, text_file):
    inductor = tmp_path / "inductor"  # where the compiled layers' generated code is written
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "TORCHINDUCTOR_CACHE_DIR": str(inductor)}  # fmt: skip
    fsdp2 = _fsdp2()
    single_cfg, single_out = _config(tmp_path, tiny_model, text_file, "single", batch_size=4, strategy="auto")
    ckpt_dir = tmp_path / "ckpt"
    rank0_reads = [{"class_path": "tests.distill.test_distributed.LoadFails", "init_args": {"rank0": False}}]
    sharded_cfg, sharded_out = _config(
        tmp_path, tiny_model, text_file, "sharded", 2, fsdp2, ckpt_dir, recompute=1, callbacks=rank0_reads
    )
    _launch(single_cfg, tmp_path, processes=1, env=env)
    _launch(sharded_cfg, tmp_path, env=env)
    # compile_layers ran under FSDP2 (its hooks stay eager): inductor wrote code for the layers' MLP
    generated = [p.read_text() for p in inductor.rglob("*.py")]
    assert any("def call(" in code and "silu" in code for code in generated), "no decoder layer was compiled"

    # resumed from the sharded run's checkpoint after step 2 (a distributed checkpoint: one shard file per rank)
    # to step 4: the same weights as the uninterrupted run. That checkpoint holds the trained weights and their
    # optimizer state alone, so rank 0 (the only process that reads) reads the frozen ones from the model again.
    (step2,) = ckpt_dir.glob("*step=2.ckpt")
    assert step2.is_dir() and len(list(step2.glob("*.distcp"))) == 2
    saved = FileSystemReader(step2).read_metadata().state_dict_metadata
    weights = {k.removeprefix("state_dict.") for k in saved if k.startswith("state_dict.")}
    # the trained weights the HF export holds, and nothing else
    assert weights == {f"step.model.{k}" for k in _trained(sharded_out)}, weights
    assert {k.split(".")[0] for k in saved} == {"state_dict", "optimizer_0"}
    resume_cfg, resume_out = _config(
        tmp_path, tiny_model, text_file, "resumed", 2, fsdp2, recompute=1, callbacks=rank0_reads
    )
    _launch(resume_cfg, tmp_path, "--ckpt_path", str(step2), env=env)
    # it trained steps 3 and 4 only (a run that ignored the checkpoint would train 4 steps to the same weights)
    assert _losses(resume_out) == _losses(sharded_out)[2:]
    resumed = _trained(resume_out)
    for name, value in _trained(sharded_out).items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=name)

    # the step's metrics too: each process logs its share of the mean over both processes' distilled positions
    for name in ("train/loss", "train/kl", "train/agreement", "train/hidden_mse"):
        single, sharded = torch.tensor(_losses(single_out, name)), torch.tensor(_losses(sharded_out, name))
        assert len(single) == len(sharded) == 4, name
        torch.testing.assert_close(sharded, single, rtol=1e-4, atol=1e-6, msg=name)
    expected, got = _trained(single_out), _trained(sharded_out)
    assert expected.keys() == got.keys() and expected
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)


class LateRank(L.Callback):
    """Rank 1 reaches its first step 8 s after rank 0, whose clock therefore reads 8 s more at every step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and batch_idx == 0:
            time.sleep(8)


@pytest.mark.distributed
def test_a_time_budget_stops_every_process_at_the_same_step(tmp_path, tiny_model, text_file):
    """``BudgetProgress`` stops at the step where rank 0's clock passes the budget, on every rank: a rank that stopped
    on its own clock would leave the others waiting in the next step's collectives (here: rank 0 passes a 6 s
    budget at step 1, rank 1 seconds later)."""
    strategy = _fsdp2(timeout="0:01:00")
    callbacks = [
        {"class_path": "tests.distill.test_distributed.LateRank"},
        {"class_path": "swiftkv_distill.callbacks.BudgetProgress", "init_args": {"budget_seconds": 6.0}},
    ]
    config, out = _config(
        tmp_path, tiny_model, text_file, "budget", 2, strategy, callbacks=callbacks,
        trainer={"max_steps": 200}, model={"compile_layers": False, "kv_init": "published"},
    )  # fmt: skip
    _launch(config, tmp_path)
    assert len(_losses(out)) == 1  # stopped after step 1, and both ranks went on to the export together
    assert _trained(out)


class SlowExport(L.Callback):
    """Rank 0's export takes 60 s (a 70B export to slow storage: longer than the process group's timeout)."""

    def on_fit_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            time.sleep(60)


@pytest.mark.distributed
def test_the_other_processes_wait_for_rank_0s_export_past_the_process_groups_timeout(
    tmp_path, tiny_model, text_file
):
    """Rank 0 writes the export alone, after the last collective; the others wait for it at the end of the job. A
    wait bounded by the process group's timeout (here 40 s; Lightning's default is 30 min) ended them with an error,
    and the launcher then stopped rank 0 mid-write: no export, a failed job."""
    strategy = _fsdp2(timeout="0:00:40")  # it bounds the rendezvous too: 20 s was too short on a busy machine
    config, out = _config(
        tmp_path, tiny_model, text_file, "slow-export", 2, strategy, trainer={"max_steps": 1},
        callbacks=[{"class_path": "tests.distill.test_distributed.SlowExport"}],
        model={"compile_layers": False, "kv_init": "published"},
    )  # fmt: skip
    _launch(config, tmp_path)
    assert _trained(out)


@pytest.mark.distributed
def test_when_rank_0_cannot_load_the_model_every_process_stops(tmp_path, tiny_model, text_file):
    """The other processes wait for rank 0's weights: they must stop with its error, not wait in the broadcast until
    the process group's timeout (here 2 min; 30 by default), where the launcher does not stop them."""
    strategy = _fsdp2(timeout="0:02:00")
    callbacks = [{"class_path": "tests.distill.test_distributed.LoadFails", "init_args": {"rank0": True}}]
    config, _ = _config(
        tmp_path, tiny_model, text_file, "failed", 2, strategy, callbacks=callbacks,
        model={"compile_layers": False, "kv_init": "published"},
    )  # fmt: skip
    result = _launch(config, tmp_path, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    # in one line: rank 1's own traceback would say nothing of the cause
    rank_1 = r"\nswiftkv distill: process 0 on node 0 \(\S+\) stopped, so this one does: OSError: rank 0 may not load"
    assert re.search(rank_1, output), output


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["tensor-parallel", "too-few-rows"])
def test_bad_runs_stop_every_process_before_a_weight_is_read(tmp_path, tiny_model, text_file, case):
    """ModelParallelStrategy with a tensor-parallel dimension (Lightning's ``auto`` sizes on one node give it every
    GPU: each process would train its own replica on its own batches), or training rows too few for a batch on each
    process: both processes stop at once with the fix, before rank 0 reads a weight (here it would fail to)."""
    tensor_parallel, rows = (2, 16) if case == "tensor-parallel" else (1, 3)
    strategy = _fsdp2(data_parallel=2 // tensor_parallel, tensor_parallel=tensor_parallel, timeout="0:02:00")
    callbacks = [{"class_path": "tests.distill.test_distributed.LoadFails", "init_args": {"rank0": True}}]
    config, out = _config(
        tmp_path, tiny_model, text_file, case, 2, strategy, callbacks=callbacks,
        model={"kv_init": "published"}, data={"max_train_rows": rows},
    )  # fmt: skip
    result = _launch(config, tmp_path, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "may not load the model" not in output, output
    if case == "tensor-parallel":
        fix = "--trainer.strategy.data_parallel_size 2 --trainer.strategy.tensor_parallel_size 1"
        assert "ModelParallelStrategy has tensor_parallel_size 2" in output and fix in output, output
    else:
        assert "3 training row(s) of up to 16 tokens make no batch of batch_size 2" in output, output
    assert not (out / "export").exists()


class ShardDtypes(L.Callback):
    """Writes ``dtypes-rank<r>.json``: the dtypes of the process's shards of the frozen and of the trained weights."""

    def on_train_end(self, trainer, pl_module):
        import json

        dtypes = {"frozen": set(), "trained": set()}
        for p in pl_module.parameters():
            dtypes["trained" if p.requires_grad else "frozen"].add(str(p.dtype))
        out = Path(trainer.default_root_dir) / f"dtypes-rank{trainer.global_rank}.json"
        out.write_text(json.dumps({k: sorted(v) for k, v in dtypes.items()}))


@pytest.mark.distributed
def test_fsdp2_shards_bf16_frozen_weights_beside_fp32_trained_ones(tmp_path, tiny_model, text_file):
    """``frozen_dtype: bfloat16`` under FSDP2 (the GPU recipes): each process holds its shards of the teacher in bf16
    and of the trained weights in fp32 (their AdamW master weights), the K/V fit and the steps run, and the losses
    are the single process's, up to bf16's rounding in another batch split (the weights' updates then differ by up to
    AdamW's step size wherever a gradient is near zero: the fp32 test above checks the weights exactly). The sharded
    run accumulates its gradients over 2 batches a step."""
    import json

    fsdp2 = _fsdp2()
    # 3 held-out rows: the second process runs the first row again (every process runs as many batches) unscored
    mixed = {
        "trainer": {"precision": "bf16-mixed"},
        "model": {"frozen_dtype": "bfloat16", "compile_layers": False, "evaluate_before_training": True},
        "data": {"val_files": [str(text_file)], "max_val_rows": 3, "val_batch_size": 1},
    }
    dtypes = [{"class_path": "tests.distill.test_distributed.ShardDtypes"}]
    single_cfg, single_out = _config(
        tmp_path, tiny_model, text_file, "single", 4, "auto", callbacks=dtypes, **mixed
    )
    # each process's 2 rows of a step as a window of 2 batches of 1 row: the gradients summed as sharded
    # tensors, then made the mean over both processes' 4 rows (step.AccumulationWindow)
    accumulated = mixed | {"trainer": {"precision": "bf16-mixed", "accumulate_grad_batches": 2}}
    sharded_cfg, sharded_out = _config(
        tmp_path, tiny_model, text_file, "sharded", 1, fsdp2, callbacks=dtypes, **accumulated
    )
    _launch(single_cfg, tmp_path, processes=1)
    _launch(sharded_cfg, tmp_path)
    for out, ranks in ((single_out, 1), (sharded_out, 2)):
        for rank in range(ranks):
            held = json.loads((out / f"dtypes-rank{rank}.json").read_text())
            assert held == {"frozen": ["torch.bfloat16"], "trained": ["torch.float32"]}, (out.name, rank)
    # the losses after the first step follow the distilled weights: an update wrongly reduced would show there;
    # the step's metrics are the window's (both batches of each process), not its last batch's
    for name in ("train/loss", "train/kl", "train/agreement", "train/hidden_mse"):
        single, sharded = _losses(single_out, name), _losses(sharded_out, name)
        assert len(single) == len(sharded) == 4, name
        # the first step's agreement exactly, the later ones within 2 of a step's 64 positions (top-1 near-ties
        # flip with the bf16 rounding by which the weights part)
        atol = [1e-6] + [2 / 64 if name == "train/agreement" else 1e-6] * 3
        for a, b, tolerance in zip(sharded, single, atol, strict=True):
            assert a == pytest.approx(b, rel=1e-2, abs=tolerance), (name, sharded, single)
    # the held-out figures before and after the K/V fit: the same positions scored, the same values
    expected, got = _metrics(single_out, ("before/", "init/")), _metrics(sharded_out, ("before/", "init/"))
    assert expected.keys() == got.keys() and "before/agreement" in expected
    assert got["before/tokens"] == expected["before/tokens"] == 3 * 16
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-2, abs=1e-4), name


BUDGETED_FIT = """
import json, sys, time
from pathlib import Path
from swiftkv_distill.callbacks import RunReport
from swiftkv_distill.recipe import budgeted_fit

write = RunReport.on_fit_end
def write_late(self, trainer, module):  # as on a slow file system: the other rank has long finished its fit
    time.sleep(3)
    write(self, trainer, module)
RunReport.on_fit_end = write_late

model, data, out, callbacks = sys.argv[1:]
built, summary = budgeted_fit("smollm2-135m-cpu", Path(out), steps=2, overrides={
    "model.model": model, "model.num_key_value_layers": 2, "model.kv_init": "published",
    "data.train_files": [data], "data.val_files": [data], "data.max_length": 16, "data.batch_size": 2,
    "trainer.devices": 2, "trainer.precision": "32-true", **json.loads(callbacks)})
print(f"rank {built.trainer.global_rank}: steps {summary['global_step']}", flush=True)
"""


@pytest.mark.distributed
def test_budgeted_fit_gives_every_process_rank0s_summary(tmp_path, tiny_model, text_file):
    """``budgeted_fit`` on 2 processes (the benchmarks' recipe path): rank 0 alone writes ``summary.json``, and
    nothing after fit waits for it (here it writes 3 s late); every process returns rank 0's, never a stale file
    left by an earlier run, nor fails for want of one. A run without the summary (its callbacks replaced) stops
    every process with the reason; none waits for rank 0's copy."""
    out = tmp_path / "run"
    (out / "logs" / "version_0").mkdir(parents=True)
    (out / "logs" / "version_0" / "summary.json").write_text(json.dumps({"global_step": 999}))
    script = tmp_path / "fit.py"
    script.write_text(BUDGETED_FIT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    fabric = shutil.which("fabric", path=str(Path(sys.executable).parent))
    command = [fabric, "run", "--accelerator", "cpu", "--devices", "2", "--main_port", str(free_port()), str(script),
               str(tiny_model), str(text_file), str(out)]  # fmt: skip
    result = subprocess.run(
        [*command, "{}"], env=env, cwd=tmp_path, timeout=300, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(re.findall(r"rank \d: steps \d+", result.stdout)) == ["rank 0: steps 2", "rank 1: steps 2"]
    shutil.rmtree(out)
    no_report = json.dumps({"trainer.callbacks": []})
    result = subprocess.run(
        [*command, no_report], env=env, cwd=tmp_path, timeout=120, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert result.stderr.count("RuntimeError: budgeted_fit: the run's summary could not be read") == 2, (
        result.stderr
    )
