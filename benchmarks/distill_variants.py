"""Recipe variants of the SmolLM2 l=15 distillation at EQUAL WALL TIME (or equal steps), from the same weights.

How the CPU recipe's settings were chosen: the model is converted and its K/V fitted by least squares once, then
each variant trains from those same weights for ``--seconds`` of wall time (warm-up + cosine over that time, as
the recipe's ``schedule_seconds``) and is measured on the same held-out Brown rows as the real run. Short runs on
a shared CPU: differences below about half a point of agreement are noise.

    flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/distill_variants.py \\
        --seconds 240 --variants "lr=1e-3" "lr=1e-3,position_fraction=0.5" "lr=1e-3,position_fraction=0.25"

A variant sets any of the keys of ``DEFAULTS``: ``q_lr_scale`` multiplies the learning rate of the query
projections (k/v keep ``lr``), ``hard_weight`` adds the hard-label term (loss.py), ``steps`` > 0 budgets the
variant in optimizer steps instead of seconds (the schedule then runs over steps: a GPU can replay the CPU run's
step count in seconds, ``--device cuda``). ``--heldout-rows 0`` also measures on every held-out row (948 rows,
243k tokens: a figure about 5x tighter than the 40 rows of the real run). Writes
``benchmarks/results/distill-variants.{json,md}`` (``--tag`` names another pair).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
DEFAULTS = {
    "lr": 1e-3,
    "temperature": 1.0,
    "batch_size": 4,
    "position_fraction": 1.0,
    "q_lr_scale": 1.0,
    "hard_weight": 0.0,
    "min_lr_ratio": 0.1,
    "steps": 0,
}


def parse_variant(text: str) -> dict:
    variant = dict(DEFAULTS)
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in DEFAULTS:
            raise SystemExit(f"unknown variant key {key!r} in {text!r}: use {sorted(DEFAULTS)}")
        variant[key] = type(DEFAULTS[key])(float(value))
    return variant


def train(module, datamodule, variant: dict, seconds: float, device: str, warmup: float = 0.05):
    """AdamW for ``seconds`` of wall time, or ``variant["steps"]`` steps; returns (steps, tokens/s)."""
    from swiftkv_distill.module import warmup_cosine

    datamodule.hparams.batch_size = variant["batch_size"]
    module.hparams.position_fraction = variant["position_fraction"]
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if "q_proj" in n], "scale": variant["q_lr_scale"]},
        {"params": [p for n, p in named if "q_proj" not in n], "scale": 1.0},
    ]
    params = [p for _, p in named]
    optimizer = torch.optim.AdamW(groups, lr=variant["lr"], weight_decay=0.0, betas=(0.9, 0.95))
    budget = variant["steps"]

    def epochs():  # small training sets (e.g. chat answers alone) run out before the budget: go round again
        while True:
            yield from datamodule.train_dataloader()

    loader, steps, tokens, start = epochs(), 0, 0, time.perf_counter()
    while (progress := steps / budget if budget else (time.perf_counter() - start) / seconds) < 1:
        factor = warmup_cosine(progress, warmup, variant["min_lr_ratio"])  # the recipe's schedule
        factor = max(factor, 0.01) if progress < warmup else factor
        for group in optimizer.param_groups:
            group["lr"] = variant["lr"] * group["scale"] * factor
        batch = {k: v.to(device) for k, v in next(loader).items()}
        positions = module.step_positions(batch["input_ids"].shape[1], device, step=steps)
        mask = batch["loss_mask"] if positions is None else batch["loss_mask"][:, positions]
        out = module.step(
            batch,
            1.0 / mask.sum(),
            variant["temperature"],
            0.0,
            1.0,
            512,
            positions=positions,
            hard_label_weight=variant["hard_weight"],
        )
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1
        tokens += batch["input_ids"].numel()
    if device == "cuda":
        torch.cuda.synchronize()
    return steps, tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=240.0)
    parser.add_argument("--variants", nargs="+", default=["lr=1e-3"])
    parser.add_argument("--kv-init", choices=["least_squares", "published"], default="least_squares")
    parser.add_argument("--kv-init-weighting", choices=["attention", "uniform"], default="attention")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (fp32 there too)")
    parser.add_argument(
        "--heldout-rows",
        type=int,
        default=40,
        help="held-out rows measured besides the run's 40 (0: all 948)",
    )
    parser.add_argument("--train-files", nargs="+", default=["recipe:brown_train"], help="training data")
    parser.add_argument(
        "--chat-heldout",
        action="store_true",
        help="also measure on the teacher's answers to held-out chat prompts (recipe:chat_answers_heldout)",
    )
    parser.add_argument("--tag", default="", help="results file suffix: distill-variants<-tag>.{json,md}")
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variants]

    from swiftkv_core.kv_init import fit_kv_projections
    from swiftkv_distill import DistillDataModule, SwiftKVDistillation
    from swiftkv_distill.data import evenly_spaced

    torch.manual_seed(0)
    module = SwiftKVDistillation("default", num_key_value_layers=15)
    module.configure_model()
    module.to(args.device)
    datamodule = DistillDataModule(
        "default",
        args.train_files,
        val_files=["recipe:brown_heldout"],
        max_length=256,
        batch_size=4,
        max_val_rows=args.heldout_rows,
        val_batch_size=8,
    )
    datamodule.build()
    all_rows = datamodule.val_rows
    datamodule.val_rows = evenly_spaced(all_rows, 40)  # the real run's held-out rows (max_val_rows: 40)
    val = datamodule.val_dataloader()
    datamodule.val_rows = all_rows
    val_all = datamodule.val_dataloader() if len(all_rows) > 40 else None
    val_chat = None
    if args.chat_heldout:
        chat = DistillDataModule(
            "default",
            args.train_files,
            val_files=["recipe:chat_answers_heldout"],
            max_length=256,
            val_batch_size=8,
        )
        chat.build()
        val_chat = chat.val_dataloader()

    def measure() -> dict[str, float]:
        metrics = module.evaluate(val)
        if val_all is not None:
            metrics.update({f"{k}_all": v for k, v in module.evaluate(val_all).items()})
        if val_chat is not None:
            metrics.update({f"{k}_chat": v for k, v in module.evaluate(val_chat).items()})
        return metrics

    if args.kv_init == "least_squares":
        rows = datamodule.kv_init_dataloader(32768)
        fit_kv_projections(
            module.swiftkv_model,
            ({k: b[k].to(args.device) for k in ("input_ids", "position_ids")} for b in rows),
            weighting=args.kv_init_weighting,
        )
    start_weights = {k: p.detach().clone() for k, p in module.named_parameters() if p.requires_grad}
    start_metrics = measure()
    print(f"start ({args.kv_init} init): {start_metrics}", flush=True)

    rows = []
    for variant in variants:
        with torch.no_grad():
            for name, param in module.named_parameters():
                if param.requires_grad:
                    param.copy_(start_weights[name])
        steps, tokens_per_s = train(module, datamodule, variant, args.seconds, args.device)
        metrics = measure()
        rows.append({**variant, "steps": steps, "tokens_per_s": tokens_per_s, **metrics})
        print(f"{variant}: {steps} steps, {tokens_per_s:.0f} tokens/s, {metrics}", flush=True)

    device = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"{args.device} ({torch.get_num_threads()} threads)"
    )
    result = {
        "seconds": args.seconds,
        "device": device,
        "kv_init": args.kv_init,
        "start": start_metrics,
        "rows": rows,
        "command": "flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/distill_variants.py --seconds "
        f"{args.seconds:g} --kv-init {args.kv_init} --kv-init-weighting {args.kv_init_weighting} --device "
        f"{args.device} --heldout-rows {args.heldout_rows} --train-files {' '.join(args.train_files)}"
        f"{' --chat-heldout' if args.chat_heldout else ''}{f' --tag {args.tag}' if args.tag else ''} --variants "
        + " ".join(f'"{v}"' for v in args.variants),
    }
    name = f"distill-variants{'-' + args.tag if args.tag else ''}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    wide = val_all is not None
    n_all = f"all {len(all_rows)} rows" if wide else ""
    table = "".join(
        f"| {r['lr']:g} | {r['q_lr_scale']:g} | {r['temperature']:g} | {r['hard_weight']:g} | {r['batch_size']} | "
        f"{r['position_fraction']:g} | {r['min_lr_ratio']:g} | {r['steps']} | {r['tokens_per_s']:.0f} | "
        f"{r['kl']:.4f} | {r['agreement']:.1%} |"
        + (f" {r['kl_all']:.4f} | {r['agreement_all']:.2%} |" if wide else "")
        + (f" {r['kl_chat']:.4f} | {r['agreement_chat']:.2%} |" if val_chat is not None else "")
        + "\n"
        for r in rows
    )
    start_all = (
        f"; on {n_all}: KL {start_metrics['kl_all']:.4f}, agreement {start_metrics['agreement_all']:.2%}"
        if wide
        else ""
    )
    if val_chat is not None:
        start_all += (
            f"; on held-out chat answers: KL {start_metrics['kl_chat']:.4f}, "
            f"agreement {start_metrics['agreement_chat']:.2%}"
        )
    budget = f"{args.seconds:g} s of wall time (or the steps shown, where a variant sets them)"
    (RESULTS / f"{name}.md").write_text(
        f"# Distillation recipe variants from the same weights (SmolLM2-135M-Instruct, l=15, {device})\n\n"
        f"Command: `{result['command']}`\n\n"
        f"Every variant starts from the same weights ({args.kv_init} init: held-out KL {start_metrics['kl']:.4f}, "
        f"agreement {start_metrics['agreement']:.1%} on the real run's 40 rows{start_all}) and trains for "
        f"{budget}.\n\n"
        "| lr | q lr x | T | hard | rows/step | position_fraction | min lr ratio | steps | tokens/s | KL (40 rows) "
        "| agreement (40 rows) |"
        + (f" KL ({n_all}) | agreement ({n_all}) |" if wide else "")
        + (" KL (held-out chat answers) | agreement (chat) |" if val_chat is not None else "")
        + "\n|"
        + "---|" * (11 + 2 * wide + 2 * (val_chat is not None))
        + "\n"
        + table
    )
    print((RESULTS / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
