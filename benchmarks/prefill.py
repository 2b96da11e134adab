"""Prefill latency with SwiftKV on vs the same model with SwiftKV off: SmolLM2-135M-Instruct at l=15 of 30 by
default, or your own checkpoint (a base model, converted at ``--num_key_value_layers``, or a SwiftKV one at its l).

Both sides are the same model object (``model.swiftkv(False)`` is the original forward), measured in one run,
interleaved, median of repeats. A prefill is what ``generate`` runs first: the whole prompt with a KV cache,
logits of the last position only. Also prints measured (FlopCounterMode) vs analytic FLOPs.

    .venv/bin/python benchmarks/prefill.py            # writes benchmarks/results/prefill.{json,md,png}
    python benchmarks/prefill.py --model /models/Llama-3.1-8B-Instruct --prompt_lengths '[2048, 8192]'
        # on the GPU where there is one, in bf16; writes outputs/prefill/Llama-3.1-8B-Instruct/
"""

from __future__ import annotations

import json
import platform
import shlex
import sys
from pathlib import Path

import torch
from jsonargparse import auto_cli

from swiftkv_core.commands import check_weights_fit
from swiftkv_core.convert import convert
from swiftkv_core.flops import ModelShape, count_flops, prefill_flops_total
from swiftkv_core.generation import load, sample_prompt_ids, time_prefill_off_on
from swiftkv_core.runtime import choose_device, choose_dtype, device_description

RESULTS = Path(__file__).parent / "results"


def main(
    model: str = "default",
    num_key_value_layers: int | None = None,
    prompt_lengths: tuple[int, ...] = (512, 2048),
    repeats: int = 5,
    threads: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
    out_dir: Path | None = None,
) -> dict:
    """Measure and print; write JSON, Markdown and a PNG to ``out_dir``.

    Args:
        model: A local HF checkpoint folder (a base model, or a SwiftKV one), or 'default' (SmolLM2-135M-Instruct).
        num_key_value_layers: l for a base model (default: half its layers; 15 of SmolLM2's 30); a SwiftKV
            checkpoint runs at its own.
        prompt_lengths: Prompt lengths in tokens.
        repeats: Timed prefills per side and length (after one warm-up each); the median is reported.
        threads: torch threads (default: torch's choice).
        device: 'auto' (the GPU where one is visible), 'cpu', 'cuda' or 'cuda:N'.
        dtype: 'auto' (bfloat16 on a GPU, float32 on a CPU), 'float32', 'bfloat16' or 'float16'.
        out_dir: Where to write prefill.json, prefill.md and prefill.png (default: benchmarks/results for the
            default model, else outputs/prefill/<model folder name>).
    """
    if threads:
        torch.set_num_threads(threads)
    chosen = choose_device(device)
    chosen_dtype = choose_dtype(dtype, chosen)
    check_weights_fit(model, chosen, chosen_dtype)
    lm, tokenizer = load(model, dtype=chosen_dtype, device=chosen)
    name = "SmolLM2-135M-Instruct" if model == "default" else Path(model).name
    if out_dir is None:
        out_dir = RESULTS if model == "default" else Path("outputs/prefill") / name
    if hasattr(lm, "swiftkv"):
        model, num_key_value_layers = lm, lm.config.num_key_value_layers
    else:
        num_key_value_layers = num_key_value_layers or lm.config.num_hidden_layers // 2
        model = convert(lm, num_key_value_layers)
    shape = ModelShape.from_config(model.config)
    rows = []
    for length in prompt_lengths:
        ids = sample_prompt_ids(tokenizer, length).to(chosen)
        times = time_prefill_off_on(model, ids, repeats)
        median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        with torch.inference_mode():
            measured = {
                k: count_flops(model.swiftkv(k), ids, use_cache=True, logits_to_keep=1)[0] for k in times
            }
        analytic = {
            False: prefill_flops_total(shape, length, None, attention="dense"),
            True: prefill_flops_total(shape, length, num_key_value_layers, attention="dense"),
        }
        row = {
            "prompt_tokens": length,
            "baseline_ms": median[False] * 1e3,
            "swiftkv_ms": median[True] * 1e3,
            "speedup": median[False] / median[True],
            "baseline_ms_all": [t * 1e3 for t in times[False]],
            "swiftkv_ms_all": [t * 1e3 for t in times[True]],
            "measured_gflops": {"baseline": measured[False] / 1e9, "swiftkv": measured[True] / 1e9},
            "analytic_gflops": {"baseline": analytic[False] / 1e9, "swiftkv": analytic[True] / 1e9},
            "measured_flops_ratio": measured[False] / measured[True],
            "analytic_flops_ratio": analytic[False] / analytic[True],
        }
        rows.append(row)
        print(
            f"{length:>5} tokens: SwiftKV off {row['baseline_ms']:8.1f} ms | on {row['swiftkv_ms']:8.1f} ms | "
            f"speedup {row['speedup']:.2f}x | FLOPs ratio measured {row['measured_flops_ratio']:.3f}x, "
            f"analytic {row['analytic_flops_ratio']:.3f}x",
            flush=True,
        )

    where = device_description(chosen) if chosen.type == "cuda" else platform.machine()
    result = {
        "model": f"{name} ({str(chosen_dtype).removeprefix('torch.')})",
        "num_key_value_layers": num_key_value_layers,
        "num_hidden_layers": model.config.num_hidden_layers,
        "torch_threads": torch.get_num_threads(),
        "machine": f"{where}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "command": shlex.join([".venv/bin/python", "benchmarks/prefill.py", *sys.argv[1:]]),
        "rows": rows,
    }
    write_results(result, Path(out_dir))
    return result


def write_results(result: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "prefill.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# Prefill latency: {result['model']}, SwiftKV l={result['num_key_value_layers']}/"
        f"{result['num_hidden_layers']} vs SwiftKV off",
        "",
        f"Command: `{result['command']}` ({result['machine']})",
        "",
        "| prompt tokens | off (ms) | on (ms) | speedup | FLOPs ratio measured | FLOPs ratio analytic |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['prompt_tokens']} | {r['baseline_ms']:.1f} | {r['swiftkv_ms']:.1f} | "
            f"{r['speedup']:.2f}x | {r['measured_flops_ratio']:.3f}x | {r['analytic_flops_ratio']:.3f}x |"
        )
    (out_dir / "prefill.md").write_text("\n".join(lines) + "\n")

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(result["rows"]))
    ax.bar([x - 0.2 for x in xs], [r["baseline_ms"] for r in result["rows"]], 0.4, label="SwiftKV off")
    ax.bar([x + 0.2 for x in xs], [r["swiftkv_ms"] for r in result["rows"]], 0.4, label="SwiftKV on")
    for x, r in zip(xs, result["rows"], strict=False):
        ax.text(x + 0.2, r["swiftkv_ms"], f"{r['speedup']:.2f}x", ha="center", va="bottom")
    ax.set_xticks(list(xs), [f"{r['prompt_tokens']} tokens" for r in result["rows"]])
    ax.set_ylabel("prefill latency (ms, median)")
    ax.set_title(
        f"{result['model']} prefill, l={result['num_key_value_layers']}/{result['num_hidden_layers']}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "prefill.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    auto_cli(main, as_positional=False)
