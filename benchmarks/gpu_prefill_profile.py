"""Where a short prefill loses its share of the FLOPs bound on a GPU: the CUDA profile of one 2k-token prefill with
SwiftKV off and on (Llama-3.1-8B shape, random bf16 weights, l = L/2), the host's launch time against the device's,
and two candidate fixes measured against the same run's baseline: one GEMM for all layers' K/V projections, and
regional ``torch.compile`` of the decoder layers.

    python3 benchmarks/gpu_prefill_profile.py | tee benchmarks/results/gpu-prefill-profile.log
"""

from __future__ import annotations

import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu import build  # noqa: E402

from swiftkv_core.flops import ModelShape, prefill_flops_total  # noqa: E402
from swiftkv_core.generation import time_prefill_off_on  # noqa: E402
from swiftkv_core.kv_cache import make_kv_cache  # noqa: E402
from swiftkv_core.modeling import _rope  # noqa: E402


def report(model, label: str, lengths=(2048, 8192)) -> None:
    shape, l = ModelShape.from_config(model.config), model.config.num_key_value_layers
    for n in lengths:
        ids = torch.randint(100, model.config.vocab_size - 100, (1, n), device="cuda")
        t = {on: statistics.median(v) for on, v in time_prefill_off_on(model, ids, 7).items()}
        bound = prefill_flops_total(shape, n, None, attention="causal") / prefill_flops_total(
            shape, n, l, attention="causal"
        )
        print(f"{n} {label}: off {t[False] * 1e3:.1f} ms, on {t[True] * 1e3:.1f} ms, speed-up "
              f"{t[False] / t[True]:.3f}, bound {bound:.3f} ({t[False] / t[True] / bound:.0%})", flush=True)  # fmt: skip


def fused_key_values(model):
    """swiftkv_key_values with one GEMM for every group leader's K and V (the same numbers)."""
    leaders = list(model.config.kv_group_leaders)
    attention = [model.model.layers[j].self_attn for j in leaders]
    weight = torch.cat(
        [w for a in attention for w in (a.k_proj_swiftkv.weight, a.v_proj_swiftkv.weight)]
    ).detach()
    head_dim = attention[0].head_dim

    def swiftkv_key_values(self, hidden, position_embeddings, past_key_values=None):
        x = self.norm_swiftkv(hidden)
        parts = torch.nn.functional.linear(x, weight).split(weight.shape[0] // (2 * len(leaders)), dim=-1)
        key_values = {}
        for i, j in enumerate(leaders):
            shape = (*x.shape[:-1], -1, head_dim)
            key = _rope(parts[2 * i].view(shape).transpose(1, 2), position_embeddings)
            value = parts[2 * i + 1].view(shape).transpose(1, 2)
            if past_key_values is not None:
                key, value = past_key_values.update(key, value, self.config.kv_cache_index(j, swiftkv=True))
            key_values[j] = (key, value)
        return key_values

    return types.MethodType(swiftkv_key_values, model.model)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_prefill_profile.py needs a CUDA GPU.")
    model, _ = build("llama-3.1-8b", None, "cuda", torch.bfloat16)
    report(model, "as is")
    ids = torch.randint(100, model.config.vocab_size - 100, (1, 2048), device="cuda")

    def forward(on: bool):
        model.swiftkv(on)
        return model(
            ids, past_key_values=make_kv_cache(model.config, "auto"), use_cache=True, logits_to_keep=1
        )

    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        for on in (False, True):
            forward(on)
            torch.cuda.synchronize()
            started = time.perf_counter()
            forward(on)
            launched = time.perf_counter()
            torch.cuda.synchronize()
            print(f"2048 SwiftKV {'on' if on else 'off'}: host launches {1e3 * (launched - started):.1f} ms, "
                  f"done {1e3 * (time.perf_counter() - started):.1f} ms", flush=True)  # fmt: skip
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                forward(on)
                torch.cuda.synchronize()
            print(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
            )
        reference = forward(True).logits
        model.model.swiftkv_key_values = fused_key_values(model)
        print("one K/V GEMM: max logit difference", (reference - forward(True).logits).abs().max().item())
    report(model, "one K/V GEMM")
    del model.model.swiftkv_key_values
    for layer in model.model.layers:
        layer.compile()
    report(model, "compiled layers")


if __name__ == "__main__":
    main()
