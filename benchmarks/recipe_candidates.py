"""Distillation recipe candidates in the main job's own budget, from one quickstart run's converted weights.

The quickstart's distill and evaluate stages, once per candidate: every candidate starts from the run's
``converted/`` checkpoint (least-squares K/V already fitted), trains with the run's recipe, training mix and
held-out sets for ``--minutes`` of training (``swiftkv_distill.recipe.budgeted_fit``, the quickstart's path), and is
measured as the quickstart measures: held-out text and chat agreement and KL (teacher-forced), and how often the
first 8 greedy tokens of its answers to the held-out chat prompts equal the teacher's. The run's own distilled
model (Q/K/V only, the published recipe) is the baseline row, measured by that run.

    .venv/bin/swiftkv quickstart --num_key_value_layers 15 --serve false --out runs/l15-qkv
    flock -o /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/recipe_candidates.py --run runs/l15-qkv \\
        --candidates '["lora_rank=16", "lora_rank=64"]' --tag l15

A candidate is ``key=value`` pairs (``swiftkv_distill.recipe.parse_overrides``: ``lora_rank=16``, ``position_fraction=0.25``,
``lr=2e-3``, any ``model.X`` / ``data.X`` recipe key). Writes ``benchmarks/results/recipe-candidates[-TAG].{json,md}``
and a plot of held-out chat agreement against prefill saved: the run's frontier (K/V init alone, per ``l``), its
distilled point and each candidate's.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
GREEDY_TOKENS = 8


def main(
    run: Path,
    candidates: list[str],
    minutes: float | None = None,
    out: Path = Path("outputs/recipe-candidates"),
    tag: str = "",
) -> None:
    """Train each candidate from the run's converted weights and measure it as the quickstart does.

    Args:
        run: a finished quickstart run folder (``--serve false`` is enough): its ``converted/``, recipe, training mix,
            held-out sets and its own distilled result (the baseline).
        candidates: comma-separated ``key=value`` recipe changes per candidate.
        minutes: training minutes per candidate; default: the run's ``--budget_minutes``.
        out: folder of the candidates' logs and checkpoints.
        tag: results file suffix: recipe-candidates<-tag>.{json,md,png}.
    """
    from swiftkv.quickstart.evaluation import greedy_prefix_agreement
    from swiftkv.quickstart.run import Run, quiet
    from swiftkv.quickstart.settings import QuickstartError
    from swiftkv_core.atomic import atomic_write_text
    from swiftkv_distill.data import load_records
    from swiftkv_distill.export import export
    from swiftkv_distill.recipe import budgeted_fit, parse_overrides

    with quiet():  # the quickstart's output: no tips or harmless warnings
        try:
            quickstart = Run.open(run, needs=("teacher_answers", "frontier", "distill", "evaluate"))
        except QuickstartError as error:
            raise SystemExit(f"--run: {error}") from None
        if not (Path(run) / "chat_heldout.jsonl").is_file():
            raise SystemExit(
                f"--run {run}: no held-out chat prompts (chat_heldout.jsonl): run the quickstart with them."
            )
        settings, results, l = quickstart.settings, quickstart.results, quickstart.num_key_value_layers
        try:  # every candidate checked before any training
            parsed = [parse_overrides(c) for c in candidates]
        except ValueError as error:
            raise SystemExit(f"--candidates: {error}") from None
        minutes = minutes or settings.budget_minutes
        val_files = {"text": settings.heldout_text, "chat": [str(run / "chat_heldout.jsonl")]}
        common = {  # the quickstart's distill stage (swiftkv.quickstart.stages.distill)
            "model.model": str(run / "converted"),
            "model.num_key_value_layers": l,
            "model.key_value_group_size": settings.key_value_group_size,
            "data.train_files": results["teacher_answers"]["train_files"],
            "data.val_files": val_files,
            "data.max_val_rows": settings.max_eval_rows,
            "trainer.accelerator": settings.accelerator,
            "trainer.devices": 1,
        }
        rows = [_baseline_row(results)]
        checkpoints = {"converted": run / "converted"}
        for index, (text, overrides) in enumerate(zip(candidates, parsed, strict=True)):
            folder = Path(out) / (tag or "run") / f"candidate-{index}"
            started = time.perf_counter()
            built, summary = budgeted_fit(settings.recipe, folder, minutes * 60, {**common, **overrides})
            export(built.module, folder / "distilled")
            checkpoints[text] = folder / "distilled"
            after = summary["after"]
            rows.append({
                "candidate": text, "steps": summary["global_step"], "tokens_per_s": summary["train_tokens_per_s"],
                "train_minutes": summary["train_seconds"] / 60, "minutes": (time.perf_counter() - started) / 60,
                "chat": after["chat/agreement"], "chat_kl": after["chat/kl"], "text": after["agreement"],
                "text_kl": after["kl"],
            })  # fmt: skip
            print(f"{text}: {rows[-1]}", flush=True)
        prompts = [r["prompt"] for r in load_records([str(run / "chat_heldout.jsonl")])]
        greedy = greedy_prefix_agreement(checkpoints, prompts, tokens=GREEDY_TOKENS)["share"]
        for row in rows[1:]:
            row["greedy"] = greedy[row["candidate"]]
        result = {
            "run": str(run), "l": l, "g": settings.key_value_group_size, "minutes": minutes,
            "greedy_prompts": len(prompts), "converted_greedy": greedy["converted"], "rows": rows,
            "frontier": results["frontier"]["rows"],
            "command": shlex.join([".venv/bin/python", "benchmarks/recipe_candidates.py", *sys.argv[1:]]),
        }  # fmt: skip
        name = f"recipe-candidates{'-' + tag if tag else ''}"
        atomic_write_text(RESULTS / f"{name}.json", json.dumps(result, indent=2))
        atomic_write_text(RESULTS / f"{name}.md", markdown(result, f"{name}.png"))
        plot(result, RESULTS / f"{name}.png")
        print(markdown(result, f"{name}.png"))


def _baseline_row(results: dict) -> dict:
    """The run's own distilled model (its recipe as it is), from its state.json."""
    distill, metrics = results["distill"], results["distill"]["metrics"]
    return {
        "candidate": "Q/K/V only (the run's own recipe)", "steps": distill["steps"],
        "tokens_per_s": distill["train_tokens"] / distill["train_seconds"], "train_minutes": distill["train_seconds"] / 60,
        "minutes": None, "chat": metrics["distilled/chat"]["agreement"], "chat_kl": metrics["distilled/chat"]["kl"],
        "text": metrics["distilled/text"]["agreement"], "text_kl": metrics["distilled/text"]["kl"],
        "greedy": results["evaluate"]["greedy_prefix"]["share"]["distilled"],
    }  # fmt: skip


def markdown(result: dict, png: str) -> str:
    l, g = result["l"], result["g"]
    lines = [
        f"# Recipe candidates at l={l}, g={g} (SmolLM2-135M-Instruct, {result['minutes']:g} min of training each)",
        "",
        f"Command: `{result['command']}` (after the quickstart run `{result['run']}`)",
        "",
        "Every candidate starts from the run's converted checkpoint (least-squares K/V init) and trains with the run's "
        "recipe and data for the same minutes; held-out text and chat are the quickstart's (teacher-forced top-1 "
        f"agreement and KL); greedy = share of the {result['greedy_prompts']} held-out chat prompts whose first "
        f"{GREEDY_TOKENS} greedy tokens equal the teacher's (the converted model: {result['converted_greedy']:.1%}). "
        "'minutes' is the candidate's whole wall time (K/V evaluation, training, export).",
        "",
        "| candidate | chat | text | greedy first 8 | chat KL | text KL | steps | tokens/s | minutes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        minutes = (
            f"{r['minutes']:.1f}" if r["minutes"] is not None else f"{r['train_minutes']:.1f} (training)"
        )
        lines.append(
            f"| {r['candidate']} | {r['chat']:.1%} | {r['text']:.1%} | {r['greedy']:.1%} | {r['chat_kl']:.3f} | "
            f"{r['text_kl']:.3f} | {r['steps']} | {r['tokens_per_s']:.0f} | {minutes} |"
        )
    lines += ["", f"![held-out chat agreement against prefill saved]({png})", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Left: held-out chat agreement against the prefill FLOPs bound, the frontier (the K/V init alone, per l) and,
    at the run's l, each candidate's distilled point. Right: each candidate's chat, text and greedy figures against
    the issue's targets (85%, 85%, 40%)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from swiftkv_core.atomic import atomic_file

    frontier, rows = sorted(result["frontier"], key=lambda r: r["l"]), result["rows"]
    bound = {r["l"]: r["flops_bound_x"] for r in frontier}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.3]})
    left.plot([r["flops_bound_x"] for r in frontier], [100 * r["chat"]["agreement"] for r in frontier], "o--",
              color="grey", label="K/V init alone (frontier)")  # fmt: skip
    for r in frontier:
        left.annotate(f"l={r['l']}", (r["flops_bound_x"], 100 * r["chat"]["agreement"]), textcoords="offset points",
                      xytext=(6, -10), fontsize=8, color="grey")  # fmt: skip
    colours = plt.get_cmap("tab10").colors
    for i, r in enumerate(rows):  # side by side around the run's l, so that equal figures stay visible
        x = bound[result["l"]] - 0.012 * (len(rows) - 1) / 2 + 0.012 * i
        left.scatter([x], [100 * r["chat"]], s=45, zorder=3, color=colours[i % 10], label=r["candidate"])
    left.axhline(85, color="tab:red", lw=0.8, ls=":", label="target 85%")
    left.set(xlabel="prefill FLOPs bound, SwiftKV on / off (x)", ylabel="held-out chat agreement with the teacher (%)",
             title=f"distilled at l={result['l']} vs the frontier")  # fmt: skip
    left.grid(alpha=0.3)
    left.legend(fontsize=7, loc="lower left")
    metrics = [
        ("chat", "chat agreement", 85),
        ("text", "text agreement", 85),
        ("greedy", "greedy first 8", 40),
    ]
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        xs = [m + (i - (len(rows) - 1) / 2) * width for m in range(len(metrics))]
        values = [100 * r[key] for key, _, _ in metrics]
        right.bar(xs, values, width, color=colours[i % 10], label=r["candidate"])
        for x, v in zip(xs, values, strict=True):
            right.annotate(
                f"{v:.1f}", (x, v), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=6
            )
    for m, (_, _, target) in enumerate(metrics):
        right.hlines(target, m - 0.45, m + 0.45, color="tab:red", lw=1, ls=":")
    right.set_xticks(range(len(metrics)), [f"{name}\n(target {t}%)" for _, name, t in metrics])
    right.set(ylabel="% (held-out)", title=f"candidates at l={result['l']}, g={result['g']}, "
              f"{result['minutes']:g} min of training each", ylim=(0, 100))  # fmt: skip
    right.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    from jsonargparse import auto_cli

    auto_cli(main, as_positional=False)
