"""Recipe variants of the SmolLM2 l=15 distillation at EQUAL WALL TIME (or equal steps), from the same weights.

How the CPU recipe's settings were chosen: the model is converted and its K/V fitted by least squares once, then
each variant trains from those same weights for ``--seconds`` of wall time (warm-up + cosine over that time, as
the recipe's ``schedule_seconds``) and is measured on the same held-out Brown rows as the real run. Short runs on
a shared CPU: differences below about half a point of agreement are noise.

    flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/distill_variants.py \\
        --seconds 240 --variants '["lr=1e-3", "lr=1e-3,position_fraction=0.5", "lr=1e-3,position_fraction=0.25"]'

(``--variants+ "lr=1e-3"`` appends one variant.) Each variant trains through the library's own pieces: the
module's ``DistillationStep`` with its ``LossSettings``, ``step_positions`` and the schedule (schedule.py).

A variant sets any of the keys of ``DEFAULTS``: ``q_lr_scale`` multiplies the learning rate of the query
projections (k/v keep ``lr``), ``hard_weight`` adds the hard-label term (loss.py), ``steps`` > 0 budgets the
variant in optimizer steps instead of seconds (the schedule then runs over steps: a GPU can replay the CPU run's
step count in seconds, ``--device cuda``). ``--heldout_rows 0`` also measures on every held-out row (948 rows,
243k tokens: a figure about 5x tighter than the 40 rows of the real run). Writes
``benchmarks/results/distill-variants.{json,md}`` (``--tag`` names another pair).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Literal

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
    from swiftkv_distill.schedule import lr_factor, run_progress

    datamodule.hparams.batch_size = variant["batch_size"]
    module.hparams.position_fraction = variant["position_fraction"]
    module.step.settings = dataclasses.replace(
        module.loss_settings,
        temperature=variant["temperature"],
        hidden_loss_weight=0.0,
        hard_label_weight=variant["hard_weight"],
    )
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
    # the recipe's schedule: over the step budget, or over the wall-time budget (schedule_seconds)
    while (
        progress := run_progress(
            steps, budget or None, time.perf_counter() - start, None if budget else seconds
        )
    ) < 1:
        factor = lr_factor(progress, warmup, variant["min_lr_ratio"])
        for group in optimizer.param_groups:
            group["lr"] = variant["lr"] * group["scale"] * factor
        batch = {k: v.to(device) for k, v in next(loader).items()}
        positions = module.step_positions(batch["input_ids"].shape[1], device, step=steps)
        mask = batch["loss_mask"] if positions is None else batch["loss_mask"][:, positions]
        out = module.step(batch, 1.0 / mask.sum(), positions=positions)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1
        tokens += batch["input_ids"].numel()
    if device == "cuda":
        torch.cuda.synchronize()
    return steps, tokens / (time.perf_counter() - start)


def main(
    seconds: float = 240.0,
    variants: list[str] | None = None,
    kv_init: Literal["least_squares", "published"] = "least_squares",
    kv_init_weighting: Literal["attention", "uniform"] = "attention",
    device: str = "cpu",
    heldout_rows: int = 40,
    train_files: list[str] | None = None,
    chat_heldout: bool = False,
    tag: str = "",
) -> None:
    """Train recipe variants from the same converted (and K/V-fitted) weights and measure each on held-out rows.

    Args:
        seconds: wall-time budget of each variant (unless it sets ``steps``).
        variants: comma-separated ``key=value`` settings per variant (keys of DEFAULTS); default ``["lr=1e-3"]``.
        kv_init: the initial K/V projections: least-squares fit, or the published copy of k/v_proj.
        kv_init_weighting: the least-squares fit's token weighting.
        device: cpu, or cuda (fp32 there too).
        heldout_rows: held-out rows measured besides the run's 40 (0: all 948).
        train_files: training data; default ``["recipe:brown_train"]``.
        chat_heldout: also measure on the teacher's answers to held-out chat prompts (recipe:chat_answers_heldout).
        tag: results file suffix: distill-variants<-tag>.{json,md}.
    """
    variants = variants or ["lr=1e-3"]
    train_files = train_files or ["recipe:brown_train"]
    parsed = [parse_variant(v) for v in variants]

    from swiftkv_core.kv_init import fit_kv_projections
    from swiftkv_distill import DistillDataModule, SwiftKVDistillation
    from swiftkv_distill.data import evenly_spaced

    torch.manual_seed(0)
    module = SwiftKVDistillation("default", num_key_value_layers=15)
    module.configure_model()
    module.to(device)
    datamodule = DistillDataModule(
        "default",
        train_files,
        val_files=["recipe:brown_heldout"],
        max_length=256,
        batch_size=4,
        max_val_rows=heldout_rows,
        val_batch_size=8,
    )
    datamodule.build()
    all_rows = datamodule.val_rows
    datamodule.val_rows = evenly_spaced(all_rows, 40)  # the real run's held-out rows (max_val_rows: 40)
    val = datamodule.val_dataloader()
    datamodule.val_rows = all_rows
    val_all = datamodule.val_dataloader() if len(all_rows) > 40 else None
    val_chat = None
    if chat_heldout:
        chat = DistillDataModule(
            "default",
            train_files,
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

    if kv_init == "least_squares":
        rows = datamodule.kv_init_dataloader(32768)
        fit_kv_projections(
            module.swiftkv_model,
            ({k: b[k].to(device) for k in ("input_ids", "position_ids")} for b in rows),
            weighting=kv_init_weighting,
        )
    start_weights = {k: p.detach().clone() for k, p in module.named_parameters() if p.requires_grad}
    start_metrics = measure()
    print(f"start ({kv_init} init): {start_metrics}", flush=True)

    rows = []
    for variant in parsed:
        with torch.no_grad():
            for name, param in module.named_parameters():
                if param.requires_grad:
                    param.copy_(start_weights[name])
        steps, tokens_per_s = train(module, datamodule, variant, seconds, device)
        metrics = measure()
        rows.append({**variant, "steps": steps, "tokens_per_s": tokens_per_s, **metrics})
        print(f"{variant}: {steps} steps, {tokens_per_s:.0f} tokens/s, {metrics}", flush=True)

    device = (
        torch.cuda.get_device_name() if device == "cuda" else f"{device} ({torch.get_num_threads()} threads)"
    )
    result = {
        "seconds": seconds,
        "device": device,
        "kv_init": kv_init,
        "start": start_metrics,
        "rows": rows,
        "command": "flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/distill_variants.py --seconds "
        f"{seconds:g} --kv_init {kv_init} --kv_init_weighting {kv_init_weighting} --device {device} "
        f"--heldout_rows {heldout_rows} --train_files '{json.dumps(train_files)}'"
        f"{' --chat_heldout true' if chat_heldout else ''}{f' --tag {tag}' if tag else ''} "
        f"--variants '{json.dumps(variants)}'",
    }
    name = f"distill-variants{'-' + tag if tag else ''}"
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
    budget = f"{seconds:g} s of wall time (or the steps shown, where a variant sets them)"
    (RESULTS / f"{name}.md").write_text(
        f"# Distillation recipe variants from the same weights (SmolLM2-135M-Instruct, l=15, {device})\n\n"
        f"Command: `{result['command']}`\n\n"
        f"Every variant starts from the same weights ({kv_init} init: held-out KL {start_metrics['kl']:.4f}, "
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
    from jsonargparse import auto_cli

    auto_cli(main, as_positional=False)
