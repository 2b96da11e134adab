"""benchmarks/prefill.py on a checkpoint of one's own (here a tiny Llama with the real tokenizer): a base model is
converted at half its layers, a SwiftKV one runs at its own l, and the results go to their own folder. Checks what
the figures are made of, never the timings themselves."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from swiftkv_core.convert import convert, save_checkpoint
from swiftkv_core.generation import load
from tests.distill.conftest import tiny_llama

ROOT = Path(__file__).parents[2]


def test_prefill_benchmark_on_a_model_of_ones_own(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("prefill_benchmark", ROOT / "benchmarks" / "prefill.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    monkeypatch.chdir(tmp_path)
    base = tiny_llama(tmp_path / "base", layers=4)
    result = benchmark.main(model=str(base), prompt_lengths=(48,), repeats=1, device="cpu")
    out = tmp_path / "outputs" / "prefill" / "base"
    assert json.loads((out / "prefill.json").read_text()) == result
    assert (out / "prefill.png").is_file() and "base (float32)" in (out / "prefill.md").read_text()
    (row,) = result["rows"]
    assert result["num_key_value_layers"] == 2 and row["prompt_tokens"] == 48 and row["speedup"] > 0
    # the layers >= l of 47 of the 48 prompt tokens are skipped: FlopCounterMode sees what the analytic count says
    assert abs(row["measured_flops_ratio"] / row["analytic_flops_ratio"] - 1) < 0.02
    swift_folder = tmp_path / "swift"
    model, tokenizer = load(str(base))
    save_checkpoint(convert(model, 3), swift_folder, tokenizer=tokenizer)
    result = benchmark.main(
        model=str(swift_folder), prompt_lengths=(48,), repeats=1, device="cpu", out_dir=tmp_path
    )
    assert result["num_key_value_layers"] == 3 and (tmp_path / "prefill.json").is_file()
