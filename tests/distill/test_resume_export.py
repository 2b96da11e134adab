"""Lightning checkpoints: resume == uninterrupted; HF export round trip (full and serving) with the early head."""

import re
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from swiftkv_core.early_exit import EarlyExitHead, generate_with_early_exit
from swiftkv_distill import DistillDataModule, SwiftKVDistillation, export
from swiftkv_distill.checkpointing import ModelCheckpoint
from swiftkv_distill.schedule import total_steps
from tests.distill.runs import fit


def _trained(module):
    return {k: v.clone() for k, v in module.step.state_dict().items() if "swiftkv" in k or "early_exit" in k}


EPOCHS = {"max_steps": -1, "max_epochs": 2, "num_workers": 1}  # as the 8B recipes: bound by epochs, workers


@pytest.mark.parametrize(
    "interrupt_at, settings",
    [
        (5, {}),
        (12, {}),
        (15, {}),
        (15, {"num_workers": 1}),
        (10, {"limit_train_batches": 10}),
        (15, EPOCHS),
        (12, EPOCHS | {"checkpoint_every_epoch": True}),
    ],
    ids=[
        "mid-epoch-0",
        "epoch-0-end",
        "mid-epoch-1",
        "mid-epoch-1-worker",
        "limited-epoch-end",
        "epochs-mid-epoch-1",
        "epochs-epoch-end-hook",
    ],
)
def test_resume_equals_uninterrupted(tiny_model, text_file, tmp_path, interrupt_at, settings):
    """25 rows of 16 tokens, batch 2: 12 steps per epoch, 18 in all. Interrupted in the middle of the first epoch,
    at its end, or in the middle of the second (with a worker process too, which draws its indices as soon as the
    loader is iterated), at the end of an epoch cut to 10 steps (``limit_train_batches``), and in a run bound by 2
    epochs (whose schedule once made Lightning iterate the loader before the resume was restored) in the middle of
    the second or at the first's end, checkpointed at each epoch's end, the resumed run trains on exactly the batches of the uninterrupted one: the
    same weights. (Resumed in a later epoch, the loader once skipped nothing and trained the epoch's first batches
    twice; resumed at an epoch's end, it skipped the whole next epoch, or trained it in the first epoch's order.)"""
    settings = {"max_steps": 18} | settings
    workers = settings.pop("num_workers", 0)
    full, uninterrupted = fit(tiny_model, text_file, tmp_path / "full", **settings)
    assert uninterrupted.num_training_batches == settings.get("limit_train_batches", 12)
    # the schedule's length, counted without iterating the loader, is Lightning's
    assert total_steps(uninterrupted) == uninterrupted.estimated_stepping_batches
    _, interrupted = fit(tiny_model, text_file, tmp_path / "part", interrupt_at=interrupt_at, **settings)
    assert interrupted.global_step == interrupt_at
    ckpt = tmp_path / "part" / "ckpt" / "last.ckpt"
    state = torch.load(ckpt, weights_only=False)
    assert all("swiftkv" in k for k in state["state_dict"])  # only trained weights, not the frozen base
    resumed, trainer = fit(
        tiny_model, text_file, tmp_path / "part", ckpt_path=ckpt, num_workers=workers, **settings
    )
    assert trainer.global_step == uninterrupted.global_step
    expected, got = _trained(full), _trained(resumed)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


def test_resuming_with_other_settings_is_refused_naming_them(tiny_model, text_file, tmp_path):
    """The restored optimizer would go on at the old learning rate while the run reported the new one."""
    fit(tiny_model, text_file, tmp_path, max_steps=3, interrupt_at=1)
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    with pytest.raises(
        ValueError, match=r"model\.learning_rate 0\.003 -> 0\.001.*--trainer\.default_root_dir"
    ):
        fit(tiny_model, text_file, tmp_path, max_steps=3, ckpt_path=ckpt, learning_rate=1e-3)


def test_resuming_with_other_batches_per_step_or_other_rows_is_refused(tiny_model, text_file, tmp_path):
    """The checkpoint's position in the data counts each process's batches of a permutation of the training rows,
    and the schedule's length follows the batches per step: another number of processes or of accumulated batches,
    or data files that now make more rows, would train rows again (or never) and jump the learning rate; as many
    rows of other tokens (a data file edited in place) would train the rest of the run on other data. Refused,
    naming the change (the number of processes is checked the same way). The same file written again resumes."""
    data = tmp_path / "data.jsonl"
    shutil.copy(text_file, data)
    fit(tiny_model, data, tmp_path, max_steps=3, interrupt_at=1)
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    state = torch.load(ckpt, weights_only=False)["DistillDataModule"]
    assert state == {
        "world_size": 1,
        "accumulate_grad_batches": 1,
        "training_rows": state["training_rows"],
        "training_rows_sha256": state["training_rows_sha256"],
    }
    with pytest.raises(ValueError, match=r"trainer\.accumulate_grad_batches 1 -> 2"):
        fit(tiny_model, data, tmp_path, max_steps=3, ckpt_path=ckpt, accumulate_grad_batches=2)
    original = data.read_text()
    data.write_text(original.replace("Tuesday", "Monday"))  # one token for another: as many rows
    with pytest.raises(
        ValueError, match=r"the training rows' tokens \(sha256 \w{12}\.\.\. -> \w{12}\.\.\.: a data file"
    ):
        fit(tiny_model, data, tmp_path, max_steps=3, ckpt_path=ckpt)
    data.write_text(original * 2)  # the same file with its rows again after them
    with pytest.raises(ValueError, match=rf"training_rows {state['training_rows']} -> \d+\)"):
        fit(tiny_model, data, tmp_path, max_steps=3, ckpt_path=ckpt)
    data.write_text(original)  # tokenised again (the file's times changed), into the same rows
    _, trainer = fit(tiny_model, data, tmp_path, max_steps=3, ckpt_path=ckpt)
    assert trainer.global_step == 3


def test_a_resume_with_other_settings_is_refused_before_any_weight_is_read(tmp_path, tiny_model, text_file):
    """The refusal comes before the model is built (an 8B's weights read for nothing): here the resumed run's model
    has lost its weights file, and the refusal is still the one that names the change. A checkpoint to resume from
    that is not there is named too."""
    from swiftkv_distill.recipe import budgeted_fit, check_resume

    model = shutil.copytree(tiny_model, tmp_path / "model")
    overrides = {
        "model.model": str(model), "model.num_key_value_layers": 2, "model.kv_init": "published",
        "data.train_files": [str(text_file)], "data.val_files": [str(text_file)], "data.max_length": 16,
        "data.batch_size": 2, "trainer.precision": "32-true",
    }  # fmt: skip
    budgeted_fit("smollm2-135m-cpu", tmp_path / "run", steps=2, overrides=overrides, checkpoint_seconds=0)
    (model / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"other settings \(trainer\.accumulate_grad_batches 1 -> 2\)"):
        budgeted_fit("smollm2-135m-cpu", tmp_path / "run", steps=2, checkpoint_seconds=0,
                     overrides={**overrides, "trainer.accumulate_grad_batches": 2})  # fmt: skip
    with pytest.raises(FileNotFoundError, match="--ckpt_path .*nothing: no checkpoint there"):
        check_resume(tmp_path / "nothing", None, None, None)


def test_the_same_settings_written_another_way_resume(tmp_path, monkeypatch):
    """A relative and an absolute path to one folder, a tuple and its list: the same run."""
    from swiftkv_distill.build import check_same_run

    monkeypatch.chdir(tmp_path)
    (tmp_path / "converted").mkdir()
    saved = {"hyper_parameters": {"model": "converted", "betas": (0.9, 0.999)}}
    check_same_run(saved, {"model": str(tmp_path / "converted"), "betas": [0.9, 0.999]}, None)
    with pytest.raises(ValueError, match=r"model\.betas \(0\.9, 0\.999\) -> \[0\.9, 0\.95\].*--out"):
        check_same_run(saved, {"model": "converted", "betas": [0.9, 0.95]}, None)


def test_export_round_trip(tiny_model, text_file, tmp_path):
    module, _ = fit(tiny_model, text_file, tmp_path / "run", max_steps=3, early_exit=True)
    model = module.swiftkv_model.eval()
    ids = torch.tensor([[5, 17, 300, 42, 9, 8, 99, 1000]])
    with torch.no_grad():
        expected_student = model.swiftkv(True)(ids, use_cache=False).logits
        expected_teacher = model.swiftkv(False)(ids, use_cache=False).logits
    model.swiftkv(True)
    full = export(module, tmp_path / "hf")
    serving = export(module, tmp_path / "hf-serving", serving=True)
    loaded = AutoModelForCausalLM.from_pretrained(full).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, use_cache=False).logits, expected_student)
        torch.testing.assert_close(loaded.swiftkv(False)(ids, use_cache=False).logits, expected_teacher)
    small = AutoModelForCausalLM.from_pretrained(serving).eval()
    with torch.no_grad():
        torch.testing.assert_close(small(ids, use_cache=False).logits, expected_student)
    assert (serving / "model.safetensors").stat().st_size < (full / "model.safetensors").stat().st_size
    # the early-exit head travels with the checkpoint and drives early-exit decoding
    head = EarlyExitHead.load(full)
    torch.testing.assert_close(head.lm_head.weight, module.step.early_exit_head.lm_head.weight)
    always, exited = generate_with_early_exit(
        loaded.swiftkv(True), head, ids, max_new_tokens=5, threshold=0.0
    )
    assert exited == 4 and always.shape == (1, 13)
    never, exited = generate_with_early_exit(loaded, head, ids, max_new_tokens=5, threshold=1.01)
    greedy = loaded.generate(ids, max_new_tokens=5, do_sample=False)
    assert exited == 0 and torch.equal(never, greedy)
    # a second export over the first replaces it atomically (no staging folders left behind)
    export(module, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_export_from_a_loaded_checkpoint_needs_no_trainer(tiny_model, text_file, tmp_path, recwarn):
    """A Lightning checkpoint loaded with load_from_checkpoint (no Trainer attached) exports the trained weights;
    the frozen weights it leaves out are not reported missing."""
    trained, _ = fit(tiny_model, text_file, tmp_path / "run", max_steps=3, early_exit=True)
    recwarn.clear()
    loaded = SwiftKVDistillation.load_from_checkpoint(tmp_path / "run" / "ckpt" / "last.ckpt")
    assert not [str(w.message) for w in recwarn if "Found keys" in str(w.message)]
    assert loaded._trainer is None
    path = export(loaded, tmp_path / "hf")
    state = load_file(path / "model.safetensors")
    expected = {k.removeprefix("model."): v for k, v in _trained(trained).items() if "swiftkv" in k}
    assert expected
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    head = EarlyExitHead.load(path)
    torch.testing.assert_close(
        head.lm_head.weight, trained.step.early_exit_head.lm_head.weight, rtol=0, atol=0
    )


class SteppedClock(L.Callback):
    """A simulated wall clock for the module's time-based schedule: ``base + seconds_per_step * global_step``,
    set at each batch's start and end. Runs on a shared machine then see the same times whatever their speed,
    so an interrupted+resumed run and the uninterrupted one can be compared exactly."""

    def __init__(self, base: float, seconds_per_step: float = 10.0):
        self.base, self.seconds_per_step, self.now = base, seconds_per_step, base
        self.lr: dict[int, float] = {}

    def perf_counter(self) -> float:
        return self.now

    def on_train_batch_start(self, trainer, *args) -> None:
        self.now = self.base + self.seconds_per_step * trainer.global_step
        self.lr[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]

    def on_train_batch_end(self, trainer, *args) -> None:
        self.now = self.base + self.seconds_per_step * trainer.global_step


def test_resume_continues_the_wall_time_schedule(tiny_model, text_file, tmp_path, monkeypatch):
    """schedule_seconds: a resumed run continues the schedule where it stopped (not from the warm-up) and counts
    tokens_seen across the resume. 10 simulated seconds per step against an 80-second schedule, and max_steps 50
    (the runs stop at step 9): the time-based progress (step / 8) runs far ahead of the step-based one (step / 50),
    so it alone sets the learning rate."""
    from swiftkv_core import runtime

    def run(root, base, **kwargs):
        clock = SteppedClock(base)
        monkeypatch.setattr(
            runtime, "time", clock
        )  # the module's clock is runtime.Stopwatch's time.perf_counter()
        module, trainer = fit(
            tiny_model,
            text_file,
            root,
            max_steps=50,
            schedule_seconds=80.0,
            extra_callbacks=[clock],
            **kwargs,
        )
        return module, trainer, clock.lr

    full, _, full_lr = run(tmp_path / "full", base=0.0, interrupt_at=9)
    _, interrupted, _ = run(tmp_path / "part", base=500.0, interrupt_at=4)
    assert interrupted.global_step == 4
    # a later process: another clock origin
    resumed, trainer, resumed_lr = run(
        tmp_path / "part", base=1e6, interrupt_at=9, ckpt_path=tmp_path / "part" / "ckpt" / "last.ckpt"
    )
    assert trainer.global_step == 9 and sorted(resumed_lr) == list(range(4, 9))
    # the simulated clock only moves at step boundaries, so the times (and learning rates) agree to rounding
    for step in range(4, 9):
        assert resumed_lr[step] == pytest.approx(full_lr[step], rel=1e-9, abs=0), step
    assert (
        full_lr[8] < full_lr[6] < full_lr[4]
    )  # past the warm-up and decaying (a restart would warm up again)
    assert resumed.tokens_seen == full.tokens_seen > 0


def test_a_failed_export_leaves_the_earlier_one(tiny_model, text_file, tmp_path, monkeypatch):
    """The second export fails between its renames (moving the new folder into place): the first stays whole."""
    import os

    from swiftkv_distill.export import write_checkpoint

    module, _ = fit(tiny_model, text_file, tmp_path / "run", max_steps=2)
    out = tmp_path / "hf"
    export(module, out)
    ids = torch.tensor([[5, 17, 300, 42, 9, 8]])
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(out).eval()(ids, use_cache=False).logits
    files = sorted(p.name for p in out.iterdir())
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(dst) == out and ".staging." in str(src):
            raise OSError("simulated failure while moving the new export into place")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="simulated failure"):
        write_checkpoint(module.swiftkv_model, out)
    monkeypatch.setattr(os, "replace", real_replace)
    assert sorted(p.name for p in out.iterdir()) == files
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out).eval()(ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing left beside it


@pytest.mark.parametrize("there", ["other files", "the model"])
def test_an_export_folder_the_export_would_lose_is_refused_before_training(
    there, tiny_model, text_file, tmp_path
):
    """``ExportHF`` replaces ``dirpath/hf`` whole at the end: a folder of other files there, or the model being
    distilled (continuing from an earlier export into the same folder), is refused before any step, untouched."""
    from swiftkv_distill.callbacks import ExportHF
    from tests.distill.conftest import quiet_trainer

    folder = tmp_path / "export" / "hf"
    if there == "other files":
        folder.mkdir(parents=True)
        (folder / "notes.txt").write_text("mine")
        model, message = tiny_model, "holds files and is not a checkpoint folder"
    else:
        model, message = shutil.copytree(tiny_model, folder), "is \\(or holds\\) the model being read"
    before = sorted(p.name for p in folder.iterdir())
    module = SwiftKVDistillation(str(model), num_key_value_layers=2)
    data = DistillDataModule(str(model), [str(text_file)], max_length=32, batch_size=2, max_train_rows=4)
    trainer = quiet_trainer(tmp_path, max_steps=1, callbacks=[ExportHF(tmp_path / "export", serving=False)])
    with pytest.raises(ValueError, match=f"ExportHF's hf/ folder .*{message}"):
        trainer.fit(module, data)
    assert trainer.global_step == 0 and sorted(p.name for p in folder.iterdir()) == before


def test_a_resumed_budgeted_fit_keeps_the_metrics_logged_before_it(tmp_path, tiny_model, text_file):
    """``budgeted_fit`` (the main job's distillation) resumes into the same log folder: the rows logged before the
    resume stay in ``metrics.csv`` (Lightning's CSVLogger deleted them, with a warning, so the report's curves
    started at the resume), and the rows the resumed run logs again are not there twice."""
    import csv
    import warnings

    from swiftkv_distill.recipe import budgeted_fit

    overrides = {
        "model.model": str(tiny_model), "model.num_key_value_layers": 2, "model.kv_init": "published",
        "data.train_files": [str(text_file)], "data.val_files": [str(text_file)], "data.max_length": 16,
        "data.batch_size": 2, "trainer.precision": "32-true", "trainer.log_every_n_steps": 1,
    }  # fmt: skip
    metrics = tmp_path / "logs" / "version_0" / "metrics.csv"

    def train_rows() -> dict[int, str]:
        with metrics.open(newline="") as file:
            rows = [row for row in csv.DictReader(file) if row.get("train/kl")]
        steps = [int(row["step"]) for row in rows]
        assert len(steps) == len(set(steps)), steps  # no step twice
        return {int(row["step"]): row["train/kl"] for row in rows}

    budgeted_fit("smollm2-135m-cpu", tmp_path, steps=3, overrides=overrides, checkpoint_seconds=0)
    first = train_rows()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, summary = budgeted_fit(
            "smollm2-135m-cpu", tmp_path, steps=5, overrides=overrides, checkpoint_seconds=0
        )
    assert summary["resumed"] and summary["global_step"] == 5
    assert not [w for w in caught if "will be deleted" in str(w.message)]
    # 5 steps now, 3 in the checkpoint: the schedule is stretched, and the jump in the learning rate is told
    told = [m for w in caught if "now spans 5 optimizer steps, the checkpoint's 3" in (m := str(w.message))]
    assert len(told) == 1 and len(set(re.search(r"goes from (\S+) to (\S+)\.", told[0]).groups())) == 2
    both = train_rows()
    assert len(first) == 3 and len(both) == 5 and {s: both[s] for s in first} == first


class RecordingCheckpoint(ModelCheckpoint):
    """The project's checkpoint, recording the batches done at each save (``saved_after``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.saved_after = []

    def _save_checkpoint(self, trainer, filepath):
        self.saved_after.append(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
        super()._save_checkpoint(trainer, filepath)


def test_a_checkpoint_by_time_is_never_saved_inside_an_accumulation_window(tmp_path, tiny_model, text_file):
    """Saved by time, a checkpoint may fall on any batch; inside a window of accumulated batches it would count them
    as done, and the resumed run would skip them untrained. Ours waits for the window's optimizer step. The hour
    of its interval is made to have passed at the 3rd batch, the middle of the 2nd window of 2."""
    import time
    from datetime import timedelta

    hourly = RecordingCheckpoint(
        dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0, train_time_interval=timedelta(hours=1)
    )

    class AnHourPasses(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.fit_loop.epoch_loop.batch_progress.current.processed == 3:
                hourly._last_time_checked = time.monotonic() - 7200

    fit(
        tiny_model,
        text_file,
        tmp_path,
        max_steps=3,
        extra_callbacks=[AnHourPasses(), hourly],
        accumulate_grad_batches=2,
    )
    assert hourly.saved_after == [4], (
        hourly.saved_after
    )  # at the 2nd window's end (Lightning's: [3], mid-window)


@pytest.mark.parametrize("stop_after, saved", [(3, []), (4, [4])])
def test_a_stop_inside_an_accumulation_window_saves_no_last_checkpoint(
    stop_after, saved, tmp_path, tiny_model, text_file
):
    """trainer.max_time's Timer stops a run at any batch; Lightning then writes the last checkpoint of a run that
    saved none, which would count the window's untrained batches as done. Stopped at the 3rd batch (the middle of
    the 2nd window of 2), ours writes none; stopped at the 4th (a window's end), it does."""

    class TimeIsUp(L.Callback):  # as the Timer does
        def on_train_batch_end(self, trainer, *args):
            if trainer.fit_loop.epoch_loop.batch_progress.current.processed == stop_after:
                trainer.should_stop = True

    last = RecordingCheckpoint(dirpath=tmp_path / "last", save_last=True, save_top_k=0)
    fit(
        tiny_model,
        text_file,
        tmp_path,
        max_steps=10,
        extra_callbacks=[TimeIsUp(), last],
        accumulate_grad_batches=2,
    )
    assert last.saved_after == saved
