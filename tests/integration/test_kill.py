"""Training, export and the main job survive SIGKILL: real processes, killed for real at named points
(swiftkv_core.faults: mid-step, inside a checkpoint save, between an export's staging and its rename, inside a
state.json write), then the same command again. Nothing half-written is ever read back, an earlier export stays
whole, and the resumed run ends with the weights of an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distill.conftest import TEXTS, tiny_llama, write_jsonl
from tests.processes import lines as output_lines

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


SHARDED = """
  strategy:
    class_path: lightning.pytorch.strategies.ModelParallelStrategy
    init_args: {data_parallel_size: 1, tensor_parallel_size: 1}"""


def recipe(folder: Path, model: Path, text: Path, out: Path, strategy: str = "") -> Path:
    """A small recipe: the tiny model, checkpoints every 2 steps, the serving export at the end; ``SHARDED`` as
    ``strategy``: FSDP2 (one process), its checkpoints folders of shards."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "recipe.yaml"
    path.write_text(f"""\
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1{strategy}
  precision: 32-true
  max_steps: 12
  log_every_n_steps: 1
  limit_val_batches: 0
  enable_progress_bar: false
  enable_model_summary: false
  use_distributed_sampler: false
  default_root_dir: {out}
  logger: false
  callbacks:
    - class_path: swiftkv_distill.checkpointing.ModelCheckpoint
      init_args: {{dirpath: {out}/checkpoints, save_last: true, save_top_k: 0, every_n_train_steps: 2}}
    - class_path: swiftkv_distill.callbacks.ExportHF
      init_args: {{dirpath: {out}/export, full: false, serving: true}}
model:
  model: {model}
  num_key_value_layers: 2
  learning_rate: 3.0e-3
  warmup_fraction: 0.2
  kv_init: published
  evaluate_before_training: false
data:
  train_files: [{text}]
  val_files: [{text}]
  max_length: 16
  batch_size: 2
""")
    return path


def run(command: list[str], pause: str | None = None, after: int = 1, timeout: float = 300) -> str:
    """Run ``command`` to its end, or (with ``pause``) until it stops at that point, then SIGKILL it. Returns its
    output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWIFTKV_PAUSE")}
    if pause:
        env |= {"SWIFTKV_PAUSE_AT": pause, "SWIFTKV_PAUSE_AFTER": str(after)}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    lines, ended = [], False
    try:
        for line in output_lines(proc.stdout, timeout):
            lines.append(line)
            if pause and line.startswith(f"SWIFTKV_PAUSED {pause}"):
                return "".join(lines)
        ended = True
    except AssertionError as error:  # past the time limit: with what it printed last
        raise AssertionError(f"{error}:\n" + "".join(lines[-40:])) from None
    finally:
        if not ended:  # stopped where it was told, or past the time limit
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not pause, f"never reached {pause}:\n" + "".join(lines[-40:])
    assert proc.returncode == 0, "".join(lines[-60:])
    return "".join(lines)


def last_step(checkpoint: Path) -> int:
    """The step of a checkpoint: a file, or a folder of shards (``meta.pt`` holds the loop's state)."""
    path = checkpoint / "meta.pt" if checkpoint.is_dir() else checkpoint
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


def assert_same_trained_weights(reference: Path, export: Path) -> None:
    full, resumed = load_file(reference / "model.safetensors"), load_file(export / "model.safetensors")
    trained = [name for name in full if "swiftkv" in name]
    assert trained and set(full) == set(resumed)
    for name in trained:  # resume == uninterrupted
        torch.testing.assert_close(resumed[name], full[name], rtol=0, atol=1e-6, msg=name)


def test_distill_fit_killed_at_every_awkward_point_resumes_to_the_uninterrupted_weights(tmp_path):
    model = tiny_llama(tmp_path / "tiny")
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in TEXTS])
    fit = [str(BIN / "swiftkv"), "distill", "fit", "--config"]
    full_out, killed_out = tmp_path / "full", tmp_path / "killed"
    run([*fit, str(recipe(tmp_path / "full-recipe", model, text, full_out))])
    command = [*fit, str(recipe(tmp_path / "killed-recipe", model, text, killed_out))]
    checkpoints, export = killed_out / "checkpoints", killed_out / "export" / "hf-serving"

    run(command, pause="training-step", after=7)  # mid-step 7: checkpoints of steps 2, 4, 6 written
    assert last_step(checkpoints / "last.ckpt") == 6
    # resumed at 6; killed with step 10's file staged beside step 8's
    out = run(command, pause="checkpoint-staged", after=2)
    assert "resuming from" in out and last_step(checkpoints / "last.ckpt") == 8  # step 8's, whole
    assert last_step(checkpoints / ".last.ckpt.staging") == 10  # staged, never read
    run(command)  # resumed at 8: trained to 12, the export written

    assert_same_trained_weights(full_out / "export" / "hf-serving", export)

    before = {f.name: f.read_bytes() for f in export.iterdir()}
    run([*command, "--trainer.max_steps", "14"], pause="atomic-directory")  # a newer export killed mid-write
    assert {f.name: f.read_bytes() for f in export.iterdir()} == before  # the earlier export, whole
    assert list(export.parent.glob(".hf-serving.staging.*"))  # the staged one is never taken for an export


def test_a_sharded_checkpoint_killed_mid_save_or_mid_swap_is_never_read_half_written(tmp_path):
    """FSDP2's checkpoints are folders of shards, which Lightning writes over the previous folder. Ours are staged
    beside it and swapped in (``swiftkv_distill.checkpointing``). Killed with step 4's checkpoint staged, and then
    between the swap's two moves, the run resumes each time from step 2's whole checkpoint, and ends with the
    weights of an uninterrupted run."""
    model = tiny_llama(tmp_path / "tiny")
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in TEXTS])
    fit = [str(BIN / "swiftkv"), "distill", "fit", "--config"]
    full_out, killed_out = tmp_path / "full", tmp_path / "killed"
    run([*fit, str(recipe(tmp_path / "full-recipe", model, text, full_out))])
    command = [*fit, str(recipe(tmp_path / "killed-recipe", model, text, killed_out, SHARDED))]
    last = killed_out / "checkpoints" / "last.ckpt"

    run(command, pause="checkpoint-staged", after=2)  # step 4's shards written beside step 2's checkpoint
    assert last.is_dir() and last_step(last) == 2 and list(last.glob("*.distcp"))
    assert last_step(last.with_name(".last.ckpt.staging")) == 4  # staged, never read
    out = run(command, pause="replace-directory")  # resumed at 2; step 4's swap killed half way
    assert f"resuming from {last}" in out
    (set_aside,) = last.parent.glob(".last.ckpt.old.*")
    assert not last.exists() and last_step(set_aside) == 2
    # a staged checkpoint of a name no save comes back to (one with a metric in it) is removed as the rerun starts
    (last.parent / ".epoch=0-step=3-kl=0.1.ckpt.staging").mkdir()
    out = run(command)  # resumed from the set-aside checkpoint: trained to 12, the export written
    assert f"resuming from {set_aside}" in out and last_step(last) == 12
    assert [p.name for p in last.parent.iterdir()] == ["last.ckpt"]  # nothing set aside or staged is left
    assert_same_trained_weights(full_out / "export" / "hf-serving", killed_out / "export" / "hf-serving")


def test_the_main_job_killed_mid_stage_and_mid_state_write_continues(tmp_path):
    model = tiny_llama(tmp_path / "tiny")
    text = write_jsonl(
        tmp_path / "text.jsonl", [{"text": " ".join(TEXTS[i:] + TEXTS[:i])} for i in range(12)]
    )
    out = tmp_path / "run"
    command = [
        str(BIN / "swiftkv"), "quickstart", "--model", str(model), "--out", str(out), "--num_key_value_layers", "2",
        "--budget_minutes", "0.05", "--train_files", f"[{text}]", "--heldout_text", f"[{text}]",
        "--heldout_chat_prompts", "", "--serve", "false", "--max_eval_rows", "2", "--prompt_lengths", "[16]",
        "--serve_workloads", "[96/8]",
    ]  # fmt: skip
    # state.json writes: the run's start, then after each stage; the 5th is the one after convert
    run(command, pause="state-write", after=5)
    state = json.loads((out / "state.json").read_text())  # the previous state, whole
    assert list(state["results"]) == ["teacher_answers", "frontier", "analyze"]
    run(command, pause="training-step", after=1)  # distillation killed mid-step (its first)
    state = json.loads((out / "state.json").read_text())
    assert list(state["results"]) == ["teacher_answers", "frontier", "analyze", "convert"]
    output = run(command)
    assert "analyze: done earlier, reused" in output and "convert: done earlier, reused" in output
    report = json.loads((out / "report.json").read_text())
    assert list(report["results"]) == [
        "teacher_answers",
        "frontier",
        "analyze",
        "convert",
        "distill",
        "evaluate",
        "prefill",
        "serve",
        "task_accuracy",
    ]
    assert (out / "distilled-serving" / "config.json").is_file()
