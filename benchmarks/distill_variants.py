"""Recipe variants at EQUAL WALL TIME (or equal steps), from the same converted weights.

How the CPU recipe's settings were chosen: each variant is the recipe with a few settings changed, trained through
the one recipe path (``swiftkv_distill.recipe.budgeted_fit``, the quickstart's own) from the same converted
checkpoint (a quickstart's ``converted/``: least-squares K/V already fitted) for ``--seconds`` of wall time
(warm-up + cosine over that time), or for ``steps`` optimizer steps, and measured on the same held-out rows.

    .venv/bin/python benchmarks/distill_variants.py --converted runs/smollm2-135m-instruct-l15/converted \\
        --seconds 240 --variants '["lr=1e-3", "lr=1e-3,position_fraction=0.5", "lr=1e-3,position_fraction=0.25"]'

A variant is ``key=value`` pairs: a recipe key (``model.temperature=2``, ``data.batch_size=8``), one of the short
names of ``swiftkv_distill.recipe.SHORT_KEYS`` (``lr``, ``temperature``, ``position_fraction``, ``lora_rank``, ...),
or ``steps`` (a budget in optimizer steps instead of seconds: a GPU replays the CPU run's step
count, ``--accelerator gpu``). ``--heldout_rows 0`` measures every held-out row (948 rows of Brown prose at 256
tokens), ``--chat_heldout true`` the teacher's held-out chat answers too. Writes
``benchmarks/results/distill-variants[-TAG].{json,md}``. Short runs on a shared CPU: differences below about half a
point of agreement are noise.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def parse_variant(text: str) -> tuple[dict, int | None]:
    """``"lr=1e-3,steps=200"`` -> ``({"model.learning_rate": 0.001}, 200)``: the recipe overrides and the steps."""
    from swiftkv_distill.recipe import parse_overrides

    try:
        overrides = parse_overrides(text, extra=("steps",))
    except ValueError as error:
        raise SystemExit(f"variant {text!r}: {error}") from None
    steps = overrides.pop("steps", None)
    return overrides, None if steps is None else int(steps)


def main(
    converted: Path,
    variants: list[str] | None = None,
    seconds: float = 240.0,
    heldout_rows: int = 40,
    train_files: list[str] | None = None,
    chat_heldout: bool = False,
    accelerator: str = "cpu",
    recipe: str = "smollm2-135m-cpu",
    out: Path = Path("outputs/distill-variants"),
    tag: str = "",
) -> None:
    """Train recipe variants from the same converted weights and measure each on held-out rows.

    Args:
        converted: the SwiftKV checkpoint every variant starts from (a quickstart's ``converted/`` folder).
        variants: comma-separated ``key=value`` settings per variant; default ``["lr=1e-3"]``.
        seconds: wall-time budget of each variant (unless it sets ``steps``).
        heldout_rows: held-out text rows measured (0: all).
        train_files: training data; default ``["dataset:brown_train"]``.
        chat_heldout: also measure on the teacher's answers to held-out chat prompts.
        accelerator: ``cpu`` or ``gpu`` (Lightning's accelerator).
        recipe: the recipe the variants change (a shipped recipe's name or a YAML path).
        out: folder of the variants' Lightning logs.
        tag: results file suffix: distill-variants<-tag>.{json,md}.
    """
    from swiftkv_core.atomic import atomic_write_text
    from swiftkv_core.checkpoints import CheckpointError, check_checkpoint
    from swiftkv_core.runtime import device_description
    from swiftkv_distill.recipe import budgeted_fit

    variants = variants or ["lr=1e-3"]
    parsed = [parse_variant(v) for v in variants]  # every variant checked before any training
    try:
        _, config = check_checkpoint(converted, kind="swiftkv")
    except CheckpointError as error:
        raise SystemExit(f"--converted: {error}") from None
    val_files = {"text": ["dataset:brown_heldout"]} | (
        {"chat": ["dataset:chat_answers_heldout"]} if chat_heldout else {}
    )
    common = {
        "model.model": str(converted),
        "model.num_key_value_layers": config.num_key_value_layers,
        "model.key_value_group_size": config.key_value_group_size,
        "model.kv_init": "published",  # the checkpoint's K/V are fitted already: every variant starts from them
        "data.train_files": train_files or ["dataset:brown_train"],
        "data.val_files": val_files,
        "data.max_val_rows": heldout_rows,
        "trainer.accelerator": accelerator,
    }
    rows, start = [], None
    for index, (text, (overrides, steps)) in enumerate(zip(variants, parsed, strict=True)):
        run = {**common, **overrides, "model.evaluate_before_training": index == 0}
        built, summary = budgeted_fit(
            recipe, Path(out) / f"variant-{index}", None if steps else seconds, run, steps=steps
        )
        start = start or summary["before"]
        rows.append({"variant": text, "steps": summary["global_step"], "tokens_per_s": summary["train_tokens_per_s"],
                     "precision": str(built.trainer.precision), **summary["after"]})  # fmt: skip
        print(f"{text}: {rows[-1]}", flush=True)
    device = device_description("cuda" if accelerator == "gpu" else "cpu")
    result = {"seconds": seconds, "device": device, "l": config.num_key_value_layers, "start": start, "rows": rows,
              "command": shlex.join([".venv/bin/python", "benchmarks/distill_variants.py", *sys.argv[1:]])}  # fmt: skip
    name = f"distill-variants{'-' + tag if tag else ''}"
    atomic_write_text(RESULTS / f"{name}.json", json.dumps(result, indent=2))
    atomic_write_text(RESULTS / f"{name}.md", markdown(result, chat_heldout))
    print(markdown(result, chat_heldout))


def markdown(result: dict, chat: bool) -> str:
    start = result["start"]
    chat_columns = " KL (held-out chat) | agreement (chat) |" if chat else ""
    lines = [
        f"# Distillation recipe variants from the same weights (l={result['l']}, {result['device']})",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Every variant starts from the same weights (held-out KL {start['kl']:.4f}, agreement "
        f"{start['agreement']:.1%}) and trains for {result['seconds']:g} s of wall time (or the steps it sets).",
        "",
        "| variant | steps | tokens/s | precision | KL | agreement |" + chat_columns,
        "|---|---|---|---|---|---|" + ("---|---|" if chat else ""),
    ]
    for r in result["rows"]:
        cells = f" {r['chat/kl']:.4f} | {r['chat/agreement']:.2%} |" if chat else ""
        lines.append(f"| {r['variant']} | {r['steps']} | {r['tokens_per_s']:.0f} | {r['precision']} | {r['kl']:.4f} | "
                     f"{r['agreement']:.2%} |" + cells)  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from jsonargparse import auto_cli

    auto_cli(main, as_positional=False)
