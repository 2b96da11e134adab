"""The ``swiftkv`` command: one table of every entry point of the project (litgpt's ``__main__.py``).

    swiftkv convert | analyze | generate | flops    swiftkv_core.commands (typed functions)
    swiftkv distill fit --config RECIPE             swiftkv_distill's LightningCLI (--trainer.* overrides)
    swiftkv prepare-data [answer --prompts ...]     swiftkv_distill's offline data sets
    swiftkv quickstart                              the main job (swiftkv.quickstart)
    swiftkv eval --model CKPT [--tasks ...]         task accuracy with lm-eval, SwiftKV vs its teacher
    swiftkv serve CHECKPOINT [vllm serve options]   swiftkv_serve: `vllm serve` after a check

A target is named as ``"module:function"`` and imported only when its command runs, so ``swiftkv --help`` is
instant, and a command whose package is not installed says which one to install.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import types
import typing
from dataclasses import dataclass

# What bad input raises (a missing file, a value out of range, an unknown name: every message says the fix), and a
# distillation that did not fit its GPU (swiftkv_distill.console.OutOfMemory, a MemoryError that says what to
# change): one line, no traceback. SWIFTKV_DEBUG=1 shows the traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
               argparse.ArgumentError, MemoryError)  # fmt: skip


@dataclass(frozen=True)
class Command:
    """One ``swiftkv`` subcommand."""

    target: str  # "module:function"
    package: str  # the distribution that provides it
    help: str  # one line for ``swiftkv --help``
    typed: bool = True  # True: jsonargparse builds the options from the function's signature and docstring;
    # False: the function parses its own arguments (LightningCLI, or a pass-through to vLLM)
    needs: tuple[str, ...] = ()  # modules the command imports only as it runs (an extra's): checked first


COMMANDS: dict[str, Command] = {
    "convert": Command(
        "swiftkv_core.commands:convert", "swiftkv-core", "convert a Llama / Mistral / Qwen2 checkpoint"
    ),
    "analyze": Command(
        "swiftkv_core.commands:analyze", "swiftkv-core", "layer input similarity (Eq. 1), recommends l"
    ),
    "generate": Command(
        "swiftkv_core.commands:generate", "swiftkv-core", "greedy generation and prefill time"
    ),
    "flops": Command(
        "swiftkv_core.commands:flops", "swiftkv-core", "analytic prefill FLOPs and KV-cache bytes"
    ),
    "distill": Command(
        "swiftkv_distill.cli:main",
        "swiftkv-distill",
        "distillation: `swiftkv distill fit --config RECIPE`",
        False,
    ),
    "prepare-data": Command(
        "swiftkv_distill.corpora:main", "swiftkv-distill", "prepare the offline data sets; `answer`", False
    ),
    "quickstart": Command("swiftkv.quickstart:main", "swiftkv", "the main job, end to end"),
    "eval": Command(
        "swiftkv.evaluate:main",
        "swiftkv[eval]",
        "task accuracy (lm-eval), SwiftKV vs its teacher",
        needs=("lm_eval",),
    ),
    "lm-eval": Command(
        "swiftkv.evaluate:lm_eval_cli",
        "swiftkv[eval]",
        "lm-eval's own CLI, SwiftKV configs known",
        False,
        needs=("lm_eval",),
    ),
    "serve": Command(
        "swiftkv_serve.cli:main", "swiftkv-serve", "OpenAI-compatible vLLM server for a checkpoint", False
    ),
}


def _usage() -> str:
    rows = "\n".join(f"  {name:<14}{command.help}" for name, command in COMMANDS.items())
    return f"usage: swiftkv COMMAND [options]   (swiftkv COMMAND --help for its options)\n\ncommands:\n{rows}"


def main(args: list[str] | None = None) -> None:
    args = sys.argv[1:] if args is None else list(args)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        raise SystemExit(0 if args else 2)
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        raise SystemExit(f"swiftkv: unknown command {name!r}.\n{_usage()}")
    command = COMMANDS[name]
    module_name, function_name = command.target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):
            raise SystemExit(
                f"swiftkv {name}: needs the {command.package} package (pip install {command.package})."
            ) from None
        raise
    if missing := [m for m in command.needs if importlib.util.find_spec(m) is None]:
        raise SystemExit(
            f"swiftkv {name}: needs {missing[0]}, not installed here (pip install '{command.package}')."
        )
    function = getattr(module, function_name)
    try:
        if command.typed:
            from jsonargparse import auto_cli

            rest = bare_lists(function, rest)
            auto_cli(function, args=rest, as_positional=False, prog=f"swiftkv {name}", exit_on_error=False)
        else:
            function(rest)
    except USER_ERRORS as error:
        if os.environ.get("SWIFTKV_DEBUG"):
            raise
        raise SystemExit(f"swiftkv {name}: {' '.join(str(error).split()) or type(error).__name__}") from None


def bare_lists(function, args: list[str]) -> list[str]:
    """A list option's bare values as one list: ``--train_files a.jsonl`` and ``--train_files a.jsonl b.jsonl`` (as
    most command lines take them) become jsonargparse's ``--train_files '["a.jsonl", "b.jsonl"]'``. Its own forms
    (``'[a.jsonl]'``, ``--train_files+ a.jsonl``, ``null``) pass unchanged; a lone ``''`` is refused (a ValueError:
    it names nothing). A typed command has no positional arguments, so the values run to the next option (``--name``,
    ``-h``). A yes/no option alone is on: ``--force`` is jsonargparse's ``--force true``."""
    try:
        hints = typing.get_type_hints(function)
    except (NameError, TypeError):  # a type imported for type checking only: jsonargparse's forms alone
        return args
    elements = {f"--{name}": _list_element(hint) for name, hint in hints.items()}
    switches = {f"--{name}" for name, hint in hints.items() if bool in (hint, *typing.get_args(hint))}
    out: list[str] = []
    index = 0
    while index < len(args):
        option, equals, value = args[index].partition("=")
        index += 1
        if option in switches and not equals and (index == len(args) or _is_option(args[index])):
            out += [option, "true"]
            continue
        element = elements.get(option)
        if element is None:
            out.append(args[index - 1])
            continue
        values = [value] if equals else []
        while not equals and index < len(args) and not _is_option(args[index]):
            values.append(args[index])
            index += 1
        if values == [""]:
            raise ValueError(
                f"{option} '' names nothing: give its values ({option} a b), or leave {option} out for its default"
            )
        if len(values) <= 1 and (not values or values[0].lstrip().startswith("[") or values[0] == "null"):
            out += [option, *values]
        else:  # strings quoted (a path with a comma or a colon stays one path); numbers as typed
            out += [option, "[" + ", ".join(json.dumps(v) if element is str else v for v in values) + "]"]
    return out


def _is_option(argument: str) -> bool:
    """``--name`` or ``-h``; not a negative number."""
    return argument.startswith("--") or (len(argument) > 1 and argument[0] == "-" and argument[1].isalpha())


def _list_element(hint) -> type | None:
    """A list option's element type, as its values are written: ``int`` / ``float`` for numbers, ``str`` for
    strings and paths (``list[Path] | None`` too); None for an option that is no list."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    candidates = typing.get_args(hint) if union else (hint,)
    for candidate in candidates:
        if typing.get_origin(candidate) is list and typing.get_args(candidate):
            element = typing.get_args(candidate)[0]
            return str if element not in (int, float) else element
    return None


if __name__ == "__main__":
    main()
