"""benchmarks/gpu.py --tiny: the GPU benchmark's every measurement, on a tiny shape on this CPU (on a lent GPU the
same script runs at the Llama-3.1-8B shape). Checks what each figure is made of, never the timings themselves."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from swiftkv_core.flops import ModelShape, memory_aware_bound, prefill_flops_total
from swiftkv_core.shapes import SHAPES

pytestmark = pytest.mark.slow  # the module's fixture runs every measurement (minutes on a CPU)

ROOT = Path(__file__).parents[2]
OURS, WHOLE = "ours, dense mask (sdpa)", "whole teacher + whole student (sdpa)"
AC, CL = " + activation checkpointing", " + compiled layers"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", ROOT / "benchmarks" / "gpu.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    return benchmark


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    benchmark = load_benchmark()
    out = tmp_path_factory.mktemp("gpu") / "gpu-tiny-3.1"  # a dot in the name, as in gpu-llama-3.1-8b
    benchmark.main(  # a bandwidth and a peak as no CPU has in the tables (the memory-aware bound's, MFU's inputs)
        tiny=True,
        out=out,
        activation_checkpointing=True,
        compile_layers=True,
        prefill_compile="default",
        hbm_tbps=0.05,
        peak_tflops=1.0,
    )
    json_path, md_path = out.parent / f"{out.name}.json", out.parent / f"{out.name}.md"
    return json.loads(json_path.read_text()), md_path.read_text()


def test_prefill_rows_hold_both_sides_and_their_bound(tiny_result):
    result, markdown = tiny_result
    # eager, then the whole forward compiled (its logits checked against the eager ones; the batched case only)
    cases = [("eager", "256"), ("eager", "2 x 256"), ("default", "2 x 256")]
    assert [(p["forward"], p["prompt"]) for p in result["prefill"]] == cases
    shape, l = ModelShape.from_config(SimpleNamespace(**SHAPES["tiny"])), result["num_key_value_layers"]
    for p in result["prefill"]:
        batch, length = (2, 256) if " x " in p["prompt"] else (1, 256)
        flops = [
            prefill_flops_total(shape, length, on, attention="causal", batch_size=batch) for on in (None, l)
        ]
        assert p["speedup_x"] == pytest.approx(p["off_s"] / p["on_s"])
        assert p["flops_bound_x"] == pytest.approx(flops[0] / flops[1])
        assert 1 < p["flops_bound_x"] < 2  # l = L/2: at most half the prefill FLOPs saved
        assert p["off_tflops"] == pytest.approx(flops[0] / p["off_s"] / 1e12)
        assert p["on_tflops"] == pytest.approx(flops[1] / p["on_s"] / 1e12)
        # the FLOPs bound less the time the few-row phases need to read their weights (fp32 here, 0.05 TB/s)
        bound = memory_aware_bound(shape, length, l, off_seconds=p["off_s"], bandwidth=0.05e12, element_bytes=4,
                                   batch_size=batch)  # fmt: skip
        assert p["memory_aware_bound_x"] == pytest.approx(bound)
        # equal (to rounding) where every phase is FLOP-bound
        assert 0 < p["memory_aware_bound_x"] <= p["flops_bound_x"] * (1 + 1e-9)
        assert (
            f"| {p['memory_aware_bound_x']:.2f}x | {p['speedup_x'] / p['memory_aware_bound_x']:.0%} |"
            in markdown
        )
        assert f"| {p['prompt']} | {p['forward']} | {1e3 * p['off_s']:.1f} |" in markdown
        if p["forward"] == "eager":
            assert p["logits_error_vs_eager"] is None
        else:  # checked before timing: fp32 on a CPU, so within 1e-3 (relative)
            assert 0 <= p["logits_error_vs_eager"] <= 1e-3
    assert result["decode"]["on_over_off"] == pytest.approx(
        result["decode"]["on_s"] / result["decode"]["off_s"]
    )


def test_kv_bytes_are_what_a_real_cache_holds(tiny_result):
    result, _ = tiny_result
    rows = result["kv_cache"]
    assert {(r["g"], r["cache"]) for r in rows} >= {(None, "fp32"), (1, "fp32"), (2, "fp32"), (2, "fp8")}
    for r in rows:
        assert r["held_bytes_per_token"] == pytest.approx(r["bytes_per_token"])
    # l of L layers hold their own K/V, the L - l others one per group of g; fp8 the same share of fp32's bytes
    # for every g (a quarter, and its scales)
    L, l = result["num_hidden_layers"], result["num_key_value_layers"]
    by = {(r["swiftkv"], r["g"], r["cache"]): r for r in rows}
    for (_, g, cache), r in by.items():
        if cache == "fp32":
            assert r["vs_original"] == pytest.approx((L if g is None else l + (L - l) / g) / L)
    fp8_shares = {
        r["bytes_per_token"] / by[key[:2] + ("fp32",)]["bytes_per_token"]
        for key, r in by.items()
        if key[2] == "fp8"
    }
    assert len(fp8_shares) == 1 and 0.25 < fp8_shares.pop() < 0.5


def test_distillation_step_rows_compare_against_the_whole_teacher_and_student(tiny_result):
    result, markdown = tiny_result
    rows = {(r["setup"], r["frozen"]): r for r in result["distill"]}
    setups = (OURS, OURS + AC, OURS + CL, WHOLE, WHOLE + AC, WHOLE + CL)  # CPU: no flex_attention backward
    assert set(rows) == {(s, f) for s in setups for f in ("fp32", "bf16")}  # teacher weights in fp32, in bf16
    for frozen in ("fp32", "bf16"):
        assert {rows[WHOLE + v, frozen]["speed_vs_whole_x"] for v in ("", AC, CL)} == {1}
    for r in rows.values():
        assert r["tokens_per_s"] == pytest.approx(256 / r["step_s"])  # 2 rows x 128 tokens per step
        assert r["step_tflop"] > 0 and r["mfu"] == pytest.approx(
            r["step_tflop"] / r["step_s"]
        )  # of 1 TFLOP/s
        like = WHOLE + next(
            (v for v in (AC, CL) if r["setup"].endswith(v)), ""
        )  # the same checkpointing, compiling
        assert r["memory_vs_whole_x"] == pytest.approx(r["peak_gib"] / rows[like, r["frozen"]]["peak_gib"])
        assert r["flops_bound_x"] == pytest.approx(rows[like, r["frozen"]]["step_tflop"] / r["step_tflop"])
        # ours runs layers < l once: fewer FLOPs than the whole, whose own bound is 1
        assert r["flops_bound_x"] > 1 if r["setup"].startswith("ours") else r["flops_bound_x"] == 1
    for frozen in ("fp32", "bf16"):
        # both hold the weights, the optimizer state and at least the student's logits (49k vocabulary, fp32)
        whole, ours = rows[WHOLE, frozen]["peak_gib"], rows[OURS, frozen]["peak_gib"]
        assert min(whole, ours) * 2**30 > 256 * 49152 * 4
        assert ours < whole  # chunked logits: never the whole batch's
        for setup in (OURS, WHOLE):  # the recomputed layers keep less; the model FLOPs (MFU's) exclude them
            assert rows[setup + AC, frozen]["peak_gib"] < rows[setup, frozen]["peak_gib"]
            assert rows[setup + AC, frozen]["step_tflop"] == rows[setup, frozen]["step_tflop"]
            # compiled layers: the same model FLOPs, counted on the eager forward (none seen inside a graph)
            assert rows[setup + CL, frozen]["step_tflop"] == rows[setup, frozen]["step_tflop"]
    ours = rows[OURS, "bf16"]
    bound = f"{ours['speed_vs_whole_x']:.2f}x | {ours['flops_bound_x']:.2f}x | "
    assert f"{bound}{ours['speed_vs_whole_x'] / ours['flops_bound_x']:.0%} |" in markdown
    assert "## Distillation step" in markdown and result["command"].startswith("python3 benchmarks/gpu.py")


def test_a_setup_out_of_device_memory_is_a_row_and_the_others_still_run(monkeypatch, tmp_path):
    """A distillation setup that does not fit the device (the whole teacher + student with fp32 frozen weights needs
    more than an 80 GB H100 holds) is a row saying so, not the end of the run: the other setups are measured, their
    ratios to the whole are none, and the page says it. No CPU runs out of device memory: a stand-in raises CUDA's
    error in the whole setup's KL, which ours does not compute with."""
    import torch

    def kl_div(*args, **kwargs):
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 9.00 GiB.\nIf reserved but unallocated"
        )

    monkeypatch.setattr(torch.nn.functional, "kl_div", kl_div)
    out = tmp_path / "gpu-oom"
    result = load_benchmark().main(tiny=True, out=out, parts=["distill"], frozen=["bf16"])
    rows = {r["setup"]: r for r in result["distill"]}
    assert rows[WHOLE] == {"setup": WHOLE, "frozen": "bf16", "speed_vs_whole_x": None, "memory_vs_whole_x": None,
                           "flops_bound_x": None,
                           "out_of_memory": "CUDA out of memory. Tried to allocate 9.00 GiB."}  # fmt: skip
    assert rows[OURS]["tokens_per_s"] > 0 and rows[OURS]["peak_gib"] > 0
    assert rows[OURS]["speed_vs_whole_x"] is None and rows[OURS]["memory_vs_whole_x"] is None
    assert rows[OURS]["flops_bound_x"] is None
    page = (tmp_path / "gpu-oom.md").read_text()
    assert (
        f"| {WHOLE} | bf16 | out of memory | - | - | - | - | - | - | - |" in page
        and f"| {OURS} | bf16 | {rows[OURS]['tokens_per_s']:,.0f} |" in page
    )


def test_each_row_is_written_as_it_is_measured(monkeypatch, tmp_path):
    """Missing distillation data fails before any model is built; a setup that fails (a call killed at its time
    limit, by a stand-in) leaves the parts and the rows before it on disk; so does a compiled prefill, after the eager
    rows and decode."""
    import swiftkv_distill.bench

    def no_data(*args, **kwargs):
        raise RuntimeError("the data went away")

    monkeypatch.setattr(swiftkv_distill.bench, "packed_batches", no_data)
    out = tmp_path / "gpu-parts"
    with pytest.raises(RuntimeError, match="went away"):
        load_benchmark().main(tiny=True, out=out, parts=["kv_cache", "distill"])
    assert not (tmp_path / "gpu-parts.json").exists()  # the KV cache part, first, never ran
    monkeypatch.undo()
    timed, real = [], swiftkv_distill.bench._time_and_peak

    def killed_at_the_second(*args, **kwargs):
        timed.append(1)
        if len(timed) == 2:
            raise RuntimeError("killed at the call's time limit")
        return real(*args, **kwargs)

    monkeypatch.setattr(swiftkv_distill.bench, "_time_and_peak", killed_at_the_second)
    with pytest.raises(RuntimeError, match="killed"):
        load_benchmark().main(tiny=True, out=out, parts=["kv_cache", "distill"], frozen=["bf16"])
    written = json.loads((tmp_path / "gpu-parts.json").read_text())
    assert written["kv_cache"] and [row["setup"] for row in written["distill"]] == [OURS]
    assert f"| {OURS} | bf16 |" in (tmp_path / "gpu-parts.md").read_text()
    # a compiled prefill refused (its logits off the eager ones, by a stand-in) comes after the eager rows and decode
    import swiftkv_core.generation

    def refused(*args, **kwargs):
        raise RuntimeError("the compiled logits differ")

    monkeypatch.setattr(swiftkv_core.generation, "check_compiled_prefill", refused)
    with pytest.raises(RuntimeError, match="logits differ"):
        load_benchmark().main(tiny=True, out=out, parts=["prefill", "decode"], prefill_compile="default")
    written = json.loads((tmp_path / "gpu-parts.json").read_text())
    assert written["decode"] and {row["forward"] for row in written["prefill"]} == {"eager"}


def test_bad_sizes_are_refused_and_a_partial_run_keeps_the_full_results(monkeypatch, tmp_path):
    """A row that does not split into its documents is refused before any model is built (it failed after the
    first setup's timings), as are sizes given beside --tiny (they were dropped). A run of some parts, or on a
    CPU, writes beside the full GPU results by default, never over them."""
    benchmark = load_benchmark()
    with pytest.raises(SystemExit, match="does not split into --distill_segments 3"):
        benchmark.main(device="cpu", parts=["distill"], distill_row_tokens=4096, distill_segments=3)
    with pytest.raises(SystemExit, match="--tiny sets its own sizes: drop --shape --prefill_lengths"):
        benchmark.main(tiny=True, shape="qwen2.5-7b", prefill_lengths=[512])
    monkeypatch.setattr(benchmark, "RESULTS", tmp_path)
    benchmark.main(tiny=True, parts=["kv_cache"])
    assert [p.name for p in sorted(tmp_path.iterdir())] == [
        "gpu-tiny-kv_cache-cpu.json",
        "gpu-tiny-kv_cache-cpu.md",
    ]
    # the full results of each device, and beside them a shallower model's or other prompt lengths'
    name = benchmark._name_parts
    assert name("llama-3.1-8b", list(benchmark.PARTS), 32, [2048, 8192, 32768], "cuda", "NVIDIA H100 80GB HBM3") == [
        "llama-3.1-8b", "h100-80gb-hbm3",
    ]  # fmt: skip
    assert name("llama-3.1-8b", ["prefill"], 4, [2048], "cuda", "NVIDIA H200") == [
        "llama-3.1-8b", "prefill", "4layers", "2048", "h200",
    ]  # fmt: skip
