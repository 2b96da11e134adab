"""How many layers can this model give up? The quality/speed frontier of the main job.

For a sweep of ``l`` (every few layers from ``L/2`` to about ``5L/6``, and the run's own), SwiftKV with the
least-squares K/V init alone (no gradient step: the base weights are shared, only the fit runs) is measured on the
held-out text and chat sets, beside each ``l``'s prefill FLOPs bound and KV bytes per token. Distillation then
closes part of what the init leaves: ``predicted_distilled`` says how much, from the runs we measured, and the
report puts the distilled point beside its prediction. With ``--num_key_value_layers auto`` the run takes the
smallest ``l`` whose predicted distilled agreement clears ``--min_agreement``.
"""

from __future__ import annotations

import gc
import random

# The share of the init's remaining disagreement that the CPU recipe's 12 minutes of distillation closed on SmolLM2
# (held-out chat: l=15 72.1% -> 79.4%, l=20 83.8% -> 87.6%: 0.26 and 0.23; benchmarks/results/frontier.md).
GAP_CLOSED = 0.25
PROMPT_TOKENS = 4096  # the prompt length of the FLOPs bound in the table (within the model's context)
SWEEP_POINTS = 3  # l's of the sweep besides the run's own (each costs a K/V fit and two evaluations)


def sweep(num_layers: int, group_size: int, chosen: int | None) -> list[int]:
    """``SWEEP_POINTS`` values of ``l`` evenly from ``L/2`` to about ``5L/6`` (only those ``g`` fits), and
    ``chosen``."""
    top = min(round(5 * num_layers / 6), num_layers - 1)
    valid = [l for l in range(num_layers // 2, top + 1) if (num_layers - l) % group_size == 0]
    if len(valid) > SWEEP_POINTS:
        valid = [valid[round(i * (len(valid) - 1) / (SWEEP_POINTS - 1))] for i in range(SWEEP_POINTS)]
    return sorted(set(valid) | ({chosen} if chosen else set()))


def predicted_distilled(init_agreement: float) -> float:
    """Held-out agreement expected after the recipe's distillation, from the init's: ``GAP_CLOSED`` of the gap."""
    return init_agreement + GAP_CLOSED * (1 - init_agreement)


def choose(rows: list[dict], min_agreement: float) -> tuple[int, str]:
    """The smallest ``l`` whose predicted distilled agreement clears ``min_agreement`` (chat where it was measured,
    else text), and why; the largest ``l`` of the sweep when none does."""
    key = "chat" if all("chat" in r for r in rows) else "text"
    bar = f"{min_agreement:.0%}"
    for row in rows:  # by increasing l: the most prefill saved first
        if row["predicted"][key] >= min_agreement:
            return row["l"], f"the smallest l whose predicted distilled {key} agreement clears {bar}"
    return rows[-1]["l"], f"no l of the sweep is predicted to clear {bar}: the largest, l={rows[-1]['l']}"


def fit_kv_init(run, model, tokenizer, member_metric: bool = True) -> dict:
    """Fit ``model``'s K/V projections by least squares on the run's training mix, with the recipe's settings
    (``member_metric``: see ``swiftkv_core.kv_init``)."""
    from swiftkv_core.kv_init import fit_kv_projections, text_batches
    from swiftkv_distill.data import encode_record, load_records
    from swiftkv_distill.recipe import parse

    records = load_records(run.results["teacher_answers"]["train_files"])
    random.Random(0).shuffle(records)  # the fit sees the training mix (prose and chat), not one file
    texts = (tokenizer.decode(encode_record(r, tokenizer)[0]) for r in records)
    recipe = parse(run.settings.recipe).model
    return fit_kv_projections(
        model,
        _tokens_counted(
            text_batches(tokenizer, _joined(texts, 4000), device=run.device), recipe.kv_init_tokens
        ),
        max_tokens=recipe.kv_init_tokens,
        ridge=recipe.kv_init_ridge,
        weighting=recipe.kv_init_weighting,
        member_metric=member_metric,
    )


def _tokens_counted(batches, total: int):
    """``batches`` as the fit takes them, with a bar of their tokens up to ``total`` (the fit's), gone when done: a
    GPU recipe's fit takes minutes on a CPU."""
    from tqdm.auto import tqdm

    with tqdm(total=total, desc="   K/V fit", unit="tok", unit_scale=True, leave=False) as bar:
        for batch in batches:
            yield batch
            bar.update(min(batch["input_ids"].numel(), total - bar.n))


def _joined(texts, characters: int):
    """Texts joined into pieces of about ``characters`` (short paragraphs alone make no 256-token rows)."""
    piece = ""
    for text in texts:
        piece += text + "\n\n"
        if len(piece) >= characters:
            yield piece
            piece = ""
    if piece:
        yield piece


def held_out_loaders(run, path) -> dict:
    """The held-out sets as the distillation validates on them (the recipe's row length and batch, the run's rows)."""
    from swiftkv_distill.datamodule import DistillDataModule
    from swiftkv_distill.recipe import parse

    data = parse(run.settings.recipe).data
    val_files = {"text": run.settings.heldout_text}
    if run.path("chat_heldout.jsonl").is_file():
        val_files["chat"] = [str(run.path("chat_heldout.jsonl"))]
    module = DistillDataModule(str(path), run.settings.heldout_text, val_files=val_files, max_length=data.max_length,
                               val_batch_size=data.val_batch_size or data.batch_size,
                               max_val_rows=run.settings.max_eval_rows, chat_tokens=data.chat_tokens)  # fmt: skip
    module.build()
    loaders = module.val_dataloader()
    return dict(zip(module.val_set_names, loaders if isinstance(loaders, list) else [loaders], strict=True))


def measure(run, ls: list[int]) -> list[dict]:
    """The frontier's rows: per ``l``, the init's held-out KL and agreement, the FLOPs bound, the KV bytes."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from swiftkv_core.convert import convert
    from swiftkv_core.flops import ModelShape, kv_cache_bytes_per_token, prefill_flops_total
    from swiftkv_core.generation import load_weights

    path = run.settings.model_identity["path"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    # fp32 on a GPU too: the distillation validates in its weights' dtype (fp32 under bf16-mixed), and the report
    # sets the init's figures beside the distilled ones
    base = load_weights(path, torch.float32, run.device).eval()
    shape = ModelShape.from_config(base.config)
    tokens = min(PROMPT_TOKENS, getattr(base.config, "max_position_embeddings", PROMPT_TOKENS))
    loaders = held_out_loaders(run, path)
    g, rows = run.settings.key_value_group_size, []
    for l in tqdm(ls, desc="   frontier", unit="l"):
        model = convert(base, l, g).to(run.device)  # the base weights shared, the SwiftKV projections new
        report = fit_kv_init(run, model, tokenizer)
        held_out = held_out_metrics(model, loaders, run.device)
        bound = prefill_flops_total(shape, tokens) / prefill_flops_total(shape, tokens, l, g)
        rows.append({
            "l": l, "skipped": 1 - l / shape.num_hidden_layers, "flops_bound_x": bound, "prompt_tokens": tokens,
            "kv_bytes_per_token": kv_cache_bytes_per_token(shape, l, g), "explained": report["explained_mean"],
            **held_out, "predicted": {name: predicted_distilled(v["agreement"]) for name, v in held_out.items()},
        })  # fmt: skip
        del model  # its projections and the fit's buffers freed before the next l's (cycles included)
        gc.collect()
    return rows


def held_out_metrics(model, loaders: dict, device) -> dict:
    """``{set name: {"agreement", "kl"}}`` of ``model`` (SwiftKV on) against itself off, on ``loaders`` (by name)."""
    from lightning.fabric.utilities import move_data_to_device
    from tqdm.auto import tqdm

    from swiftkv_distill.step import DistillationStep, ValidationMetrics

    step, held_out = DistillationStep(model), {}
    for name, loader in loaders.items():
        metrics = ValidationMetrics().to(device)
        for batch in tqdm(loader, desc=f"   held-out {name}", unit="batch", leave=False):
            metrics.update(step.evaluate(move_data_to_device(batch, device)))
        values = metrics.compute()
        held_out[name] = {"agreement": values["agreement"], "kl": values["kl"]}
    return held_out


def how_the_prediction_held(result: dict, metrics: dict) -> dict:
    """For the run's l: the distilled agreement predicted from the init and the one measured, per held-out set."""
    row = next(r for r in result["rows"] if r["l"] == result["chosen"])
    return {name: {"init": row[name]["agreement"], "predicted": row["predicted"][name],
                   "measured": metrics[f"distilled/{name}"]["agreement"]}
            for name in row["predicted"] if f"distilled/{name}" in metrics}  # fmt: skip


def markdown(result: dict, metrics: dict, plot: str) -> list[str]:
    """The report's section: the table of the sweep, the pick, and how the prediction held."""
    sets = list(result["rows"][0]["predicted"])
    header = " | ".join(f"{name}: init agreement (KL) | predicted distilled" for name in sets)
    lines = [
        "## How many layers can this model give up? (the quality/speed frontier)",
        "",
        "Per l, SwiftKV with the least-squares K/V init alone (no gradient step), on the held-out sets, beside the "
        f"prefill FLOPs bound at {result['rows'][0]['prompt_tokens']} tokens and the KV cache per token (bf16). "
        f"Predicted distilled: the init plus {GAP_CLOSED:.0%} of what it leaves, the share the CPU recipe's 12 "
        "minutes of distillation closed on SmolLM2 (`benchmarks/results/frontier.md`); another model, recipe or "
        "budget closes more or less.",
        "",
        f"| l | layers skipped | FLOPs bound | KV bytes / token | {header} |",
        "|---|---|---|---|" + "---|---|" * len(sets),
    ]
    for r in result["rows"]:
        cells = " | ".join(f"{100 * r[n]['agreement']:.1f}% ({r[n]['kl']:.3f}) | {100 * r['predicted'][n]:.1f}%"
                           for n in sets)  # fmt: skip
        mark = " **(this run)**" if r["l"] == result["chosen"] else ""
        lines.append(f"| {r['l']}{mark} | {r['skipped']:.0%} | {r['flops_bound_x']:.2f}x | "
                     f"{r['kv_bytes_per_token']:,.0f} | {cells} |")  # fmt: skip
    held = how_the_prediction_held(result, metrics)
    pick = (f"l = {result['chosen']} was given" if result["reason"] == "given" else
            f"`--num_key_value_layers auto` picked l = {result['chosen']}: {result['reason']}")  # fmt: skip
    lines += ["", pick + ". After distillation: " + "; ".join(
        f"{name} predicted {100 * h['predicted']:.1f}%, measured {100 * h['measured']:.1f}% "
        f"({100 * (h['measured'] - h['predicted']):+.1f} points)" for name, h in held.items()) + ".", "",
        f"![frontier]({plot})", ""]  # fmt: skip
    return lines


def plot(result: dict, metrics: dict, path) -> None:
    """Held-out agreement against the prefill FLOPs bound: the init per l, its predicted distillation, the
    distilled point measured, and the bar of ``auto``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, held = result["rows"], how_the_prediction_held(result, metrics)
    bounds = [r["flops_bound_x"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, colour in zip(rows[0]["predicted"], ("tab:blue", "tab:orange"), strict=False):
        ax.plot(bounds, [100 * r[name]["agreement"] for r in rows], "o-", color=colour, label=f"{name}: init")
        ax.plot(
            bounds, [100 * r["predicted"][name] for r in rows], "--", color=colour, label=f"{name}: predicted"
        )
        if name in held:
            chosen = next(r for r in rows if r["l"] == result["chosen"])
            ax.plot([chosen["flops_bound_x"]], [100 * held[name]["measured"]], "*", markersize=14, color=colour,
                    label=f"{name}: distilled (l={result['chosen']})")  # fmt: skip
    for r in rows:
        ax.annotate(f"l={r['l']}", (r["flops_bound_x"], 100 * r[next(iter(r["predicted"]))]["agreement"]),
                    textcoords="offset points", xytext=(0, -12), ha="center", fontsize=7)  # fmt: skip
    if result["reason"] != "given":
        ax.axhline(100 * result["min_agreement"], color="gray", linestyle=":", label="--min_agreement")
    ax.set(xlabel=f"prefill FLOPs bound at {rows[0]['prompt_tokens']} tokens (x faster)",
           ylabel="held-out top-1 agreement with the teacher (%)", title="quality against prefill saved")  # fmt: skip
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
