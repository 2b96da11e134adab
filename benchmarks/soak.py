"""A soak under load (``swiftkv_serve.soak``): ``swiftkv-serve`` on loopback with many streaming clients that come
and go, a small KV budget (preemption), prefix caching; errors, memory, latency drift, answers and KV usage.

    .venv/bin/python benchmarks/soak.py --checkpoints '{"SmolLM2 l=20": "runs/smollm2-135m-instruct-l20/distilled-serving"}'
    .venv/bin/python benchmarks/soak.py --minutes 1 --clients 16 --out /tmp/soak     # the tiny model only, quick

Without ``--tiny false`` a tiny random SwiftKV model (made once in the cache) is soaked first. Writes
``benchmarks/results/soak.{json,md,png}`` (or ``--out``).
"""

from __future__ import annotations

import re
import shlex
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def tiny_checkpoint() -> Path:
    """A tiny random SwiftKV Llama (4 layers, head_dim 32 for the CPU kernels), made once."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from swiftkv_core.convert import convert, export_for_serving
    from swiftkv_core.default_model import cache_dir, default_model_path

    out = cache_dir() / "bench" / "tiny-swiftkv-l2-hd32"
    if not (out / "config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(default_model_path())
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                             tie_word_embeddings=True)  # fmt: skip
        export_for_serving(convert(LlamaForCausalLM(config), 2), out, tokenizer)
    return out


def main(
    checkpoints: dict[str, str] | None = None,
    tiny: bool = True,
    minutes: float = 5.0,
    clients: int = 64,
    drop_fraction: float = 0.25,
    kv_cache_mib: int = 64,
    compile: bool = False,
    out: Path = RESULTS / "soak",
) -> None:
    """Soak each checkpoint in turn and write the report.

    Args:
        checkpoints: label -> SwiftKV serving export to soak (after the tiny one).
        tiny: soak a tiny random SwiftKV model first (the serving stack alone).
        minutes: load time per checkpoint.
        clients: concurrent streaming clients.
        drop_fraction: the share of clients that hang up mid-stream.
        kv_cache_mib: the server's KV cache (small: the scheduler preempts).
        compile: vLLM's default compile mode (default: eager, a faster start).
        out: output prefix (.json, .md, .png).
    """
    from swiftkv_core.checkpoints import CheckpointError, check_checkpoint
    from swiftkv_serve.soak import run_soak
    from swiftkv_serve.soak_report import write_soak_report

    if minutes <= 0 or clients < 1 or not 0 <= drop_fraction <= 1:
        raise SystemExit("--minutes > 0, --clients >= 1 and --drop_fraction in [0, 1], please.")
    targets = ({"tiny random SwiftKV": str(tiny_checkpoint())} if tiny else {}) | dict(checkpoints or {})
    if not targets:
        raise SystemExit("nothing to soak: give --checkpoints, or keep --tiny true.")
    for label, path in targets.items():
        try:
            check_checkpoint(path, kind="swiftkv")
        except CheckpointError as error:
            raise SystemExit(f"--checkpoints[{label!r}]: {error}") from None
    runs = {}
    for label, path in targets.items():
        print(f"== soak {label}: {path}", flush=True)
        # the server's log, in a private folder; a label is any text ("l=16/g=2"): a file name of its letters
        workdir = Path(tempfile.mkdtemp(prefix=f"swiftkv-soak-{re.sub(r'[^A-Za-z0-9=.]+', '-', label)}-"))
        print(f"   the server's log: {workdir / 'server.log'}", flush=True)
        runs[label] = run_soak(Path(path), minutes, clients, drop_fraction, kv_cache_mib, compile=compile,
                               workdir=workdir)  # fmt: skip
        print({k: v for k, v in runs[label]["summary"].items() if k != "per_minute"}, flush=True)
    write_soak_report(runs, Path(out), shlex.join([".venv/bin/python", "benchmarks/soak.py", *sys.argv[1:]]))


if __name__ == "__main__":
    from jsonargparse import auto_cli

    auto_cli(main, as_positional=False)
