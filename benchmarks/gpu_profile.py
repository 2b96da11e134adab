"""Where a SwiftKV prefill spends its time on a CUDA GPU, at a real model's shape (random weights built on the
device): the CUDA profile of one prefill with SwiftKV off and on, the host's launch time against the device's, then
the off/on speed-up as is and with each decoder layer compiled (regional ``torch.compile``). Prints; writes nothing
(what it found: ``benchmarks/results/gpu-prefill-profile.md``).

    python3 benchmarks/gpu_profile.py                        # Llama-3.1-8B shape, l = L/2, a 2048-token prompt
    python3 benchmarks/gpu_profile.py --shape qwen2.5-7b --length 8192
"""

from __future__ import annotations

import statistics
import time

import torch

from swiftkv_core.shapes import SHAPES, random_swiftkv_model


def profile_prefill(model, length: int = 2048) -> None:
    """Print the CUDA profile of one ``length``-token prefill, SwiftKV off and on, the host's launch time against
    the device's, then the off/on speed-up with each decoder layer compiled (regional ``torch.compile``)."""
    from torch.profiler import ProfilerActivity, profile

    from swiftkv_core.generation import time_prefill_off_on
    from swiftkv_core.kv_cache import make_kv_cache

    ids = torch.randint(100, model.config.vocab_size - 100, (1, length), device=model.device)

    def forward(on: bool):
        model.swiftkv(on)
        return model(
            ids, past_key_values=make_kv_cache(model.config, "auto"), use_cache=True, logits_to_keep=1
        )

    with torch.inference_mode():
        for on in (False, True):
            forward(on)
            torch.cuda.synchronize()
            started = time.perf_counter()
            forward(on)
            launched = time.perf_counter()
            torch.cuda.synchronize()
            print(f"{length} SwiftKV {'on' if on else 'off'}: host launches {1e3 * (launched - started):.1f} ms, "
                  f"done {1e3 * (time.perf_counter() - started):.1f} ms", flush=True)  # fmt: skip
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                forward(on)
                torch.cuda.synchronize()
            print(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
            )
    # a graph per layer and shape (the cache's update is keyed on the layer's index; with SwiftKV on, layers >= l
    # see the kept row alone), more than dynamo's default of 8 recompiles of the one layer code: below, all but the
    # first 8 layers would run eagerly. Past the limit the run fails rather than time a mix of eager and compiled
    # layers as compiled (the row once published so). Static shapes, as the off side's first graphs: else dynamo
    # makes the kept rows' graphs dynamic in the sequence (its automatic dynamic shapes), and the row would time
    # static graphs off against symbolic ones on
    from torch._dynamo.utils import counters

    recompiles = 3 * len(model.model.layers) + 8
    for compiled in (False, True):
        if compiled:
            for layer in model.model.layers:
                layer.compile(dynamic=False)
        with torch._dynamo.config.patch(
            recompile_limit=max(torch._dynamo.config.recompile_limit, recompiles),
            fail_on_recompile_limit_hit=True,
        ):
            if compiled:
                graphs = counters["stats"]["unique_graphs"]
                time_prefill_off_on(model, ids, 1)  # compiles
                print(f"compiled: {counters['stats']['unique_graphs'] - graphs} graphs", flush=True)
            t = {on: statistics.median(v) for on, v in time_prefill_off_on(model, ids, 7).items()}
        print(f"{length} {'compiled layers' if compiled else 'as is'}: off {1e3 * t[False]:.1f} ms, on "
              f"{1e3 * t[True]:.1f} ms, speed-up {t[False] / t[True]:.3f}", flush=True)  # fmt: skip


def main(shape: str = "llama-3.1-8b", num_key_value_layers: int | None = None, length: int = 2048) -> None:
    """Profile a ``length``-token prefill of the ``shape`` model (one of SHAPES) at l (default L/2), in bf16."""
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_profile.py needs a CUDA GPU (the profile is of CUDA kernels).")
    if shape not in SHAPES:
        raise SystemExit(f"--shape {shape!r}: choose one of {sorted(SHAPES)}.")
    model, _ = random_swiftkv_model(shape, num_key_value_layers, "cuda", torch.bfloat16)
    profile_prefill(model, length)


if __name__ == "__main__":
    from jsonargparse import auto_cli

    auto_cli(main, as_positional=False)
