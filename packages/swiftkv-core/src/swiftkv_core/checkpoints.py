"""What a checkpoint folder is, read from its ``config.json`` before any weight loads: the one place that checks a
model's family and its ``(l, g)``, and says what makes a folder this model (for caches and resumed runs)."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict
from pathlib import Path

from .configuration import validate_layers
from .convert import FAMILIES, SWIFTKV_FAMILIES, check_checkpoint_folder
from .default_model import resolve_model_path

KINDS = ("base", "swiftkv", "any")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message names the folder and the fix."""


def read_config(model: str | os.PathLike):
    """``(path, config)`` of ``model`` (``"default"``, a ``.gguf`` file or a HF folder), SwiftKV configs known."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        path = resolve_model_path(model)
        return path, AutoConfig.from_pretrained(path)
    except (OSError, ValueError, StrictDataclassError) as error:
        # transformers' config checks (ours among them) raise their ValueError wrapped in a StrictDataclassError
        reason = error.__cause__ if isinstance(error, StrictDataclassError) and error.__cause__ else error
        raise CheckpointError(f"{model}: {reason}") from None


def check_checkpoint(
    model: str | os.PathLike,
    num_key_value_layers: int | None = None,
    key_value_group_size: int = 1,
    kind: str = "any",
):
    """``(path, config)`` of ``model`` after checking that it is of a supported family and ``kind`` (``"base"``:
    a Llama / Mistral / Qwen2 checkpoint to convert; ``"swiftkv"``: a SwiftKV one; ``"any"``: either), and, given
    ``num_key_value_layers``, that ``(l, g)`` fit it (``validate_layers``; ``l == L`` refused: nothing would be
    skipped) and equal a SwiftKV checkpoint's own. Raises ``CheckpointError`` saying what to do instead."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
    path, config = read_config(model)
    check_weight_files(path)
    family = config.model_type
    allowed = {"base": set(FAMILIES), "swiftkv": SWIFTKV_FAMILIES, "any": set(FAMILIES) | SWIFTKV_FAMILIES}[
        kind
    ]
    if family not in allowed:
        if kind == "base" and family in SWIFTKV_FAMILIES:
            fix = "give its base model (the original checkpoint), not a SwiftKV one"
        elif kind == "swiftkv" and family in FAMILIES:
            fix = "convert it first (`swiftkv convert`)"
        else:
            fix = (
                f"SwiftKV supports the families {sorted(FAMILIES)} (LlamaForCausalLM, MistralForCausalLM, "
                "Qwen2ForCausalLM) and their SwiftKV checkpoints"
            )
        raise CheckpointError(f"{model}: model_type={family!r} is not supported here: {fix}.")
    if num_key_value_layers is None:
        return path, config
    try:
        validate_layers(
            config.num_hidden_layers, num_key_value_layers, key_value_group_size, allow_no_skip=False
        )
    except ValueError as error:
        raise CheckpointError(f"{model}: {error}") from None
    if family in SWIFTKV_FAMILIES and (config.num_key_value_layers, config.key_value_group_size) != (
        num_key_value_layers,
        key_value_group_size,
    ):
        raise CheckpointError(
            f"{path} is a SwiftKV checkpoint with num_key_value_layers={config.num_key_value_layers}, "
            f"key_value_group_size={config.key_value_group_size}; asked for {num_key_value_layers}, "
            f"{key_value_group_size}. Give those values, or its base model to convert anew."
        )
    return path, config


def check_weight_files(path: Path) -> None:
    """Raise ``CheckpointError`` for a ``*.safetensors`` file that is not whole (cut off by a failed copy or a
    killed write): its header must parse and its data must reach the end its header names. Reads headers only."""
    for file in sorted(Path(path).glob("*.safetensors")):
        size, end = file.stat().st_size, _safetensors_end(file)
        if end is None or end > size:
            whole = f" of {end:,}" if end else ", its header unreadable"
            raise CheckpointError(
                f"{file}: the weights file is not whole ({size:,} bytes{whole}): copy it again, or export the "
                "checkpoint again."
            )


def _safetensors_header(file: Path) -> tuple[int, dict] | None:
    """``(header bytes, header)`` of a safetensors file, its tensors' entries only; ``None`` if the header is cut."""
    try:
        with file.open("rb") as f:
            header_bytes = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_bytes))
    except (OSError, ValueError):
        return None
    return header_bytes, {key: entry for key, entry in header.items() if key != "__metadata__"}


def _safetensors_end(file: Path) -> int | None:
    """The byte where a safetensors file's last tensor ends, from its header; ``None`` if the header is cut."""
    if (read := _safetensors_header(file)) is None:
        return None
    header_bytes, tensors = read
    return 8 + header_bytes + max((entry["data_offsets"][1] for entry in tensors.values()), default=0)


SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def stored_dtype(model: str | os.PathLike):
    """The one floating-point dtype every weight of ``model`` (as ``read_config`` names it) is stored in, from the
    safetensors headers of its weight files alone (those ``from_pretrained`` reads: not an early-exit head beside
    them); a ``torch.dtype``, or ``None`` where they are of several (an export's bf16 teacher and fp32 trained
    weights), of another (fp8, fp64), not in safetensors files, or ``model`` names no checkpoint."""
    import torch

    if (entries := _weight_entries(model)) is None:
        return None
    found = {entry["dtype"] for entry in entries if entry["dtype"] not in ("I64", "I32", "BOOL")}
    name = SAFETENSORS_DTYPES.get(found.pop()) if len(found) == 1 else None
    return getattr(torch, name) if name else None


def stored_parameter_count(model: str | os.PathLike) -> int | None:
    """How many numbers the weight files of ``model`` hold (those ``from_pretrained`` reads), from their safetensors
    headers alone; ``None`` where they are not safetensors files or ``model`` names no checkpoint."""
    if (entries := _weight_entries(model)) is None:
        return None
    return sum(math.prod(entry["shape"]) for entry in entries)


def _weight_entries(model: str | os.PathLike) -> list[dict] | None:
    """The safetensors header entries (dtype, shape, offsets) of the weight files ``from_pretrained`` reads for
    ``model`` (the index's files, or ``model.safetensors``); ``None`` where there are none or one is unreadable."""
    try:
        path = resolve_model_path(model)
    except (OSError, ValueError):
        return None
    index = path / "model.safetensors.index.json"
    try:
        names = (
            set(json.loads(index.read_text())["weight_map"].values())
            if index.is_file()
            else {"model.safetensors"}
        )
    except (OSError, ValueError, KeyError, AttributeError):
        return None  # from_pretrained says what is wrong with the index
    entries = []
    for file in [path / name for name in sorted(names)]:
        read = _safetensors_header(file) if file.is_file() else None
        if read is None:
            return None
        entries += read[1].values()
    return entries


def check_swiftkv_version_of(swiftkv: str | os.PathLike, base: str | os.PathLike):
    """The config of ``swiftkv`` after checking that it is a SwiftKV checkpoint of ``base``'s family and shape."""
    from .flops import ModelShape

    _, config = check_checkpoint(swiftkv, kind="swiftkv")
    _, base_config = check_checkpoint(base, kind="base")
    if config.model_type != f"{base_config.model_type.replace('mistral', 'llama')}_swiftkv":
        raise CheckpointError(
            f"{swiftkv} is a {config.model_type} checkpoint; the base {base} is {base_config.model_type}."
        )
    shape, base_shape = asdict(ModelShape.from_config(config)), asdict(ModelShape.from_config(base_config))
    differ = [
        f"{key} {shape[key]} (base {base_shape[key]})" for key in shape if shape[key] != base_shape[key]
    ]
    if differ:
        raise CheckpointError(f"{swiftkv} is not a SwiftKV version of {base}: {', '.join(differ)}.")
    return config


def model_identity(path: str | os.PathLike) -> dict:
    """What makes a checkpoint folder this model: its resolved path, its config, and per weight file its size and a
    digest of samples of its bytes (``sampled_digest``). A model trained again in place keeps its files' sizes, and
    its digests change; the same bytes written again (a cache made anew, a seeded model rebuilt) keep them."""
    path = Path(path).resolve()
    weights = sorted(
        f
        for f in path.iterdir()
        if f.suffix in (".safetensors", ".bin", ".pt") or f.name.endswith(".index.json")
    )
    return {
        "path": str(path),
        "config_sha256": hashlib.sha256((path / "config.json").read_bytes()).hexdigest(),
        "weight_files": {
            f.name: {"bytes": f.stat().st_size, "sampled_sha256": sampled_digest(f)} for f in weights
        },
    }


def sampled_digest(path: Path, sample: int = 1 << 20, samples: int = 8) -> str:
    """sha256 of ``samples`` evenly spaced ``sample``-byte pieces of a file (all of it when it is that small): read
    in milliseconds even for a 140 GB checkpoint, and changed by any training of its weights (every tensor moves)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= sample * samples:
            digest.update(f.read())
        else:
            for i in range(samples):
                f.seek((size - sample) * i // (samples - 1))
                digest.update(f.read(sample))
    return digest.hexdigest()


def check_replaceable(folder: str | os.PathLike, model: str | os.PathLike, what: str) -> None:
    """Refuse, before any weight is read, a ``folder`` that writing a checkpoint there would lose (``what``: how the
    user named it): the checkpoint replaces the whole folder, so it must be new, empty or an earlier checkpoint,
    and neither be nor hold the model being read."""
    folder, model = Path(folder).resolve(), Path(model).resolve()
    if folder == model or folder in model.parents:
        raise ValueError(
            f"{what} {folder} is (or holds) the model being read, which writing there would replace: give "
            "another folder."
        )
    check_checkpoint_folder(folder, what)
