"""The report of ``features.compare_features``: Markdown tables (efficiency against each baseline's bound, speculative
decoding counters) and a plot of the speed-ups against their bounds."""

from __future__ import annotations

import json
from pathlib import Path

from swiftkv_core.atomic import atomic_write_text

from .bench import STOCK_LABEL
from .comparison import swiftkv_origin
from .features import FAST_PREFILL_OFF, NGRAM, SAME_TEXT_LABEL


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


SPEC_DECODE_NOTES = [
    "- With n-gram speculation the decode work depends on the text: a decode step emits one token plus the drafts "
    "it accepts, and drafts are accepted where the model copies its prompt. Stock and SwiftKV write different text "
    "(column 'same text as stock': the requests whose output token ids are identical), so their decode work "
    "differs and the stock row's bound, which assumes the same decode work, can be beaten or missed for reasons "
    "that are not the serving's. The same-text baseline is the SwiftKV checkpoint served with "
    f"`--additional-config '{json.dumps(FAST_PREFILL_OFF['additional_config'])}'`: every layer runs for every "
    "prompt token (its R: the bound line above), and its outputs are SwiftKV's (column 'same text'), so "
    "both decode the same tokens and its bound holds.",
    "- Counters, from vLLM over each timed burst (`vllm:spec_decode_num_draft_tokens`, "
    "`vllm:spec_decode_num_accepted_tokens`): acceptance = accepted / proposed draft tokens; decode steps = "
    "output tokens after each request's first - accepted tokens (request-steps); tokens / step = those tokens / "
    "steps.",
]
ENGINES = {"stock": "stock", "swiftkv": "SwiftKV", "same_text": "fast prefill off"}


def _row(cells: list) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def _versus_row(name: str, feature: str, baseline_s: float, swiftkv_s: float, v: dict) -> str:
    """A table row of ``versus``'s result: wall times, speed-up, prefill share, bound, efficiency, same text."""
    return _row(
        [
            name,
            feature,
            f"{baseline_s:.1f}",
            f"{swiftkv_s:.1f}",
            f"{v['speedup_x']:.2f}x",
            _percent(v["prefill_share"]),
            f"{v['bound_x']:.2f}x",
            _percent(v["efficiency"]),
            _percent(v.get("identical_outputs")),
        ]
    )


def write_features_report(results: dict, out: Path) -> None:
    """``out``.json, .png (``plot_features``) and .md from ``compare_features``'s results."""
    l, num_layers = results["num_key_value_layers"], results["num_hidden_layers"]
    atomic_write_text(out.with_suffix(".json"), json.dumps(results, indent=2))
    plot_features(results, out.with_suffix(".png"))
    swift_label = f"SwiftKV l={l}"
    lines = [
        f"# Serving with vLLM features: {results['model']} stock vs SwiftKV (l={l} of {num_layers})",
        "",
        f"vLLM {results['vllm_version']}, {results['device']}, eager={results['enforce_eager']}, bursts of "
        f"{results['num_requests']} requests (max_num_seqs={results['max_num_seqs']}), greedy, ignore_eos. "
        + swiftkv_origin(results),
        "",
        "| workload | features | stock s | SwiftKV s | speed-up | prefill share (stock) | bound | efficiency | "
        "same text as stock |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    same_text_lines, spec_lines, engines = [], [], ""
    for name, by_feature in results["summary"].items():
        for feature, r in by_feature.items():
            runs = results["runs"][feature]
            wall = {label: run["workloads"][name]["wall_s"] for label, run in runs.items()}
            lines.append(_versus_row(name, feature, wall[STOCK_LABEL], wall[swift_label], r))
            if "same_text" in r:
                same_text_lines.append(
                    _versus_row(name, feature, wall[SAME_TEXT_LABEL], wall[swift_label], r["same_text"])
                )
            if "spec_decode" in r:
                spec = r["spec_decode"]
                engines = " / ".join(ENGINES[key] for key in spec)
                spec_lines.append(
                    _row(
                        [
                            name,
                            feature,
                            " / ".join(_percent(spec[key]["acceptance_rate"]) for key in spec),
                            " / ".join(f"{spec[key]['tokens_per_step']:.2f}" for key in spec),
                            " / ".join(str(spec[key]["decode_steps"]) for key in spec),
                        ]
                    )
                )
    if same_text_lines:
        lines += [
            "",
            "With n-gram speculation, SwiftKV against the same checkpoint with fast prefill off (the same text, "
            "the stock prefill FLOPs; see below):",
            "",
            "| workload | features | fast prefill off s | SwiftKV s | speed-up | prefill share (off) | bound | "
            "efficiency | same text |",
            "|---|---|---|---|---|---|---|---|---|",
            *same_text_lines,
        ]
    if spec_lines:
        lines += [
            "",
            f"Speculative decoding in the timed bursts (the engines' counters; {engines}):",
            "",
            "| workload | features | acceptance | tokens / decode step | decode steps |",
            "|---|---|---|---|---|",
            *spec_lines,
        ]
    ratios = ", ".join(f"{name} {r:.2f}" for name, r in results["prefill_flops_ratio"].items())
    same_ratios = ", ".join(
        f"{name} {r:.2f}" for name, r in results.get("same_text_prefill_flops_ratio", {}).items()
    )
    lines += [
        "",
        "How it was measured:",
        "",
        "- One burst per workload, submitted at once to vLLM's async engine, streamed; each (engine, features) "
        "in its own process; with prefix caching the cache is emptied before each burst.",
        "- RAG: 4 shipping-log documents (~1500 tokens) shared by the questions; extraction: a document per "
        "request, the answer copies its lines; decode-heavy: random ids, 100 in / 500 out; long answers: chat "
        "requests for a long article in the model's chat template, ~65 in / 500 out.",
        f"- n-gram: `{json.dumps(NGRAM)}`.",
        "- bound = T / (T - T_prefill * (1 - 1/R)): T the baseline burst's wall time, T_prefill the same burst "
        f"with one output token, R the prefill FLOPs ratio at the workload's longest prompt ({ratios}; same-text "
        f"baseline: {same_ratios or '-'}); efficiency = speed-up / bound.",
        *(SPEC_DECODE_NOTES if spec_lines else []),
        "",
        "Command:",
        "",
        f"    {results.get('command', '(a library call: compare_features)')}",  # benchmarks/serve.py records its own
        "",
    ]
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines))
    print("\n".join(lines))


def plot_features(results: dict, path: Path) -> None:
    """Per workload, the SwiftKV speed-up of each feature set over stock (blue bars) and, with speculation, over
    the same-text baseline (orange bars), each against its bound (black marks); efficiencies written on the
    bars. PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    summary = results["summary"]
    width = max(4.6 * len(summary), 10)  # room for the legend with one workload
    fig, axes = plt.subplots(1, len(summary), figsize=(width, 4.4), sharey=True, squeeze=False)
    bars = [
        (r, colour)
        for by_feature in summary.values()
        for row in by_feature.values()
        for r, colour in ((row, "tab:blue"), (row.get("same_text"), "tab:orange"))
        if r
    ]
    top = max(max(r["speedup_x"], r["bound_x"]) for r, _ in bars)
    for ax, (name, by_feature) in zip(axes[0], summary.items(), strict=True):
        features = list(by_feature)
        for i, feature in enumerate(features):
            row = by_feature[feature]
            pair = [(row, "tab:blue")] + ([(row["same_text"], "tab:orange")] if "same_text" in row else [])
            width = 0.7 / len(pair)
            for j, (r, colour) in enumerate(pair):
                x = i + (j - (len(pair) - 1) / 2) * width
                ax.bar(x, r["speedup_x"], 0.9 * width, color=colour)
                ax.plot([x - width / 2, x + width / 2], [r["bound_x"]] * 2, color="black", linewidth=2.5)
                ax.text(
                    x,
                    r["speedup_x"] / 2,
                    f"{100 * r['efficiency']:.0f}%",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white",
                    rotation=90 if len(pair) > 1 else 0,
                )
        ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(features)), features, fontsize=9)
        workload = results["workloads"][name]
        ax.set_title(
            f"{name} (prompt <= {workload['max_prompt_tokens']}, {workload['output_tokens']} out)",
            fontsize=10,
        )
        ax.set_ylim(0, 1.15 * top)
    axes[0][0].set_ylabel("SwiftKV speed-up (x)")
    legend = [
        (Patch(color="tab:blue"), "over stock"),
        (Patch(color="tab:orange"), "over itself with fast prefill off (same text; n-gram rows)"),
        (Line2D([], [], color="black", linewidth=2.5), "bound (prefill R times cheaper, same decode work)"),
    ]
    fig.legend(*zip(*legend, strict=True), loc="lower center", ncol=len(legend), fontsize=8, frameon=False)
    fig.suptitle(
        f"vLLM {results['vllm_version']} on {results['device']}: {results['model']} stock vs SwiftKV "
        f"(l={results['num_key_value_layers']}), {results['num_requests']} requests per burst; "
        "efficiency = speed-up / bound",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
