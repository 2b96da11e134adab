"""One short distillation probe: the quickstart's distill step from a converted checkpoint, with other data.

What limits the chat agreement of the CPU recipe (issue 12)? Each probe trains, exactly as the quickstart's distill
step does (the recipe's model and data settings, its precision, warm-up + cosine over ``--seconds`` of training,
the real Lightning trainer), from the SAME converted checkpoint (the quickstart's ``converted/``: least-squares K/V
already fitted, so every probe starts from the same weights), on ``--train_files``, and measures the named held-out
sets after training (and before, with ``--before true``). Naming the training chat answers as a validation set
(``chattrain``) tells over-fitting (train >> held-out) from a ceiling (train ~ held-out).

    flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/distill_probe.py --name chat-x3 \\
        --converted runs/SmolLM2-135M-Instruct-l15/converted --seconds 300 \\
        --train_files '[recipe:brown_train, recipe:chat_answers, recipe:chat_answers, recipe:chat_answers]'

Each run adds (or replaces) its row, by ``--name``, in ``benchmarks/results/distill-probes.{json,md}``; the
training logs go to ``--out``. Short runs on a shared CPU: differences under about half a point are noise.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
RECIPE = Path(__file__).parents[1] / "configs" / "distill" / "smollm2-135m-cpu.yaml"
VAL_FILES = {
    "text": ["recipe:brown_heldout"],
    "chat": ["recipe:chat_answers_heldout"],
    "chattrain": ["recipe:chat_answers"],
}


def main(
    name: str,
    converted: Path,
    train_files: list[str],
    seconds: float = 300.0,
    val_files: dict[str, list[str]] | None = None,
    before: bool = False,
    teacher: str = "default",
    out: Path = Path("outputs/distill-probes"),
) -> None:
    """Train the recipe's distillation from ``converted`` on ``train_files`` for ``seconds`` and record the result.

    Args:
        name: the probe's row in the results table (a later run of the same name replaces it).
        converted: a SwiftKV checkpoint to start from (the quickstart's ``converted/`` folder).
        train_files: the training mix (files or recipe:NAME; a file listed k times is sampled k times as often).
        seconds: training wall time (warm-up and cosine span it, as in the quickstart).
        val_files: held-out sets by name (default: text, chat and the training chat answers, ``chattrain``).
        before: also measure ``converted`` itself before the first step.
        teacher: the model that answers recipe:chat_answers* (the base model ``converted`` came from).
        out: folder of the probes' Lightning logs (one sub-folder per name).
    """
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from swiftkv_distill.callbacks import RunReport
    from swiftkv_distill.corpora import resolve_files
    from swiftkv_distill.data import DistillDataModule
    from swiftkv_distill.module import SwiftKVDistillation
    from swiftkv_distill.progress import BudgetProgress
    from swiftkv_distill.quickstart import _recipe, distill_arguments

    if not (Path(converted) / "config.json").is_file():
        raise SystemExit(
            f"--converted {converted}: no checkpoint there; run the quickstart first (its converted/)."
        )
    val_files = val_files or VAL_FILES
    config = json.loads((Path(converted) / "config.json").read_text())  # its l and g, not the recipe's
    l, g = config["num_key_value_layers"], config["key_value_group_size"]
    model_args, data_args, trainer_args = distill_arguments(RECIPE, l, g, seconds)
    # the checkpoint's K/V are already fitted: "published" keeps them as they are
    model_args.update(kv_init="published", evaluate_before_training=before)
    # recipe:chat_answers* are the TEACHER's answers (the default model's), not the converted checkpoint's
    data_args.update(
        train_files=resolve_files(train_files, teacher),
        val_files={k: resolve_files(v, teacher) for k, v in val_files.items()},
    )
    folder = Path(out) / name
    L.seed_everything(_recipe(RECIPE).get("seed_everything", 0), verbose=False)
    module = SwiftKVDistillation(str(converted), **model_args)
    data = DistillDataModule(str(converted), **data_args)
    trainer = L.Trainer(
        **trainer_args,
        max_steps=1_000_000,  # BudgetProgress stops the run
        default_root_dir=folder,
        logger=CSVLogger(folder, name="logs", version=0),
        callbacks=[BudgetProgress(seconds), RunReport()],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        enable_checkpointing=False,
    )
    started = time.perf_counter()
    trainer.fit(module, data)
    summary = json.loads((folder / "logs" / "version_0" / "summary.json").read_text())
    row = {
        "name": name,
        "train_files": train_files,
        "l": l,
        "g": g,
        "seconds": seconds,
        "steps": trainer.global_step,
        "precision": str(trainer.precision),
        "wall_s": round(time.perf_counter() - started),
        # every metric as "<set>/<name>" (the run's summary leaves the first set's unprefixed)
        **{
            when: {
                (k if "/" in k else f"{next(iter(val_files))}/{k}"): v
                for k, v in summary.get(when, {}).items()
            }
            for when in ("before", "after")
        },
        "command": "flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/distill_probe.py "
        f"--name {name} --converted {converted} --seconds {seconds:g} --train_files '{json.dumps(train_files)}'"
        + (f" --val_files '{json.dumps(val_files)}'" if val_files != VAL_FILES else "")
        + (" --before true" if before else ""),
    }
    _record(row)


def _record(row: dict) -> None:
    """Add ``row`` to distill-probes.json (replacing one of the same name) and rewrite distill-probes.md."""
    from swiftkv_core.atomic import atomic_file

    path = RESULTS / "distill-probes.json"
    rows = json.loads(path.read_text()) if path.is_file() else []
    rows = [r for r in rows if r["name"] != row["name"]] + [row]
    with atomic_file(path) as f:
        f.write(json.dumps(rows, indent=2))
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
    with atomic_file(RESULTS / "distill-probes.md") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    from jsonargparse import auto_cli

    auto_cli(main, as_positional=False)
