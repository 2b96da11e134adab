"""vLLM's serve options as its parser reads them (dashes or underscores, a ``--config`` YAML file under the command
line, numbers as ``4k`` / ``4K``), for what ``swiftkv-serve`` reads of them before it starts vLLM (``READ_OPTIONS``)."""

from __future__ import annotations

from pathlib import Path


def option_value(options: list[str], name: str, *aliases: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` (or of a short alias, ``-tp 2``) in ``options`` (the last
    one given), else ``None``; as vLLM's parser reads them: dashes or underscores in the name, and after the keys of
    a ``--config`` YAML file. Not argparse's abbreviations (``--max-model 512``), which vLLM's parser also takes:
    ``check_full_names`` refuses those of the names read here."""
    value = config_file_settings(options).get(name[2:])
    value = None if value is None else str(value)
    for i, option in enumerate(options):
        given, equals, after = option.partition("=")
        if option_name(given) in (name, *aliases):
            if equals:
                value = after
            elif i + 1 < len(options):
                value = options[i + 1]
    return value


# the vLLM options this command reads (the CPU's dtype and KV cache size, the API key, a compile setting)
READ_OPTIONS = (
    "--api-key",
    "--compilation-config",
    "--config",
    "--device-memory-utilization",
    "--dtype",
    "--enforce-eager",
    "--gpu-memory-utilization",
    "--kv-cache-dtype",
    "--kv-cache-memory-bytes",
    "--max-model-len",
    "--max-num-seqs",
    "--optimization-level",
    "--tensor-parallel-size",
    "--pipeline-parallel-size",
    "--data-parallel-size",
)


def check_full_names(options: list[str]) -> None:
    """Raises ``ValueError`` for an abbreviation of an option in ``READ_OPTIONS`` (``--max-model 512``, or
    ``max-model: 512`` in the ``--config`` file): vLLM's parser would take it for the option, and this command,
    which reads names in full, would miss it (an API key would stay on the command line, unguarded). And for a
    misspelt key option (``--api-keys K``): vLLM's "unrecognized arguments" would print the key."""
    # options end at a bare "--", as in vLLM's parser
    given = options[: options.index("--")] if "--" in options else options
    names = [option_name(option.partition("=")[0]) for option in given if option.startswith("--")]
    for name in names + ["--" + key for key in config_file_settings(options)]:
        misspelt_key = name != "--api-key" and name.replace("-", "").lower().startswith("apikey")
        if misspelt_key:  # vLLM's "unrecognized arguments" would print its value
            raise ValueError(f"{name} is not an option: the key's is --api-key (or SWIFTKV_API_KEY_FILE)")
        full = next((read for read in READ_OPTIONS if read.startswith(name) and read != name), None)
        if full is not None:
            raise ValueError(
                f"{name}: write {full} in full (vLLM would take it for {full}, which this command reads)"
            )


def option_name(given: str) -> str:
    """An option's name as vLLM's parser reads it: underscores in it are dashes (``--max_model-len``)."""
    return "--" + given[2:].replace("_", "-") if given.startswith("--") else given


def config_file_settings(options: list[str]) -> dict:
    """The settings of the YAML file of ``--config PATH`` (vLLM's parser reads them first: the command line wins;
    it takes no ``--config=PATH``), keyed by their option names with dashes; empty without one."""
    path = next((options[i + 1] for i in range(len(options) - 1) if options[i] == "--config"), None)
    if path is None:
        return {}
    import yaml  # vLLM's dependency

    try:
        settings = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as error:
        raise ValueError(f"--config {path}: cannot read it ({error.strerror})") from None
    except yaml.YAMLError as error:  # its position only: the message would quote the line, an API key perhaps
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(
            f"--config {path}: not valid YAML{where} ({getattr(error, 'problem', None)})"
        ) from None
    if not isinstance(settings, dict):
        raise ValueError(f"--config {path}: expected option: value lines (a YAML mapping)")
    return {str(key).replace("_", "-"): value for key, value in settings.items()}


def workers(options: list[str]) -> tuple[int, int]:
    """``(processes, shards)``: how many engine workers vLLM starts (tensor x data parallel), and in how many shards
    each model's K/V is split among them (tensor parallel: the heads). ``ValueError`` for pipeline parallelism,
    which the SwiftKV model does not take (its layers >= l read one input: they are not a pipeline's stages)."""
    tp, pp, dp = (
        option_int(options, long, short) or 1
        for long, short in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp"),
                            ("--data-parallel-size", "-dp"))
    )  # fmt: skip
    if pp > 1:
        raise ValueError(
            f"--pipeline-parallel-size {pp}: SwiftKV models do not support pipeline parallelism; use "
            "--tensor-parallel-size or --data-parallel-size."
        )
    return tp * dp, tp


def option_int(options: list[str], name: str, *aliases: str) -> int | None:
    """``option_value`` as an integer, written as vLLM takes it (``4096``, ``4k`` = 4000, ``4K`` = 4096, ``1G``);
    ``None`` when not given or ``auto`` / ``-1`` (vLLM's choice)."""
    value = option_value(options, name, *aliases)
    if value is None or value.strip() in ("auto", "-1"):
        return None
    number, suffix = value.strip(), ""
    if number and number[-1] in _SUFFIXES:  # "": no number
        number, suffix = number[:-1], number[-1]
    try:
        return int(float(number) * _SUFFIXES[suffix]) if suffix.islower() else int(number) * _SUFFIXES[suffix]
    except ValueError:
        raise ValueError(f"{name} {value}: not a number (e.g. 4096, 4k, 4K)") from None


_SUFFIXES = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
}
