"""The report of soaks (``soak.run_soak``): one table of the checks per checkpoint, latency per minute, and a plot
of memory, latency and KV-cache usage over the run."""

from __future__ import annotations

import json
from pathlib import Path

from swiftkv_core.atomic import atomic_write_text


def write_soak_report(runs: dict[str, dict], out: Path, command: str) -> None:
    """``out``.json (every figure but the per-request records), .md and .png of ``runs`` (label -> run_soak)."""
    kept = {label: {k: v for k, v in run.items() if k != "records"} for label, run in runs.items()}
    atomic_write_text(out.with_suffix(".json"), json.dumps({"command": command, "runs": kept}, indent=2))
    plot_soak(runs, out.with_suffix(".png"))
    atomic_write_text(out.with_suffix(".md"), markdown(runs, command, out.with_suffix(".png").name))


def markdown(runs: dict[str, dict], command: str, plot: str) -> str:
    first = next(iter(runs.values()))
    lines = [
        f"# Soak: {first['clients']} streaming clients for {first['minutes']:g} min, "
        f"{first['drop_fraction']:.0%} hanging up mid-stream",
        "",
        f"Command: `{command}`. Each server: `swiftkv-serve` on loopback, prefix caching on, a KV cache of "
        f"{first['kv_cache_mib']} MiB (small enough that the scheduler preempts), max-model-len "
        f"{first['max_model_len']}. Targets: 0 errors, 0 5xx, the same greedy answers after the load as on a quiet "
        "server, KV usage back to 0, resident memory growing under 10% from the second minute to the last, no "
        "latency drift.",
        "",
        "| checkpoint | requests | dropped | errors | 5xx | answers after = quiet | KV usage idle | preemptions "
        "| RSS (MiB) minute 2 -> last | growth |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, run in runs.items():
        s = run["summary"]
        lines.append(
            f"| {label} | {s['requests']} | {s['dropped']} | {s['errors']} | {s['server_errors_5xx']} | "
            f"{'yes' if s['answers_equal'] else 'NO'} | {s['kv_usage_idle']:.3f} | {s['preemptions']:.0f} | "
            f"{s['rss_first_mib']:.0f} -> {s['rss_last_mib']:.0f} | {s['rss_growth']:+.1%} |"
        )
    lines += ["", "Latency per minute (completed streams; p50 / p99):", "",
              "| checkpoint | minute | requests | TTFT (s) | TPOT (ms) |", "|---|---|---|---|---|"]  # fmt: skip
    for label, run in runs.items():
        for minute, m in run["summary"]["per_minute"].items():
            lines.append(
                f"| {label} | {int(minute) + 1} | {m['requests']} | {_pair(m['ttft_s_p50'], m['ttft_s_p99'])} | "
                f"{_pair(m['tpot_s_p50'], m['tpot_s_p99'], 1e3)} |"
            )
    lines += ["", f"![soak]({plot})", ""]
    return "\n".join(lines)


def _pair(p50, p99, scale: float = 1.0) -> str:
    return "-" if p50 is None else f"{scale * p50:.2f} / {scale * p99:.2f}"


def plot_soak(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label, run in runs.items():
        samples = run["samples"]
        minutes = [s["t"] / 60 for s in samples]
        axes[0].plot(minutes, [s["rss"] / 2**20 for s in samples], "o-", label=label)
        axes[2].plot(minutes, [100 * s["kv_usage"] for s in samples], "o-", label=label)
        per_minute = run["summary"]["per_minute"]
        xs = [int(m) + 1 for m in per_minute]
        for key, style in (("ttft_s_p99", "o-"), ("ttft_s_p50", "s--")):
            axes[1].plot(xs, [m[key] for m in per_minute.values()], style, label=f"{label} {key[7:]}")
    axes[0].set(xlabel="minute", ylabel="server RSS (MiB, process tree)", title="memory")
    axes[0].set_ylim(bottom=0)
    axes[1].set(xlabel="minute", ylabel="TTFT (s)", title="time to first token per minute", yscale="log")
    axes[2].set(xlabel="minute", ylabel="KV cache usage (%)", title="KV cache (0 once the load is gone)")
    for ax in axes:
        ax.legend(fontsize=7)
    first = next(iter(runs.values()))
    fig.suptitle(f"soak: {first['clients']} streaming clients, {first['drop_fraction']:.0%} hanging up, "
                 f"KV {first['kv_cache_mib']} MiB, prefix caching", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
