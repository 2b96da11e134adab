"""SwiftKV models for vLLM's V1 engine, built from vLLM's own layers (so tensor parallelism works).

Forward over the tokens scheduled in one step (prefill chunks and decodes mixed):

    h = embed(tokens)
    for i < l:  h = layer_i(h)                         # vLLM's own Llama / Qwen2 decoder layers
    x = norm_swiftkv(h)
    K, V = kv_proj_swiftkv(x)                          # ONE fused projection: K/V of every AcrossKV group
    write rope(K_G), V_G into the cache of each group leader G (all scheduled tokens)
    h' = h[logits_indices]                             # tokens whose logits are sampled (vLLM fast prefill)
    for j >= l: h' = layer_j(h')                       # query from q_proj_swiftkv, K/V read from the cache
    h[logits_indices] = norm(h')                       # put back in place; other rows are never read

The subset comes from vLLM's fast-prefill machinery for KV-sharing models (``kv_sharing_fast_prefill``,
switched on by ``swiftkv_serve.engine_config``): the attention layers ``>= l`` use
``create_fast_prefill_custom_backend``, so their metadata covers only those tokens. With the flag off the same
code runs layers ``>= l`` for every token (exact, no saving).

torch.compile (vLLM's default mode): two compile units, as in vLLM's Gemma3n. ``SwiftKVSelfDecoder`` covers
everything up to the cache writes (all scheduled tokens), ``SwiftKVCrossDecoder`` layers ``>= l`` and the final
norm; the gather (into fixed buffers) and the scatter back run eagerly between them, since the number of sampled
tokens is only known at run time. The cache writes' results are outputs of the first unit and inputs
(``kv_cache_dummy_dep``) of the second, so inductor cannot drop them.

AcrossKV: the non-leader layers of a group are built with ``kv_sharing_target_layer_name`` = the leader's
attention, so vLLM allocates no cache for them. The teacher q/k/v of layers ``>= l`` are never allocated;
``load_weights`` skips them when a checkpoint (the published format) carries them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import (
    unified_attention_with_output,
    unified_kv_cache_update,
)
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaMLP
from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer, Qwen2MLP
from vllm.model_executor.models.utils import extract_layer_index
from vllm.sequence import IntermediateTensors
from vllm.transformers_utils.config import set_default_rope_theta
from vllm.utils.torch_utils import _encode_layer_name
from vllm.v1.attention.backends.utils import KVSharingFastPrefillMetadata, create_fast_prefill_custom_backend
from vllm.v1.attention.selector import get_attn_backend

logger = init_logger(__name__)

# checkpoint name -> (vLLM parameter, shard) for the layers that keep their original attention (< l)
_STACKED = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_SWIFTKV_KV = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_proj_swiftkv\.(weight|bias)$")
_TEACHER_QKV = re.compile(r"^model\.layers\.(\d+)\.self_attn\.[qkv]_proj\.")


class _Family:
    """What differs between Llama and Qwen2 (everything else is shared)."""

    def __init__(self, config, name: str):
        self.name = name
        if name == "qwen2":
            set_default_rope_theta(config, default_theta=1000000)
            self.qkv_bias, self.o_bias, self.mlp_bias = True, False, False
            self.max_position = config.max_position_embeddings
        else:
            self.qkv_bias = bool(getattr(config, "attention_bias", False) or getattr(config, "bias", False))
            self.o_bias = self.qkv_bias
            self.mlp_bias = bool(getattr(config, "mlp_bias", False))
            self.max_position = getattr(config, "max_position_embeddings", 8192)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def base_layer(self, vllm_config: VllmConfig, prefix: str) -> nn.Module:
        if self.name == "qwen2":
            return Qwen2DecoderLayer(
                vllm_config.model_config.hf_config,
                vllm_config.cache_config,
                vllm_config.quant_config,
                prefix=prefix,
            )
        return LlamaDecoderLayer(vllm_config=vllm_config, prefix=prefix)

    def mlp(self, config, quant_config, prefix: str) -> nn.Module:
        if self.name == "qwen2":
            return Qwen2MLP(
                config.hidden_size,
                config.intermediate_size,
                config.hidden_act,
                quant_config=quant_config,
                prefix=prefix,
            )
        return LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            quant_config=quant_config,
            bias=self.mlp_bias,
            prefix=prefix,
        )


def _attend(
    attn: Attention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache_dummy_dep: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of ``query`` over the cache only (this layer's K/V were written before, for all tokens).

    ``kv_cache_dummy_dep`` is the result of the cache write: passing it keeps torch.compile from reordering
    or dropping the write (see vLLM's ``Attention.forward``).
    """
    output = torch.empty(
        (query.shape[0], attn.num_heads * attn.head_size), dtype=query.dtype, device=query.device
    )
    args = (
        query.view(-1, attn.num_heads, attn.head_size),
        key,
        value,
        output.view(-1, attn.num_heads, attn.head_size),
    )
    if attn.use_direct_call:
        unified_attention_with_output(*args, attn.layer_name, kv_cache_dummy_dep=kv_cache_dummy_dep)
    else:
        torch.ops.vllm.unified_attention_with_output(
            *args, _encode_layer_name(attn.layer_name), kv_cache_dummy_dep=kv_cache_dummy_dep
        )
    return output


def _write_kv(attn: Attention, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Write ``key``/``value`` (all scheduled tokens) into ``attn``'s cache; returns the ordering token."""
    if attn.use_direct_call:
        return unified_kv_cache_update(key, value, attn.layer_name)
    return torch.ops.vllm.unified_kv_cache_update(key, value, _encode_layer_name(attn.layer_name))


class SwiftKVAttention(nn.Module):
    """Attention of a layer ``j >= l``: its own query (``q_proj_swiftkv``), the K/V of its AcrossKV group."""

    def __init__(self, vllm_config: VllmConfig, family: _Family, rotary_emb: nn.Module, prefix: str):
        super().__init__()
        config, cache_config, quant_config = (
            vllm_config.model_config.hf_config,
            vllm_config.cache_config,
            vllm_config.quant_config,
        )
        layer_idx = extract_layer_index(prefix)
        tp_size = get_tensor_model_parallel_world_size()
        self.head_dim = family.head_dim
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.num_key_value_heads // tp_size
        self.q_proj_swiftkv = ColumnParallelLinear(
            config.hidden_size,
            config.num_attention_heads * self.head_dim,
            bias=family.qkv_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.q_proj_swiftkv",
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=family.o_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = rotary_emb

        leader = config.kv_group_leader(layer_idx)
        # AcrossKV: every non-leader layer of a group reads the leader's cache and owns none.
        target = (
            None
            if leader == layer_idx
            else prefix.replace(f"layers.{layer_idx}.", f"layers.{leader}.") + ".attn"
        )
        kv_cache_dtype = cache_config.cache_dtype if cache_config is not None else "auto"
        backend = get_attn_backend(self.head_dim, torch.get_default_dtype(), kv_cache_dtype)
        if backend.forward_includes_kv_cache_update:
            raise NotImplementedError(
                f"SwiftKV needs an attention backend that writes the KV cache separately from attention; "
                f"{backend.get_name()} does both in one kernel. Choose another backend (e.g. FLASH_ATTN)."
            )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
            kv_sharing_target_layer_name=target,
            # Fast prefill: with kv_sharing_fast_prefill on, this layer's metadata covers only the tokens whose
            # logits are needed; without it the metadata is the usual one.
            attn_backend=create_fast_prefill_custom_backend("SwiftKV", backend),
        )

    def forward(self, positions, hidden_states, key, value, kv_cache_dummy_dep):
        query, _ = self.q_proj_swiftkv(hidden_states)
        query, _ = self.rotary_emb(positions, query, None)
        output, _ = self.o_proj(_attend(self.attn, query, key, value, kv_cache_dummy_dep))
        return output


class SwiftKVDecoderLayer(nn.Module):
    """A layer ``j >= l``: the base layer with SwiftKV attention (same norms and MLP weights)."""

    def __init__(self, vllm_config: VllmConfig, family: _Family, rotary_emb: nn.Module, prefix: str):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.self_attn = SwiftKVAttention(vllm_config, family, rotary_emb, prefix=f"{prefix}.self_attn")
        self.mlp = family.mlp(config, vllm_config.quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual, key, value, kv_cache_dummy_dep):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, key, value, kv_cache_dummy_dep)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


_TOKEN_DIMS = {"positions": 0, "hidden_states": 0, "kv": 0}


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0})
class SwiftKVSelfDecoder(nn.Module):
    """Compiled unit 1, every scheduled token: embeddings, layers ``< l``, ``norm_swiftkv``, the fused K/V
    projection of every AcrossKV group, RoPE on K, and the cache writes of the group leaders.

    Returns the residual stream entering layer ``l``, the rotated K and V (``[tokens, 2 * G * kv_size]``) and the
    write results (one per group). Returning the write results keeps torch.compile from dropping the writes
    (their op declares no mutation); the cross-decoder passes them to attention as ``kv_cache_dummy_dep``.
    With ``l == L`` it is the whole model and returns the final hidden states.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", model: SwiftKVModel):
        super().__init__()
        self.embed_tokens = model.embed_tokens
        self.layers = model.layers[: model.num_kv_layers]
        self.num_groups, self.kv_size = model.num_groups, model.kv_size
        if self.num_groups:
            self.norm_swiftkv, self.kv_proj_swiftkv = model.norm_swiftkv, model.kv_proj_swiftkv
            self.rotary_emb = model.rotary_emb
            self.leaders = [
                model.layers[model.num_kv_layers + g * model.group_size].self_attn.attn
                for g in range(self.num_groups)
            ]
            self.head_dim = model.layers[model.num_kv_layers].self_attn.head_dim
        else:
            self.norm = model.norm

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ):
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        if not self.num_groups:  # l == L: a plain Llama / Qwen2
            hidden, _ = self.norm(hidden, residual)
            return hidden
        # The residual stream entering layer l, and the single input of every later K/V.
        swiftkv_input, stream = self.norm_swiftkv(hidden, residual)
        kv, _ = self.kv_proj_swiftkv(swiftkv_input)
        keys, values = kv.split(self.num_groups * self.kv_size, dim=-1)
        keys, _ = self.rotary_emb(positions, keys, None)  # the same positions (and RoPE) in every layer
        num_tokens = kv.shape[0]
        deps = []
        for group, leader in enumerate(self.leaders):
            cols = slice(group * self.kv_size, (group + 1) * self.kv_size)
            deps.append(
                _write_kv(
                    leader,
                    keys[:, cols].view(num_tokens, -1, self.head_dim),
                    values[:, cols].reshape(num_tokens, -1, self.head_dim),
                )
            )
        return stream, torch.cat([keys, values], dim=-1), *deps


@support_torch_compile(dynamic_arg_dims=_TOKEN_DIMS)
class SwiftKVCrossDecoder(nn.Module):
    """Compiled unit 2: layers ``>= l`` and the final norm, for the tokens whose logits are sampled (or all)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", model: SwiftKVModel):
        super().__init__()
        self.layers = model.layers[model.num_kv_layers :]
        self.norm = model.norm
        self.num_groups, self.kv_size, self.group_size = model.num_groups, model.kv_size, model.group_size
        self.head_dim = model.layers[model.num_kv_layers].self_attn.head_dim

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, kv: torch.Tensor, deps: list[torch.Tensor]
    ) -> torch.Tensor:
        num_tokens = kv.shape[0]
        keys, values = kv.split(self.num_groups * self.kv_size, dim=-1)
        hidden, residual = hidden_states, None
        for j, layer in enumerate(self.layers):
            group = j // self.group_size
            cols = slice(group * self.kv_size, (group + 1) * self.kv_size)
            hidden, residual = layer(
                positions,
                hidden,
                residual,
                keys[:, cols].reshape(num_tokens, -1, self.head_dim),
                values[:, cols].reshape(num_tokens, -1, self.head_dim),
                deps[group],
            )
        hidden, _ = self.norm(hidden, residual)
        return hidden


class SwiftKVModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, family: _Family, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        if get_pp_group().world_size > 1:
            raise NotImplementedError(
                "SwiftKV models do not support pipeline parallelism; use tensor parallelism."
            )
        tp_size = get_tensor_model_parallel_world_size()
        if config.num_key_value_heads % tp_size or config.num_attention_heads % tp_size:
            raise ValueError(
                f"tensor_parallel_size={tp_size} must divide num_attention_heads={config.num_attention_heads} "
                f"and num_key_value_heads={config.num_key_value_heads} for a SwiftKV model."
            )
        config.validate_swiftkv()
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_kv_layers = config.num_key_value_layers
        self.group_size = config.key_value_group_size
        self.num_groups = (self.num_layers - self.num_kv_layers) // self.group_size
        self.kv_size = config.num_key_value_heads // tp_size * family.head_dim  # per group, on this rank

        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, quant_config=quant_config
        )
        rotary_emb = get_rope(
            family.head_dim,
            max_position=family.max_position,
            rope_parameters=getattr(config, "rope_parameters", None),
            is_neox_style=True,
        )

        def make_layer(layer_prefix: str) -> nn.Module:
            if extract_layer_index(layer_prefix) < self.num_kv_layers:
                return family.base_layer(vllm_config, layer_prefix)
            return SwiftKVDecoderLayer(vllm_config, family, rotary_emb, layer_prefix)

        self.layers = nn.ModuleList(make_layer(f"{prefix}.layers.{i}") for i in range(self.num_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_swiftkv = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if self.num_groups:
            self.rotary_emb = rotary_emb
            # K of every group, then V of every group: [K_0 .. K_{G-1}, V_0 .. V_{G-1}], one matmul.
            self.kv_proj_swiftkv = MergedColumnParallelLinear(
                config.hidden_size,
                [config.num_key_value_heads * family.head_dim] * (2 * self.num_groups),
                bias=family.qkv_bias,
                quant_config=quant_config,
                prefix=f"{prefix}.kv_proj_swiftkv",
            )
        # Two torch.compile units (vLLM's default mode; eager with enforce_eager), as in vLLM's Gemma3n: the gather
        # of the sampled tokens between them has a data-dependent size. They hold references to the modules
        # above (registered after them, so parameter names are unchanged).
        from vllm.compilation.backends import set_model_tag

        with set_model_tag("swiftkv_self_decoder"):
            self.self_decoder = SwiftKVSelfDecoder(
                vllm_config=vllm_config, prefix=f"{prefix}.self_decoder", model=self
            )
        if self.num_groups:
            with set_model_tag("swiftkv_cross_decoder"):
                self.cross_decoder = SwiftKVCrossDecoder(
                    vllm_config=vllm_config, prefix=f"{prefix}.cross_decoder", model=self
                )
            # Fixed inputs of the cross-decoder for the gathered tokens (stable addresses, as Gemma3n keeps them
            # for CUDA graphs); at most max_num_batched_tokens rows.
            max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
            weight = self.embed_tokens.weight
            self._sub_positions = torch.zeros(max_tokens, dtype=torch.int64, device=weight.device)
            self._sub_hidden = torch.zeros(
                max_tokens, config.hidden_size, dtype=weight.dtype, device=weight.device
            )
            self._sub_kv = torch.zeros(
                max_tokens, 2 * self.num_groups * self.kv_size, dtype=weight.dtype, device=weight.device
            )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def group_index(self, layer_idx: int) -> int:
        return (layer_idx - self.num_kv_layers) // self.group_size

    def forward(self, input_ids, positions, inputs_embeds=None) -> torch.Tensor:
        if not self.num_groups:  # l == L: a plain Llama / Qwen2
            return self.self_decoder(input_ids, positions, inputs_embeds)
        stream, kv, *deps = self.self_decoder(input_ids, positions, inputs_embeds)
        logits_indices, num_logits = self._logits_indices(kv.shape[0])
        if logits_indices is None:
            return self.cross_decoder(positions, stream, kv, deps)
        # Gather the tokens whose logits are sampled into the fixed buffers, run layers >= l on them only.
        n = logits_indices.shape[0]
        self._sub_positions[:n].copy_(positions[logits_indices])
        self._sub_hidden[:n].copy_(stream[logits_indices])
        self._sub_kv[:n].copy_(kv[logits_indices])
        hidden = self.cross_decoder(self._sub_positions[:n], self._sub_hidden[:n], self._sub_kv[:n], deps)
        # Back in place: only the logits rows are ever read; the others keep the (unused) residual stream.
        # (A copy, not the compiled unit's own output buffer, as Gemma3n does.)
        stream = stream.clone()
        stream[logits_indices[:num_logits]] = hidden[:num_logits]
        return stream

    def _logits_indices(self, num_tokens: int) -> tuple[torch.Tensor | None, int | None]:
        """The tokens layers ``>= l`` run for in this step (``None``: all of them)."""
        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):  # profiling / dummy runs
            return None, None
        metadata = attn_metadata.get(self.layers[self.num_kv_layers].self_attn.attn.layer_name)
        if not isinstance(metadata, KVSharingFastPrefillMetadata) or metadata.logits_indices_padded is None:
            return None, None
        if metadata.num_logits_indices == num_tokens:
            # Every scheduled token needs its logits (pure decode): the metadata is the full one, no gather.
            return None, None
        return metadata.logits_indices_padded, metadata.num_logits_indices

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named weights (prefix ``model.``); returns the vLLM parameter names that were loaded."""
        params = dict(self.named_parameters(prefix="model"))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            layer = _LAYER.match(name)
            layer_idx = int(layer.group(1)) if layer else None
            if (match := _SWIFTKV_KV.match(name)) is not None:
                if self.config.kv_group_leader(layer_idx) != layer_idx:
                    raise ValueError(
                        f"{name}: layer {layer_idx} is not the first layer of its AcrossKV group "
                        f"(key_value_group_size={self.group_size}); the config and weights disagree."
                    )
                shard = self.group_index(layer_idx) + (self.num_groups if match.group(2) == "v" else 0)
                target = f"model.kv_proj_swiftkv.{match.group(3)}"
                params[target].weight_loader(params[target], tensor, shard)
                loaded.add(target)
                continue
            if _TEACHER_QKV.match(name) and layer_idx >= self.num_kv_layers:
                continue  # the teacher's projections: the SwiftKV forward never uses them
            for param_part, weight_part, shard in _STACKED:
                if weight_part in name and "_swiftkv" not in name:
                    target = name.replace(weight_part, param_part)
                    params[target].weight_loader(params[target], tensor, shard)
                    break
            else:
                target = name
                if target not in params:
                    raise ValueError(
                        f"Unexpected weight {name!r} in a SwiftKV checkpoint (num_hidden_layers="
                        f"{self.num_layers}, num_key_value_layers={self.num_kv_layers}, "
                        f"key_value_group_size={self.group_size})."
                    )
                param = params[target]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target)
        return loaded


class SwiftKVForCausalLM(nn.Module):
    family: str

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        family = _Family(config, self.family)
        self.model = SwiftKVModel(vllm_config=vllm_config, family=family, prefix="model")
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config, prefix="lm_head"
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size, scale=getattr(config, "logit_scale", 1.0))
        if self.model.num_groups and not vllm_config.cache_config.kv_sharing_fast_prefill:
            logger.warning(
                "SwiftKV: kv_sharing_fast_prefill is off, so layers >= %d run for every prompt token (outputs are "
                "exact, the prefill saving is lost). The swiftkv_serve plugin turns it on unless it was overridden.",
                self.model.num_kv_layers,
            )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        model_weights = []
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("lm_head."):
                if self.config.tie_word_embeddings:
                    continue  # tied to embed_tokens
                param = self.lm_head.weight
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
            else:
                model_weights.append((name, tensor))
        return loaded | self.model.load_weights(model_weights)


class LlamaSwiftKVForCausalLM(SwiftKVForCausalLM):
    family = "llama"


class Qwen2SwiftKVForCausalLM(SwiftKVForCausalLM):
    family = "qwen2"
