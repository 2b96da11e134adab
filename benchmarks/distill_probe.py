"""One short distillation probe: the quickstart's distill step from a converted checkpoint, with other data.

What limits the chat agreement of the CPU recipe? Each probe trains, exactly as the quickstart's distill
step does (the recipe's model and data settings, its precision, warm-up + cosine over ``--seconds`` of training,
the real Lightning trainer), from the SAME converted checkpoint (the quickstart's ``converted/``: least-squares K/V
already fitted, so every probe starts from the same weights), on ``--train_files``, and measures the named held-out
sets after training (and before, with ``--before true``). Naming the training chat answers as a validation set
(``chattrain``) tells over-fitting (train >> held-out) from a ceiling (train ~ held-out).

    .venv/bin/python benchmarks/distill_probe.py --name chat-x3 \\
        --converted runs/SmolLM2-135M-Instruct-l15/converted --seconds 300 \\
        --train_files '[dataset:brown_train, dataset:chat_answers, dataset:chat_answers, dataset:chat_answers]'

Each run adds (or replaces) its row, by ``--name``, in ``benchmarks/results/distill-probes.{json,md}``; the
training logs go to ``--out``. Short runs on a shared CPU: differences under about half a point are noise.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
VAL_FILES = {
    "text": ["dataset:brown_heldout"],
    "chat": ["dataset:chat_answers_heldout"],
    "chattrain": ["dataset:chat_answers"],
}


def main(
    name: str,
    converted: Path,
    train_files: list[str],
    seconds: float = 300.0,
    val_files: dict[str, list[str]] | None = None,
    before: bool = False,
    teacher: str = "default",
    recipe: str = "smollm2-135m-cpu",
    out: Path = Path("outputs/distill-probes"),
) -> None:
    """Train the recipe's distillation from ``converted`` on ``train_files`` for ``seconds`` and record the result.

    Args:
        name: the probe's row in the results table (a later run of the same name replaces it).
        converted: a SwiftKV checkpoint to start from (the quickstart's ``converted/`` folder).
        train_files: the training mix (files or dataset:NAME; a file listed k times is sampled k times as often).
        seconds: training wall time (warm-up and cosine span it, as in the quickstart).
        val_files: held-out sets by name (default: text, chat and the training chat answers, ``chattrain``).
        before: also measure ``converted`` itself before the first step.
        teacher: the model that answers dataset:chat_answers* (the base model ``converted`` came from).
        recipe: the distillation recipe (a shipped recipe's name or a YAML path).
        out: folder of the probes' Lightning logs (one sub-folder per name).
    """
    from swiftkv_core.checkpoints import CheckpointError, check_checkpoint
    from swiftkv_distill.corpora import resolve_files
    from swiftkv_distill.recipe import budgeted_fit

    try:
        _, config = check_checkpoint(converted, kind="swiftkv")
    except CheckpointError as error:
        raise SystemExit(f"--converted: {error} (run the quickstart first: its converted/ folder).") from None
    val_files = val_files or VAL_FILES
    l, g = config.num_key_value_layers, config.key_value_group_size  # the checkpoint's, not the recipe's
    overrides = {
        "model.model": str(converted),
        "model.num_key_value_layers": l,
        "model.key_value_group_size": g,
        "model.kv_init": "published",  # the checkpoint's K/V are already fitted: keep them as they are
        "model.evaluate_before_training": before,
        # dataset:chat_answers* are the TEACHER's answers (the base model's), not the converted checkpoint's
        "data.train_files": resolve_files(train_files, teacher),
        "data.val_files": {k: resolve_files(v, teacher) for k, v in val_files.items()},
    }
    started = time.perf_counter()
    built, summary = budgeted_fit(recipe, Path(out) / name, seconds, overrides)
    row = {
        "name": name,
        "train_files": train_files,
        "l": l,
        "g": g,
        "seconds": seconds,
        "steps": summary["global_step"],
        "precision": str(built.trainer.precision),
        "wall_s": round(time.perf_counter() - started),
        # every metric as "<set>/<name>" (the run's summary leaves the first set's unprefixed)
        **{
            when: {
                (k if "/" in k else f"{next(iter(val_files))}/{k}"): v
                for k, v in summary.get(when, {}).items()
            }
            for when in ("before", "after")
        },
        "command": shlex.join([".venv/bin/python", "benchmarks/distill_probe.py", *sys.argv[1:]]),
    }
    _record(row)


def _record(row: dict) -> None:
    """Add ``row`` to distill-probes.json (replacing one of the same name) and rewrite distill-probes.md."""
    from swiftkv_core.atomic import atomic_write_text

    path = RESULTS / "distill-probes.json"
    rows = json.loads(path.read_text()) if path.is_file() else []
    rows = [r for r in rows if r["name"] != row["name"]] + [row]
    atomic_write_text(path, json.dumps(rows, indent=2))
    found = {k.split("/")[0] for r in rows for k in r["after"] if k.endswith("/agreement")}
    sets = sorted(found, key=lambda s: (s != "text", s))  # text first

    def cell(metrics: dict, key: str) -> str:
        return f"{metrics[key]:.1%}" if key in metrics else "-"

    lines = [
        "# Distillation probes (SmolLM2-135M-Instruct): what limits the chat agreement",
        "",
        "Each row trains the CPU recipe from the same converted checkpoint (least-squares K/V) for the seconds "
        "shown, on the mix shown, and measures top-1 agreement with the teacher on held-out prose (`text`), the "
        "teacher's answers to held-out chat prompts (`chat`, answer tokens) and to the TRAINING chat prompts "
        "(`chattrain`); `before -> after`. Written by `benchmarks/distill_probe.py` (see its docstring); each "
        "row's command is below the table. A `--converted` folder is the `converted/` of a quickstart at that l "
        "(`swiftkv quickstart --out DIR --num_key_value_layers L --serve false`, stopped once it starts to "
        "distil). Rows measured at different times on a shared CPU can differ in steps for the same seconds.",
        "",
        "| probe | l | training mix | seconds | steps | " + " | ".join(sets) + " |",
        "|---|---:|---|---:|---:|" + "---|" * len(sets),
    ]
    for r in rows:
        mix = ", ".join(
            f"{Path(f).name} x{r['train_files'].count(f)}" for f in dict.fromkeys(r["train_files"])
        )
        cells = []
        for s in sets:
            key = f"{s}/agreement"
            before = cell(r["before"], key)
            cells.append(f"{before} -> {cell(r['after'], key)}" if before != "-" else cell(r["after"], key))
        shape = f"{r['l']}" + (f"/g{r['g']}" if r["g"] > 1 else "")
        lines.append(
            f"| {r['name']} | {shape} | {mix} | {r['seconds']:g} | {r['steps']} | " + " | ".join(cells) + " |"
        )
    lines += ["", "Commands:", ""] + [f"- {r['name']}: `{r['command']}`" for r in rows]
    atomic_write_text(RESULTS / "distill-probes.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    from jsonargparse import auto_cli

    auto_cli(main, as_positional=False)
