"""AcrossKV's group K/V init: the members' mean K/V vs each member's error weighted by its queries and o_proj.

For one quickstart run's model, training mix and held-out sets, and each ``(l, g)`` asked for: the least-squares
K/V init alone (no gradient step) fitted both ways (``swiftkv_core.kv_init``, ``member_metric`` False / True),
measured as the quickstart's frontier measures it: held-out text and chat top-1 agreement and KL against the teacher.

    flock -o /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/group_kv_init.py --run runs/l15-qkv \\
        --layouts '["15/1", "15/2", "20/2"]'

Writes ``benchmarks/results/group-kv-init.{json,md}``.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def main(run: Path, layouts: list[str]) -> None:
    """Fit and measure the group K/V init both ways for each ``l/g`` of ``layouts``.

    Args:
        run: a quickstart run folder (its model, training mix and held-out sets; its teacher answers stage done).
        layouts: ``"l/g"`` pairs, e.g. ``["15/1", "15/2"]``; ``g`` must divide ``L - l``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftkv.quickstart.frontier import fit_kv_init, held_out_loaders, held_out_metrics
    from swiftkv.quickstart.run import Run, quiet
    from swiftkv.quickstart.settings import QuickstartError
    from swiftkv_core.atomic import atomic_write_text
    from swiftkv_core.configuration import validate_layers
    from swiftkv_core.convert import convert

    with quiet():  # the quickstart's output: no tips or harmless warnings
        try:
            quickstart = Run.open(run, needs=("teacher_answers",))
        except QuickstartError as error:
            raise SystemExit(f"--run: {error}") from None
        path = quickstart.settings.model_identity["path"]
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        pairs = [tuple(int(v) for v in layout.split("/")) for layout in layouts]
        for l, g in pairs:  # every layout checked before any compute
            try:
                validate_layers(base.config.num_hidden_layers, l, g, allow_no_skip=False)
            except ValueError as error:
                raise SystemExit(f"--layouts {l}/{g}: {error}") from None
        tokenizer, loaders, rows = AutoTokenizer.from_pretrained(path), held_out_loaders(quickstart, path), []
        for l, g in pairs:
            for member_metric in (False, True) if g > 1 else (True,):
                started = time.perf_counter()
                model = convert(base, l, g)
                report = fit_kv_init(quickstart, model, tokenizer, member_metric=member_metric)
                rows.append({"l": l, "g": g, "member_metric": member_metric, "explained": report["explained_mean"],
                             **held_out_metrics(model, loaders, quickstart.device), "seconds": time.perf_counter() - started})  # fmt: skip
                print(rows[-1], flush=True)
                del model
        result = {"run": str(run), "rows": rows,
                  "command": shlex.join([".venv/bin/python", "benchmarks/group_kv_init.py", *sys.argv[1:]])}  # fmt: skip
        atomic_write_text(RESULTS / "group-kv-init.json", json.dumps(result, indent=2))
        atomic_write_text(RESULTS / "group-kv-init.md", markdown(result))
        print(markdown(result))


def markdown(result: dict) -> str:
    sets = [name for name in ("text", "chat") if name in result["rows"][0]]
    lines = [
        "# AcrossKV group K/V init: members' mean vs member-weighted (SmolLM2-135M-Instruct, no gradient step)",
        "",
        f"Command: `{result['command']}` (the run `{result['run']}`: its model, training mix and held-out sets)",
        "",
        "The least-squares K/V init alone, fitted to the group members' mean K/V ('mean') or with each member's error "
        "weighted by its queries (keys) and its o_proj (values) ('member-weighted', `swiftkv_core.kv_init`); "
        "held-out top-1 agreement with the teacher (KL). g = 1 has one member: both are the same fit. 'explained': "
        "the share of the members' K/V energy the shared projection reproduces.",
        "",
        "| l | g | group fit | "
        + " | ".join(f"{s} agreement (KL)" for s in sets)
        + " | explained | seconds |",
        "|---|---|---|" + "---|" * len(sets) + "---|---|",
    ]
    for r in result["rows"]:
        fit = "one member" if r["g"] == 1 else ("member-weighted" if r["member_metric"] else "mean")
        cells = " | ".join(f"{100 * r[s]['agreement']:.1f}% ({r[s]['kl']:.3f})" for s in sets)
        lines.append(f"| {r['l']} | {r['g']} | {fit} | {cells} | {r['explained']:.3f} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from jsonargparse import auto_cli

    auto_cli(main, as_positional=False)
