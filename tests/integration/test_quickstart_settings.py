"""The main job's settings: bad input refused before any compute, a run continued only with the same inputs, and
an earlier run opened read-only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import use_data_cache
from tests.integration.test_quickstart import make_inputs, run_quickstart
from tests.processes import readline


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("quickstart-settings"))


@pytest.fixture(autouse=True)
def own_data_cache(tmp_path, monkeypatch):
    """Nothing here should reach the data, but should it, never the user's cache."""
    use_data_cache(monkeypatch, tmp_path / "data-cache")


def test_bad_input_fails_before_any_compute(inputs, tmp_path, monkeypatch):
    from swiftkv.quickstart import QuickstartError

    monkeypatch.chdir(tmp_path)  # the main job needs nothing of the repository's folder

    cases = [
        (dict(model=str(tmp_path / "missing")), "does not exist"),
        (dict(num_key_value_layers=8), r"\[1, 7\]"),
        (dict(key_value_group_size=3), "must divide"),
        (
            dict(num_key_value_layers=None, key_value_group_size=3),
            "l was not given: 4 is the default.*must divide",
        ),
        (dict(budget_minutes=0.0), "too small to run one distillation step"),
        (dict(serve_workloads=["2000"]), "PROMPT/OUTPUT"),
    ]
    for overrides, message in cases:
        with pytest.raises(QuickstartError, match=message):
            run_quickstart(inputs, tmp_path / "never", **overrides)
        assert not (tmp_path / "never").exists()
    config = json.loads((Path(inputs["model"]) / "config.json").read_text())
    gemma = tmp_path / "gemma"
    gemma.mkdir()
    (gemma / "config.json").write_text(json.dumps({**config, "model_type": "gemma3_text"}))
    with pytest.raises(QuickstartError, match="not supported.*llama"):
        run_quickstart(inputs, tmp_path / "never", model=str(gemma))
    other = tmp_path / "other"
    other.mkdir()
    (other / "state.json").write_text(
        json.dumps({"settings": {"model": "x", "model_identity": {"path": "x"}}, "results": {}})
    )
    with pytest.raises(QuickstartError, match="another model"):
        run_quickstart(inputs, other)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("not a run")
    for force in (False, True):
        with pytest.raises(QuickstartError, match="not a quickstart run"):
            run_quickstart(inputs, mine, force=force)
    assert (mine / "thesis.tex").read_text() == "not a run"  # --force deletes only quickstart runs


def test_a_run_whose_inputs_changed_is_not_continued(inputs, tmp_path):
    """An edited data file, or the model trained again in place, keep their names (and the files their sizes):
    rerunning the same command must not continue the earlier run with its stale stages. The same bytes written
    again, and a run an earlier version wrote (no digests), continue. Nothing is computed."""
    import shutil

    from safetensors.torch import load_file, save_file

    from swiftkv.quickstart.run import Run
    from swiftkv.quickstart.settings import QuickstartError, check

    train, model = tmp_path / "train.jsonl", tmp_path / "model"
    shutil.copy(inputs["train"], train)
    shutil.copytree(inputs["model"], model)
    arguments = dict(
        model=str(model), out=tmp_path / "run", accelerator="cpu", num_key_value_layers=4, key_value_group_size=2,
        budget_minutes=0.05, recipe=None, train_files=[str(train)], heldout_text=[inputs["heldout"]],
        heldout_chat_prompts="", max_eval_rows=4, prompt_lengths=[64], serve=False, serve_workloads=None,
        serve_requests=2, serve_compile=False, threshold=0.9,
    )  # fmt: skip
    settings, out = check(**arguments)
    Run(out, settings, force=False)
    written = json.loads((out / "state.json").read_text())
    for path in (train, model / "model.safetensors"):
        path.write_bytes(path.read_bytes())  # the same bytes written again: a new modification time
    Run(out, check(**arguments)[0], force=False)  # the same inputs: the run continues, its state as it was
    assert json.loads((out / "state.json").read_text()) == written

    state = json.loads((out / "state.json").read_text())  # as an earlier version wrote it
    identity = state["settings"]["model_identity"]
    identity["weight_sizes"] = {name: f["bytes"] for name, f in identity.pop("weight_files").items()}
    del state["settings"]["input_files"]
    (out / "state.json").write_text(json.dumps(state))
    Run(out, check(**arguments)[0], force=False)  # continued, and written in today's terms
    assert json.loads((out / "state.json").read_text()) == written

    train.write_text(train.read_text().replace("the", "teh", 1))  # edited: the same size
    with pytest.raises(QuickstartError, match="other settings \\(input_files"):
        Run(out, check(**arguments)[0], force=False)
    settings, out = check(**arguments | {"out": tmp_path / "run2"})
    Run(out, settings, force=False)
    weights = load_file(model / "model.safetensors")
    save_file({name: w + 1e-3 for name, w in weights.items()}, model / "model.safetensors")  # trained again
    with pytest.raises(QuickstartError, match="as it was before its files changed"):
        Run(out, check(**arguments | {"out": tmp_path / "run2"})[0], force=False)


def test_an_earlier_run_opens_read_only_with_its_finished_stages(tmp_path):
    """Run.open: what benchmarks build on (recipe_candidates.py, group_kv_init.py): settings and results as the run
    left them, nothing written; a folder that is no run, or a run short of a needed stage, says so."""
    from dataclasses import asdict

    from swiftkv.quickstart.run import Run
    from swiftkv.quickstart.settings import QuickstartError, Settings

    settings = Settings(
        model="m", accelerator="cpu", num_key_value_layers="auto", key_value_group_size=1, budget_minutes=1.0,
        recipe="smollm2-135m-cpu", train_files=[], heldout_text=[], heldout_chat_prompts="", max_eval_rows=1,
        prompt_lengths=[256], serve=False, serve_workloads=[], serve_requests=1, serve_compile=False, threshold=0.9,
    )  # fmt: skip
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"settings": asdict(settings), "results": {"frontier": {"chosen": 17}}}))
    before = state.stat().st_mtime_ns
    run = Run.open(tmp_path, needs=("frontier",))
    assert run.settings == settings and run.num_key_value_layers == 17 and run.root == tmp_path
    assert state.stat().st_mtime_ns == before
    with pytest.raises(QuickstartError, match=r"not finished its stages \['distill'\]"):
        Run.open(tmp_path, needs=("frontier", "distill"))
    with pytest.raises(QuickstartError, match="no state.json"):
        Run.open(tmp_path / "elsewhere")


def test_a_second_run_in_a_folder_a_run_is_writing_is_refused(inputs, tmp_path):
    """Two quickstarts in one folder would redo the same stages into the same files (and a --force would delete
    them under the other): while a real other process holds the folder's run, a second one is refused, untouched."""
    import subprocess
    import sys

    from swiftkv.quickstart import QuickstartError

    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from swiftkv_core.atomic import exclusive\n"
         "with exclusive(sys.argv[1]):\n    print('held', flush=True); time.sleep(120)", str(out)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert readline(holder.stdout).strip() == "held"
        for force in (False, True):
            with pytest.raises(QuickstartError, match="another swiftkv quickstart is running in this folder"):
                run_quickstart(inputs, out, serve=False, force=force)
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_setting_one_stage_alone_reads_reruns_that_stage_and_keeps_the_rest(inputs, tmp_path):
    """A serving workload too long for the machine, found at the serving stage 40 minutes in: the rerun with another
    one runs the serving stage and the report again and keeps every other finished stage. A setting earlier stages
    read is still refused, and a run written before a setting existed continues with its default."""
    from swiftkv.quickstart.run import Run
    from swiftkv.quickstart.settings import QuickstartError, check
    from swiftkv.quickstart.stages import STAGES

    arguments = dict(
        model=inputs["model"], out=tmp_path / "run", accelerator="cpu", num_key_value_layers=4, key_value_group_size=2,
        budget_minutes=0.05, recipe=None, train_files=[inputs["train"]], heldout_text=[inputs["heldout"]],
        heldout_chat_prompts="", max_eval_rows=4, prompt_lengths=[64], serve=False, serve_workloads=["96/8"],
        serve_requests=2, serve_compile=False, threshold=0.9,
    )  # fmt: skip
    settings, out = check(**arguments)
    run = Run(out, settings, force=False)
    run.results = {stage.name: {"seconds": 1.0} for stage in STAGES}  # as a finished run
    run._save()
    rerun = Run(out, check(**arguments | {"serve_workloads": ["40/2"]})[0], force=False)
    assert set(rerun.results) == {s.name for s in STAGES} - {"serve", "report"}
    assert json.loads((out / "state.json").read_text())["settings"]["serve_workloads"] == ["40/2"]
    with pytest.raises(QuickstartError, match=r"other settings \(budget_minutes: 0.05 -> 0.1\)"):
        Run(out, check(**arguments | {"serve_workloads": ["40/2"], "budget_minutes": 0.1})[0], force=False)
    state = json.loads((out / "state.json").read_text())
    del state["settings"]["min_agreement"]  # as a version before it wrote the run
    (out / "state.json").write_text(json.dumps(state))
    assert "frontier" in Run(out, check(**arguments | {"serve_workloads": ["40/2"]})[0], force=False).results


def test_the_teacher_answers_a_run_trains_on_are_kept_in_the_run(inputs, tmp_path, capsys):
    """The teacher's answers are cached outside the run folder, and sampled: a run continued after the cache was
    cleared (or in a container without its cache volume) would make other answers, and its distillation could not
    resume on them. The stage copies the answers the training reads into the run, which reads them from there."""
    from swiftkv.quickstart.run import Run
    from swiftkv.quickstart.settings import check
    from swiftkv.quickstart.stages import teacher_answers
    from swiftkv_distill.answers import write_jsonl
    from swiftkv_distill.corpora import dataset_path

    arguments = dict(
        model=inputs["model"], out=tmp_path / "run", accelerator="cpu", num_key_value_layers=4, key_value_group_size=2,
        budget_minutes=0.05, recipe=None, train_files=["dataset:chat_answers", inputs["train"]],
        heldout_text=[inputs["heldout"]], heldout_chat_prompts="", max_eval_rows=4, prompt_lengths=[64], serve=False,
        serve_workloads=None, serve_requests=2, serve_compile=False, threshold=0.9,
    )  # fmt: skip
    settings, out = check(**arguments)
    cached = dataset_path("chat_answers", settings.model_identity["path"], "cpu")  # as if answered before
    write_jsonl(cached, [{"prompt": "Where is the harbour?", "answer": "By the old lighthouse."}])
    run = Run(out, settings, force=False)
    files = teacher_answers(run)["train_files"]
    assert files == [str(out / cached.name), inputs["train"]]
    assert (out / cached.name).read_bytes() == cached.read_bytes()
    assert "teacher answers ready in" in capsys.readouterr().out


def test_a_model_shorter_than_every_default_length_is_timed_and_served_within_its_context(inputs, tmp_path):
    """The default prefill lengths (256..4096) and workloads (2000/200, 500/500) that fit the model's context are
    kept; a model whose context none fits is timed at its whole context and served a 10:1 split of it, not given an
    empty table (and a plot of nothing)."""
    import shutil

    from swiftkv.quickstart.settings import check

    short = Path(shutil.copytree(inputs["model"], tmp_path / "short"))
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    arguments = dict(
        out=tmp_path / "run", accelerator="cpu", num_key_value_layers=4, key_value_group_size=2, budget_minutes=0.05,
        recipe=None, train_files=[inputs["train"]], heldout_text=[inputs["heldout"]], heldout_chat_prompts="",
        max_eval_rows=4, prompt_lengths=None, serve=False, serve_workloads=None, serve_requests=2,
        serve_compile=False, threshold=0.9,
    )  # fmt: skip
    settings, _ = check(model=inputs["model"], **arguments)  # its context: 1024
    assert (settings.prompt_lengths, settings.serve_workloads) == ([256, 512, 1024], ["500/500"])
    settings, _ = check(model=str(short), **arguments)
    assert (settings.prompt_lengths, settings.serve_workloads) == ([128], ["116/12"])
