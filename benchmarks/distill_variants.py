"""Recipe variants of the SmolLM2 l=15 distillation at EQUAL WALL TIME, from the same starting weights.

How the CPU recipe's settings were chosen: the model is converted and its K/V fitted by least squares once, then
each variant trains from those same weights for ``--seconds`` of wall time (warm-up + cosine over that time, as
the recipe's ``schedule_seconds``) and is measured on the same held-out Brown rows as the real run. Short runs on
a shared CPU: differences below about half a point of agreement are noise.

    flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/distill_variants.py \\
        --seconds 240 --variants "lr=1e-3" "lr=1e-3,position_fraction=0.5" "lr=1e-3,position_fraction=0.25"

A variant sets any of: lr, temperature, batch_size, position_fraction. Writes
``benchmarks/results/distill-variants.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
DEFAULTS = {"lr": 1e-3, "temperature": 1.0, "batch_size": 4, "position_fraction": 1.0}


def parse_variant(text: str) -> dict:
    variant = dict(DEFAULTS)
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in DEFAULTS:
            raise SystemExit(f"unknown variant key {key!r} in {text!r}: use {sorted(DEFAULTS)}")
        variant[key] = type(DEFAULTS[key])(float(value))
    return variant


def train(module, datamodule, variant: dict, seconds: float, warmup: float = 0.05, min_ratio: float = 0.1):
    """AdamW for ``seconds`` of wall time; returns (steps, tokens/s)."""
    from swiftkv_distill.module import warmup_cosine

    datamodule.hparams.batch_size = variant["batch_size"]
    module.hparams.position_fraction = variant["position_fraction"]
    params = module.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=variant["lr"], weight_decay=0.0, betas=(0.9, 0.95))
    loader, steps, tokens, start = iter(datamodule.train_dataloader()), 0, 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        factor = warmup_cosine(elapsed / seconds, warmup, min_ratio)  # the recipe's schedule
        factor = max(factor, 0.01) if elapsed / seconds < warmup else factor
        for group in optimizer.param_groups:
            group["lr"] = variant["lr"] * factor
        batch = next(loader)
        positions = module.step_positions(batch["input_ids"].shape[1], "cpu", step=steps)
        mask = batch["loss_mask"] if positions is None else batch["loss_mask"][:, positions]
        out = module.step(batch, 1.0 / mask.sum(), variant["temperature"], 0.0, 1.0, 512, positions=positions)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1
        tokens += batch["input_ids"].numel()
    return steps, tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=240.0)
    parser.add_argument("--variants", nargs="+", default=["lr=1e-3"])
    parser.add_argument("--kv-init", choices=["least_squares", "published"], default="least_squares")
    parser.add_argument("--kv-init-weighting", choices=["attention", "uniform"], default="attention")
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variants]

    from swiftkv_core.kv_init import fit_kv_projections
    from swiftkv_distill import DistillDataModule, SwiftKVDistillation

    torch.manual_seed(0)
    module = SwiftKVDistillation("default", num_key_value_layers=15)
    module.configure_model()
    datamodule = DistillDataModule(
        "default",
        ["recipe:brown_train"],
        val_files=["recipe:brown_heldout"],
        max_length=256,
        batch_size=4,
        max_val_rows=40,
        val_batch_size=8,
    )
    datamodule.build()
    val = datamodule.val_dataloader()
    if args.kv_init == "least_squares":
        rows = datamodule.kv_init_dataloader(32768)
        fit_kv_projections(
            module.swiftkv_model,
            ({k: b[k] for k in ("input_ids", "position_ids")} for b in rows),
            weighting=args.kv_init_weighting,
        )
    start_weights = {k: p.detach().clone() for k, p in module.named_parameters() if p.requires_grad}
    start_metrics = module.evaluate(val)
    print(f"start ({args.kv_init} init): {start_metrics}", flush=True)

    rows = []
    for variant in variants:
        with torch.no_grad():
            for name, param in module.named_parameters():
                if param.requires_grad:
                    param.copy_(start_weights[name])
        steps, tokens_per_s = train(module, datamodule, variant, args.seconds)
        metrics = module.evaluate(val)
        rows.append({**variant, "steps": steps, "tokens_per_s": tokens_per_s, **metrics})
        print(f"{variant}: {steps} steps, {tokens_per_s:.0f} tokens/s, {metrics}", flush=True)

    result = {
        "seconds": args.seconds,
        "kv_init": args.kv_init,
        "start": start_metrics,
        "rows": rows,
        "command": "flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/distill_variants.py --seconds "
        f"{args.seconds:g} --kv-init {args.kv_init} --kv-init-weighting {args.kv_init_weighting} --variants "
        + " ".join(f'"{v}"' for v in args.variants),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "distill-variants.json").write_text(json.dumps(result, indent=2))
    table = "".join(
        f"| {r['lr']:g} | {r['temperature']:g} | {r['batch_size']} | {r['position_fraction']:g} | {r['steps']} | "
        f"{r['tokens_per_s']:.0f} | {r['kl']:.4f} | {r['agreement']:.1%} |\n"
        for r in rows
    )
    (RESULTS / "distill-variants.md").write_text(
        "# Distillation recipe variants at equal wall time (SmolLM2-135M-Instruct, l=15, 2-core CPU)\n\n"
        f"Command: `{result['command']}`\n\n"
        f"Every variant starts from the same weights ({args.kv_init} init: held-out KL {start_metrics['kl']:.4f}, "
        f"agreement {start_metrics['agreement']:.1%}) and trains for {args.seconds:g} s of wall time.\n\n"
        "| lr | T | rows/step | position_fraction | steps | tokens/s | held-out KL | agreement |\n"
        "|---|---|---|---|---|---|---|---|\n" + table
    )
    print((RESULTS / "distill-variants.md").read_text())


if __name__ == "__main__":
    main()
