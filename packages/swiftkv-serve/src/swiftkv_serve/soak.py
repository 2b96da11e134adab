"""A soak under load: ``swiftkv-serve`` on loopback, many streaming clients that come and go for minutes, a KV
budget small enough that the scheduler preempts, prefix caching on. It records what an operator watches:

- every request's outcome (errors, 5xx) and its TTFT and TPOT, as p50 / p99 per minute (drift);
- the server's resident memory (its whole process tree) every ``sample_s`` seconds (growth);
- vLLM's own gauges: KV-cache usage, running requests, preemptions;
- the greedy answers to a few fixed prompts before the load (a quiet server) and after it, which must be equal;
- KV-cache usage once the load is gone, which must be back to 0.

A quarter of the clients (``drop_fraction``) hang up mid-stream, as browsers and timeouts do. Bounded in time (each
client starts no request after ``minutes``); stops by itself. ``soak_report.py`` writes the table and the plot;
``benchmarks/soak.py`` is the command.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from . import auth
from .server import free_port, process_tree_rss, running_server, swiftkv_serve_command

QUIET_PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "A good way to learn a new language is",
    "The three primary colours are",
]
_WORDS = (
    "harbour",
    "ledger",
    "copper",
    "meadow",
    "signal",
    "lantern",
    "orchard",
    "granite",
    "voyage",
    "thicket",
)


def documents(count: int, words: int, seed: int = 0) -> list[str]:
    """Long shared prompt prefixes (prefix caching reuses their blocks across requests)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(words)) for _ in range(count)]


def metrics(base: str) -> dict[str, float]:
    """vLLM's gauges and counters of interest, from ``/metrics`` (summed over engines and labels)."""
    wanted = {"vllm:kv_cache_usage_perc": "kv_usage", "vllm:num_requests_running": "running",
              "vllm:num_requests_waiting": "waiting", "vllm:num_preemptions_total": "preemptions"}  # fmt: skip
    values = dict.fromkeys(wanted.values(), 0.0)
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in wanted:
                values[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return values


def greedy_answers(base: str, model: str, headers: dict, max_tokens: int = 24) -> list[str]:
    answers = []
    for prompt in QUIET_PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        request = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(), headers)
        with urllib.request.urlopen(request, timeout=300) as response:
            answers.append(json.loads(response.read())["choices"][0]["text"])
    return answers


async def _client(
    session, base: str, model: str, prompts: list[str], drops: bool, stop_at: float, rng, records
):
    """One client: a streaming completion after another until ``stop_at``; a dropping client hangs up early."""
    import aiohttp

    while time.monotonic() < stop_at:
        body = {"model": model, "prompt": rng.choice(prompts), "max_tokens": rng.randint(16, 192),
                "temperature": 0.7, "seed": rng.randrange(10**6), "stream": True}  # fmt: skip
        hang_up_after = rng.randint(2, 8) if drops else None
        record = {"start": time.monotonic(), "status": None, "error": None, "dropped": False, "tokens": 0}
        try:
            async with session.post(f"{base}/v1/completions", json=body) as response:
                record["status"] = response.status
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    record["tokens"] += 1
                    now = time.monotonic()
                    record.setdefault("first", now)
                    record["last"] = now
                    if hang_up_after and record["tokens"] >= hang_up_after:
                        record["dropped"] = True
                        response.close()
                        break
        except (TimeoutError, aiohttp.ClientError) as error:
            record["error"] = f"{type(error).__name__}: {error}"[:200]
        records.append(record)


async def _load(base: str, model: str, headers: dict, clients: int, drop_fraction: float, seconds: float,
                prompts: list[str], sample, sample_s: float) -> list[dict]:  # fmt: skip
    import aiohttp

    records: list[dict] = []
    stop_at = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(
        limit=clients, force_close=True
    )  # a connection per request: clients come and go
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        droppers = round(clients * drop_fraction)
        tasks = [
            asyncio.create_task(
                _client(session, base, model, prompts, i < droppers, stop_at, random.Random(i), records)
            )
            for i in range(clients)
        ]
        while not all(task.done() for task in tasks):
            # in a thread: the clients' token times are taken on this loop, which must not wait for /metrics
            await asyncio.to_thread(sample, records)
            await asyncio.wait(tasks, timeout=sample_s)
        await asyncio.gather(*tasks)
    return records


def run_soak(checkpoint: Path, minutes: float = 5.0, clients: int = 64, drop_fraction: float = 0.25,
             kv_cache_mib: int = 64, max_model_len: int = 512, sample_s: float = 10.0, compile: bool = False,
             workdir: Path | None = None) -> dict:  # fmt: skip
    """Serve ``checkpoint`` with a small KV cache and prefix caching, load it for ``minutes`` with ``clients``
    streaming clients, and return every record, sample and check (JSON-able). The server's log goes to
    ``workdir`` (default: a new private temporary folder, never one another user or soak could have made)."""
    workdir = Path(tempfile.mkdtemp(prefix="swiftkv-soak-")) if workdir is None else workdir
    workdir.mkdir(parents=True, exist_ok=True)
    # bf16, as the soak's figures were measured (vLLM's auto for these fp32 checkpoints; swiftkv serve now keeps a
    # float32 checkpoint in float32 on a CPU, and the KV budget would then hold half the tokens)
    options = ["--max-model-len", str(max_model_len), "--max-num-seqs", str(clients), "--enable-prefix-caching",
               "--kv-cache-memory-bytes", str(kv_cache_mib * 2**20), "--seed", "0", "--dtype", "bfloat16"]  # fmt: skip
    if not compile:
        options.append("--enforce-eager")
    command = swiftkv_serve_command(checkpoint, free_port(), *options)
    model, headers = str(checkpoint), {"Content-Type": "application/json"}
    # long prompts sharing 4 documents (prefix caching), and short ones whose answers outgrow what was admitted
    # (with a small KV budget the scheduler must preempt running requests)
    shared = documents(4, 120)
    prompts = [f"{doc}\nQuestion {i}: which word comes third?" for i, doc in enumerate(shared * 4)]
    prompts += [f"Write a long story about a {word}." for word in _WORDS]
    samples: list[dict] = []
    # vLLM's CPU backend lets VLLM_CPU_KVCACHE_SPACE override --kv-cache-memory-bytes: the soak's budget must hold;
    # an API key of the user's environment would close the server to the soak's clients
    dropped = ("VLLM_CPU_KVCACHE_SPACE", *auth.KEY_VARIABLES)
    environment = {k: v for k, v in os.environ.items() if k not in dropped}
    with running_server(command, workdir / "server.log", environment) as (base, proc):
        quiet = greedy_answers(base, model, headers)
        started = time.monotonic()

        def sample(records: list[dict] | None = None) -> None:
            t = time.monotonic() - started
            try:
                samples.append({"t": t, "rss": process_tree_rss(proc.pid), **metrics(base)})
            except OSError as error:  # /metrics slow to answer under load: the load goes on, the gap is said
                if records is None:
                    raise
                print(f"   {t:4.0f} s: no sample ({error})", flush=True)
                return
            if records is not None:  # live progress, one line per sample
                s, errors = samples[-1], sum(1 for r in records if r["error"] or (r["status"] or 0) >= 400)
                print(f"   {s['t']:4.0f} s of {60 * minutes:.0f}: {len(records)} requests done, {errors} errors, "
                      f"{s['running']:.0f} running, {s['waiting']:.0f} waiting, KV {s['kv_usage']:.0%}, "
                      f"{s['preemptions']:.0f} preemptions, server RSS {s['rss'] / 2**20:,.0f} MiB", flush=True)  # fmt: skip

        records = asyncio.run(_load(base, model, headers, clients, drop_fraction, 60 * minutes, prompts, sample,
                                    sample_s))  # fmt: skip
        deadline = time.monotonic() + 120  # the load is gone: everything finishes or is aborted
        while (after := metrics(base))["running"] + after["waiting"] > 0 and time.monotonic() < deadline:
            time.sleep(1)
        sample()
        after_answers = greedy_answers(base, model, headers)
        idle = metrics(base)
    for record in records:
        record["t"] = record["start"] - started
    return {"checkpoint": str(checkpoint), "minutes": minutes, "clients": clients, "drop_fraction": drop_fraction,
            "kv_cache_mib": kv_cache_mib, "max_model_len": max_model_len, "compile": compile, "command": command,
            "records": records, "samples": samples, "quiet_answers": quiet, "answers_after": after_answers,
            "idle": idle, "summary": summarize(records, samples, quiet, after_answers, idle)}  # fmt: skip


def summarize(
    records: list[dict], samples: list[dict], quiet: list[str], after: list[str], idle: dict
) -> dict:
    """The checks and their figures: errors, 5xx, answers equal, KV usage back to 0, RSS growth, latency per minute."""
    errors = [r for r in records if r["error"] or (r["status"] or 0) >= 400]
    per_minute = {}
    for minute in sorted({int(r["t"] // 60) for r in records}):
        done = [r for r in records if int(r["t"] // 60) == minute and "first" in r and not r["error"]]
        ttft = [r["first"] - r["start"] for r in done]
        tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
        per_minute[minute] = {
            "requests": len(done),
            **_percentiles("ttft_s", ttft),
            **_percentiles("tpot_s", tpot),
        }
    later = [s["rss"] for s in samples if s["t"] >= 60] or [s["rss"] for s in samples]
    return {
        "requests": len(records), "dropped": sum(r["dropped"] for r in records), "errors": len(errors),
        "server_errors_5xx": sum((r["status"] or 0) >= 500 for r in records),
        "answers_equal": quiet == after, "kv_usage_idle": idle["kv_usage"], "preemptions": idle["preemptions"],
        "rss_growth": (later[-1] - later[0]) / later[0] if later else None,
        "rss_first_mib": later[0] / 2**20 if later else None, "rss_last_mib": later[-1] / 2**20 if later else None,
        "per_minute": per_minute,
    }  # fmt: skip


def _percentiles(name: str, values: list[float]) -> dict:
    if not values:
        return {f"{name}_p50": None, f"{name}_p99": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {f"{name}_p50": statistics.median(ordered), f"{name}_p99": p99}
