"""The script behind gpu-llama-3.1-8b-compiled-prefill.md, as run on a lent H200 (2026-11-26, `python3 .gpu/diag.py 260`;
formatted since): how far eager and compiled bf16 logits are from an fp32 copy of the model, then the whole forward compiled
(reduce-overhead) timed against eager, SwiftKV off vs on, with the library calls of benchmarks/gpu.py's prefill rows."""

import copy
import json
import os
import statistics
import sys
import time

import torch

from swiftkv_core.flops import ModelShape, prefill_flops_total
from swiftkv_core.generation import time_prefill_off_on
from swiftkv_core.kv_cache import make_kv_cache
from swiftkv_core.shapes import random_swiftkv_model

DEV = os.environ.get("DEV", "cuda")
t0 = time.time()
model, l = random_swiftkv_model(os.environ.get("SHAPE", "llama-3.1-8b"), None, DEV, torch.bfloat16)
model.eval()
print(
    "params finite:",
    all(torch.isfinite(p).all().item() for p in model.parameters()),
    "max |w|:",
    max(p.abs().max().item() for p in model.parameters()),
    flush=True,
)
ref = copy.deepcopy(model).float()
ids = torch.randint(100, model.config.vocab_size - 100, (1, 2048 if DEV == "cuda" else 64), device=DEV)


def logits(f, m, on, keep=0):
    m.swiftkv(on)
    with torch.inference_mode():
        return f(
            ids, past_key_values=make_kv_cache(m.config, "auto"), use_cache=True, logits_to_keep=keep
        ).logits.float()


def stats(name, a, r):
    d = (a - r).abs()
    cos = torch.nn.functional.cosine_similarity(a.flatten(), r.flatten(), dim=0).item()
    agree = (a.argmax(-1) == r.argmax(-1)).float().mean().item()
    print(
        json.dumps(
            {
                "cmp": name,
                "max_abs_ref": r.abs().max().item(),
                "max_diff": d.max().item(),
                "mean_diff": d.mean().item(),
                "cos": cos,
                "argmax_agree": agree,
            }
        ),
        flush=True,
    )


compiled = {
    m: torch.compile(model, mode=m, dynamic=False, fullgraph=True) for m in ("default", "reduce-overhead")
}
for on in (False, True):
    r = logits(ref, ref, on, 256)
    e = logits(model, model, on, 256)
    stats(f"eager-bf16 vs fp32 on={on}", e, r)
    for mode, f in compiled.items():
        with torch._dynamo.config.patch(recompile_limit=64):
            c = logits(f, model, on, 256)
            c2 = logits(f, model, on, 256)
        stats(f"{mode} vs fp32 on={on}", c, r)
        stats(f"{mode} vs eager on={on}", c, e)
        stats(f"{mode} 2nd call vs eager on={on}", c2, e)
    print("t", time.time() - t0, flush=True)
del ref
torch.cuda.empty_cache()
shape = ModelShape.from_config(model.config)
f = compiled["reduce-overhead"]
for batch, n in ((1, 2048), (1, 8192), (8, 2048)) if DEV == "cuda" else ((1, 64),):
    if time.time() - t0 > float(sys.argv[1]):
        break
    x = torch.randint(100, model.config.vocab_size - 100, (batch, n), device=DEV)
    for name, fwd, warm in (("eager", None, 1), ("reduce-overhead", f, 3)):
        with torch._dynamo.config.patch(recompile_limit=64):
            t = time_prefill_off_on(model, x, 5, warm, fwd)
        med = {k: statistics.median(v) for k, v in t.items()}
        fl = {
            on: prefill_flops_total(shape, n, l if on else None, attention="causal", batch_size=batch)
            for on in (False, True)
        }
        print(
            json.dumps(
                {
                    "prompt": f"{batch} x {n}",
                    "forward": name,
                    "off_ms": 1e3 * med[False],
                    "on_ms": 1e3 * med[True],
                    "speedup": med[False] / med[True],
                    "bound": fl[False] / fl[True],
                    "of_bound": med[False] / med[True] / (fl[False] / fl[True]),
                    "off_tflops": fl[False] / med[False] / 1e12,
                    "on_tflops": fl[True] / med[True] / 1e12,
                }
            ),
            flush=True,
        )
    print("t", time.time() - t0, flush=True)
