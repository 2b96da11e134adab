"""A short soak (the benchmark's, about a minute): streaming clients that come and go, a quarter hanging up, a KV
cache small enough to preempt, prefix caching; no errors, the same greedy answers as on a quiet server, the KV
cache empty again, and the report written. The 5-minute figures: benchmarks/results/soak.md."""

from __future__ import annotations

import pytest

from swiftkv_serve.soak import run_soak
from swiftkv_serve.soak_report import write_soak_report

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_short_soak_keeps_serving_right(tiny_swiftkv, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)  # the server as users run it
    monkeypatch.setenv("SWIFTKV_API_KEY", "the user's own")  # not the soak's server's: its clients send none
    run = run_soak(tiny_swiftkv, minutes=0.5, clients=16, drop_fraction=0.25, kv_cache_mib=1, sample_s=5,
                   workdir=tmp_path)  # fmt: skip
    summary = run["summary"]
    assert summary["requests"] >= 16 and summary["dropped"] >= 1
    assert summary["errors"] == 0 and summary["server_errors_5xx"] == 0, [
        r for r in run["records"] if r["error"]
    ][:3]
    assert summary["answers_equal"], (run["quiet_answers"], run["answers_after"])
    assert summary["kv_usage_idle"] == 0
    assert summary["preemptions"] > 0  # the KV budget was small enough to preempt
    # every 5 s, a sample where /metrics answers in time under the load (a gap is said, and not fatal), and one after
    assert len(run["samples"]) >= 3 and all(s["rss"] > 0 for s in run["samples"])
    write_soak_report({"tiny": run}, tmp_path / "soak", "test")
    markdown = (tmp_path / "soak.md").read_text()
    assert "| tiny |" in markdown and (tmp_path / "soak.png").read_bytes()[:4] == b"\x89PNG"
