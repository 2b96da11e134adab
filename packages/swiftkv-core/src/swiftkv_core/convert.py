"""Turn a HF Llama / Qwen2 / Mistral model into a SwiftKV model, and write SwiftKV checkpoints atomically."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from .atomic import CLAIM, atomic_directory
from .configuration import LlamaSwiftKVConfig, Qwen2SwiftKVConfig
from .modeling import LORA_SUFFIX, LlamaSwiftKVForCausalLM, LowRankAdapter, Qwen2SwiftKVForCausalLM
from .weights import is_teacher_projection, swiftkv_parameter_names, train_only_swiftkv

# base model_type -> (SwiftKV config, SwiftKV model)
FAMILIES = {
    "llama": (LlamaSwiftKVConfig, LlamaSwiftKVForCausalLM),
    "mistral": (LlamaSwiftKVConfig, LlamaSwiftKVForCausalLM),
    "qwen2": (Qwen2SwiftKVConfig, Qwen2SwiftKVForCausalLM),
}
SWIFTKV_FAMILIES = {"llama_swiftkv", "qwen2_swiftkv"}


def swiftkv_config_from(
    base_config, num_key_value_layers: int, key_value_group_size: int = 1, swiftkv: bool = True
):
    """The SwiftKV config for ``base_config`` (a Llama, Mistral or Qwen2 config)."""
    family = base_config.model_type
    if family not in FAMILIES:
        raise ValueError(
            f"Unknown architecture model_type={family!r}: convert supports {sorted(FAMILIES)} "
            f"(architectures LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)."
        )
    values = base_config.to_dict()
    if family == "mistral":
        if values.get("sliding_window") is not None:
            raise ValueError(
                f"This Mistral checkpoint uses sliding_window={values['sliding_window']}: SwiftKV models attend "
                "over the full context. Set sliding_window to null in config.json if the model was trained without it."
            )
        values.pop("sliding_window", None)
    for key in ("model_type", "architectures", "transformers_version", "auto_map"):
        values.pop(key, None)
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(
        **values,
        swiftkv=swiftkv,
        num_key_value_layers=num_key_value_layers,
        key_value_group_size=key_value_group_size,
    )
    config.architectures = [model_cls.__name__]
    return config


@torch.no_grad()
def convert(
    model: PreTrainedModel | str | os.PathLike,
    num_key_value_layers: int,
    key_value_group_size: int = 1,
    dtype: torch.dtype | None = None,
) -> PreTrainedModel:
    """A SwiftKV model from a HF ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` (or a path).

    Initialised by the published recipe: ``norm_swiftkv`` <- ``layers[l].input_layernorm``, each
    ``q_proj_swiftkv`` <- its ``q_proj``, each group's ``k/v_proj_swiftkv`` <- mean of the group's ``k/v_proj``.
    The base weights are shared with ``model`` (no copy) and frozen; exactly the SwiftKV parameters require grad.
    The result has ``swiftkv`` on; ``model.swiftkv(False)`` gives the original model back.
    """
    if not isinstance(model, PreTrainedModel):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype or torch.float32)
    config = swiftkv_config_from(model.config, num_key_value_layers, key_value_group_size)
    config._attn_implementation = model.config._attn_implementation
    _, model_cls = FAMILIES[model.config.model_type]
    base_state = model.state_dict()
    dtype = next(model.parameters()).dtype

    with torch.device("meta"):
        swift = model_cls(config)
    missing, unexpected = swift.load_state_dict(base_state, strict=False, assign=True)
    if unexpected:
        raise ValueError(f"The base model has weights the SwiftKV model does not expect: {unexpected[:5]}")
    swiftkv_names = set(swiftkv_parameter_names(swift))
    not_loaded = [n for n in missing if n not in swiftkv_names and not n.endswith("lm_head.weight")]
    if not_loaded:
        raise ValueError(f"The base model lacks weights the SwiftKV model needs: {not_loaded[:5]}")
    # RoPE's frequencies are non-persistent buffers, not in the state dict: computed anew, in fp32 (a base cast with
    # .to(torch.bfloat16) carries them rounded, see SwiftKVModelMixin._apply)
    with torch.device(model.model.rotary_emb.inv_freq.device):
        swift.model.rotary_emb = swift.model.rotary_class(config=config)
    if config.tie_word_embeddings:
        swift.lm_head.weight = swift.model.embed_tokens.weight

    layers = swift.model.layers
    l, L, g = config.num_key_value_layers, config.num_hidden_layers, config.key_value_group_size

    def new(t: torch.Tensor) -> nn.Parameter:
        return torch.nn.Parameter(t.detach().clone().to(dtype))

    # With l == L no layer reads norm_swiftkv; it is still written, as in published checkpoints.
    norm_init = layers[l].input_layernorm.weight if l < L else torch.ones_like(model.model.norm.weight)
    swift.model.norm_swiftkv.weight = new(norm_init)
    for j in range(l, L):
        attn = layers[j].self_attn
        attn.q_proj_swiftkv.weight = new(attn.q_proj.weight)
        if attn.q_proj.bias is not None:
            attn.q_proj_swiftkv.bias = new(attn.q_proj.bias)
        if config.kv_group_leader(j) == j:
            group = [layers[i].self_attn for i in range(j, j + g)]
            for name in ("k_proj", "v_proj"):
                target = getattr(attn, f"{name}_swiftkv")
                target.weight = new(torch.stack([getattr(a, name).weight for a in group]).mean(0))
                if getattr(attn, name).bias is not None:
                    target.bias = new(torch.stack([getattr(a, name).bias for a in group]).mean(0))

    train_only_swiftkv(swift)
    leftover = [n for n, p in list(swift.named_parameters()) + list(swift.named_buffers()) if p.is_meta]
    # a model on the meta device converts to one (its sizes, for a run's memory check)
    if leftover and not next(model.parameters()).is_meta:
        raise RuntimeError(f"convert left tensors uninitialised (a bug): {leftover[:5]}")
    swift.generation_config = model.generation_config
    swift.eval()
    return swift


def check_checkpoint_folder(folder: str | os.PathLike, what: str = "out_dir") -> None:
    """Refuse a ``folder`` that writing a checkpoint there would lose (``what``: how the user named it): the
    checkpoint replaces the whole folder, so it must be new, empty or an earlier checkpoint (a ``config.json``)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{what} {folder} is a file: give a folder path for the checkpoint.")
    others = folder.is_dir() and any(p.name != CLAIM for p in folder.iterdir())  # (a staging folder's claim)
    if others and not (folder / "config.json").is_file():
        raise ValueError(
            f"{what} {folder} holds files and is not a checkpoint folder (no config.json); the checkpoint "
            "replaces the whole folder: give a new folder, or a checkpoint folder to overwrite."
        )


def save_checkpoint(
    model: PreTrainedModel, out_dir: str | os.PathLike, tokenizer=None, serving: bool = False
) -> Path:
    """Write ``model`` (config + safetensors, and ``tokenizer`` if given) to ``out_dir`` atomically.

    Everything is written into a temporary folder beside ``out_dir`` and renamed into place at the end, so a
    failure leaves an earlier checkpoint at ``out_dir`` intact. The new folder replaces the whole of ``out_dir``:
    one that holds other files is refused (``check_checkpoint_folder``). ``serving=True`` leaves out the teacher
    q/k/v of layers ``>= l``, merges the adapters of a ``lora_rank > 0`` model into the weights they adapt, and
    marks the config ``serving_only`` (see ``export_for_serving``).
    """
    config = model.config
    if serving and config.model_type not in SWIFTKV_FAMILIES:
        raise ValueError(f"export_for_serving needs a SwiftKV model, got model_type={config.model_type!r}.")
    check_checkpoint_folder(out_dir)
    with atomic_directory(out_dir) as staging:
        if serving:  # SwiftKV on, no teacher q/k/v, and a config that says so
            state_dict = {
                k: v
                for k, v in lora_merged_state_dict(model).items()
                if not is_teacher_projection(k, config.num_key_value_layers)
            }
            was = config.serving_only, config.lora_rank, config.lora_prefix
            with model.swiftkv_mode(True):
                config.serving_only, config.lora_rank, config.lora_prefix = True, 0, False
                try:
                    model.save_pretrained(staging, state_dict=state_dict)
                finally:
                    config.serving_only, config.lora_rank, config.lora_prefix = was
        else:
            model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return out_dir


@torch.no_grad()
def lora_merged_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every adapter merged into the weight it adapts (``W + B A``, computed in fp32)
    and the adapters left out: the weights the SwiftKV forward computes with, as ordinary weights (what the
    teacher computed with is lost: a serving export runs SwiftKV only)."""
    state = model.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, LowRankAdapter):
            target = name.removesuffix(LORA_SUFFIX) + ".weight"
            weight = state[target]
            state[target] = (weight.float() + module.delta().float()).to(weight.dtype)
            del state[f"{name}.lora_a"], state[f"{name}.lora_b"]
    return state


def export_for_serving(model: PreTrainedModel, out_dir: str | os.PathLike, tokenizer=None) -> Path:
    """Write a serving checkpoint: no teacher q/k/v for layers ``>= l`` (smaller), adapters merged (the published
    format), loads with SwiftKV on."""
    if not getattr(model.config, "swiftkv", True):
        raise ValueError(
            "export_for_serving writes a SwiftKV-only checkpoint, but the model is in teacher mode "
            "(swiftkv=False). Call model.swiftkv(True) first, or use save_checkpoint() to keep the teacher."
        )
    return save_checkpoint(model, out_dir, tokenizer=tokenizer, serving=True)
