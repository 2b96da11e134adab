"""The real distillation: SmolLM2-135M-Instruct at the recipe's l (20 of 30), ~20 min on a 2-core CPU.

Runs ``swiftkv-distill fit --config configs/distill/smollm2-135m-cpu.yaml`` (in process, timed end to end:
model load, data preparation, the evaluation before distillation, training, the final evaluation, the exports),
then copies the run's summary and plot to ``benchmarks/results/distill-smollm2.{json,png,md}``.

    .venv/bin/python benchmarks/distill_smollm2.py [--overrides '[--trainer.max_time, ...]']
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
CONFIG = "smollm2-135m-cpu"  # a shipped recipe (swiftkv_distill/recipes/)
RESULTS = ROOT / "benchmarks" / "results"


def main(overrides: list[str] | None = None) -> None:
    """Run the CPU recipe end to end and write its results.

    Args:
        overrides: extra ``swiftkv-distill fit`` arguments, e.g. ``["--trainer.max_time", "00:00:05:00"]``.
    """
    from swiftkv_distill.recipe import make_cli

    overrides = list(overrides or [])
    start = time.perf_counter()
    cli = make_cli(["fit", "--config", CONFIG, *overrides])
    wall = time.perf_counter() - start
    log_dir = Path(cli.trainer.loggers[0].log_dir)
    summary = json.loads((log_dir / "summary.json").read_text())
    before, init, after = summary["before"], summary.get("init", {}), summary["after"]
    kv_init = summary.get("kv_init", {})
    command = ".venv/bin/python benchmarks/distill_smollm2.py" + (
        f" --overrides '{json.dumps(overrides)}'" if overrides else ""
    )
    result = {
        "model": "SmolLM2-135M-Instruct",
        "num_key_value_layers": cli.model.hparams.num_key_value_layers,
        "num_hidden_layers": cli.model.model_config.num_hidden_layers,
        "held_out": "Brown corpus: every 5th file of each genre (never trained on), 40 packed 256-token rows "
        "spread evenly over all 948",
        "converted_not_distilled": before,
        "least_squares_kv_init_not_distilled": init,
        "kv_init_fit": kv_init,
        "distilled": after,
        "kl_reduction_factor": before["kl"] / after["kl"],
        "wall_seconds_total": wall,
        "fit_seconds": summary["fit_seconds"],
        "train_tokens": summary["train_tokens"],
        "train_tokens_per_s": summary["train_tokens_per_s"],
        "global_step": summary["global_step"],
        "hparams": summary["hparams"],
        "config": CONFIG,
        "command": command,
        "log_dir": str(log_dir),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "distill-smollm2.json").write_text(json.dumps(result, indent=2))
    if (log_dir / "metrics.png").is_file():
        shutil.copy(log_dir / "metrics.png", RESULTS / "distill-smollm2.png")
    goal_agree, goal_kl = after["agreement"] >= 0.80, result["kl_reduction_factor"] >= 3
    rows = [("(a) converted (published init), not distilled", before)]
    if init:
        rows.append(("(a') + least-squares K/V init, no gradient step", init))
    rows.append(("(b) distilled", after))
    nan = float("nan")
    table = "".join(
        f"| {name} | {m['kl']:.3f} | {m['agreement']:.1%} | {m.get('student_ppl', nan):.1f} | "
        f"{m.get('teacher_ppl', nan):.1f} |\n"
        for name, m in rows
    )
    fit_line = (
        f"Least-squares K/V init (swiftkv_core/kv_init.py): {int(kv_init['tokens'])} training tokens, "
        f"{kv_init['seconds']:.0f} s; fraction of the teacher's K/V energy reproduced per layer: "
        f"{kv_init['explained_mean']:.3f} on average, {kv_init['explained_min']:.3f} at worst.\n\n"
        if kv_init
        else ""
    )
    (RESULTS / "distill-smollm2.md").write_text(
        f"# SwiftKV distillation of SmolLM2-135M-Instruct, l={result['num_key_value_layers']} of "
        f"{result['num_hidden_layers']}, on a 2-core CPU\n\n"
        f"Command: `{command}` (config `{CONFIG}`).\n\n"
        f"Wall time, everything included: {wall / 60:.1f} min; training {summary['global_step']} steps, "
        f"{summary['train_tokens']} tokens, {summary['train_tokens_per_s']:.0f} tokens/s over the training steps.\n\n"
        "Held-out: Brown-corpus files never trained on (every 5th file of each genre), packed 256-token rows: 40 rows (10k\n"
        "tokens) spread evenly over all 948.\n\n"
        "| model | KL to teacher (nats/token) | top-1 agreement | student ppl | teacher ppl |\n|---|---|---|---|---|\n"
        + table
        + f"\nKL reduced {result['kl_reduction_factor']:.2f}x from (a) (goal >= 3x: {'met' if goal_kl else 'not met'}); "
        f"agreement {after['agreement']:.1%} (goal >= 80%: {'met' if goal_agree else 'not met'}).\n\n"
        + fit_line
        + "Plot: `distill-smollm2.png` (training KL/agreement per step, validation; the undistilled model and the "
        "least-squares init dashed).\n"
    )
    print((RESULTS / "distill-smollm2.md").read_text())


if __name__ == "__main__":
    from jsonargparse import auto_cli

    auto_cli(main, as_positional=False)
