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
switched on by ``swiftkv_serve.engine_config``): the attention layers ``>= l`` use vLLM's fast-prefill backend
wrapper, so their metadata covers only those tokens. With the flag off (``swiftkv_fast_prefill: false``) the same
code runs layers ``>= l`` for every token (exact, no saving). The vLLM internals this takes (the wrapper, the
metadata, the separate cache-write and attention ops) are all in ``swiftkv_serve.vllm_internals``.

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

from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaMLP
from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, extract_layer_index
from vllm.sequence import IntermediateTensors
from vllm.transformers_utils.config import set_default_rope_theta

from swiftkv_core.weights import is_teacher_projection, match_swiftkv_kv

from . import ADAPTERS_KEPT_APART, plugin_logger
from .engine_config import fast_prefill_requested
from .vllm_internals import (
    attend,
    compile_unit_tag,
    fast_prefill_attention_backend,
    fast_prefill_logits_indices,
    with_shard_id,
    write_kv,
)

logger = plugin_logger(__name__)


class Biases(NamedTuple):
    """Which projections of a family's layers carry a bias."""

    qkv: bool
    o: bool
    mlp: bool


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class SwiftKVAttention(nn.Module):
    """Attention of a layer ``j >= l``: its own query (``q_proj_swiftkv``), the K/V of its AcrossKV group."""

    def __init__(self, vllm_config: VllmConfig, biases: Biases, rotary_emb: nn.Module, prefix: str):
        super().__init__()
        config, cache_config, quant_config = (
            vllm_config.model_config.hf_config,
            vllm_config.cache_config,
            vllm_config.quant_config,
        )
        layer_idx = extract_layer_index(prefix)
        tp_size = get_tensor_model_parallel_world_size()
        self.head_dim = head_dim(config)
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.num_key_value_heads // tp_size
        self.q_proj_swiftkv = ColumnParallelLinear(
            config.hidden_size,
            config.num_attention_heads * self.head_dim,
            bias=biases.qkv,
            quant_config=quant_config,
            prefix=f"{prefix}.q_proj_swiftkv",
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=biases.o,
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
            attn_backend=fast_prefill_attention_backend(self.head_dim, kv_cache_dtype),
        )

    def forward(self, positions, hidden_states, key, value, kv_cache_dummy_dep):
        query, _ = self.q_proj_swiftkv(hidden_states)
        query, _ = self.rotary_emb(positions, query, None)
        output, _ = self.o_proj(attend(self.attn, query, key, value, kv_cache_dummy_dep))
        return output


class SwiftKVDecoderLayer(nn.Module):
    """A layer ``j >= l``: the base layer with SwiftKV attention (same norms and MLP weights)."""

    def __init__(self, vllm_config: VllmConfig, biases: Biases, rotary_emb: nn.Module, prefix: str):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.self_attn = SwiftKVAttention(vllm_config, biases, rotary_emb, prefix=f"{prefix}.self_attn")
        # vLLM's Qwen2MLP is LlamaMLP without the bias option: one class serves both families.
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            quant_config=vllm_config.quant_config,
            bias=biases.mlp,
            prefix=f"{prefix}.mlp",
        )
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
        config = model.config
        self.embed_tokens = model.embed_tokens
        self.layers = model.layers[: config.num_key_value_layers]
        self.num_groups, self.kv_size = config.num_kv_groups, model.kv_size
        if self.num_groups:
            self.norm_swiftkv, self.kv_proj_swiftkv = model.norm_swiftkv, model.kv_proj_swiftkv
            self.rotary_emb = model.rotary_emb
            self.leaders = [model.layers[j].self_attn.attn for j in config.kv_group_leaders]
            self.head_dim = head_dim(config)
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
                write_kv(
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
        config = model.config
        l, L = config.num_key_value_layers, config.num_hidden_layers
        self.layers = model.layers[l:]
        self.groups = [config.kv_group_index(j) for j in range(l, L)]  # the AcrossKV group of each layer
        self.norm = model.norm
        self.num_groups, self.kv_size, self.head_dim = config.num_kv_groups, model.kv_size, head_dim(config)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, kv: torch.Tensor, deps: list[torch.Tensor]
    ) -> torch.Tensor:
        num_tokens = kv.shape[0]
        keys, values = kv.split(self.num_groups * self.kv_size, dim=-1)
        hidden, residual = hidden_states, None
        for group, layer in zip(self.groups, self.layers, strict=True):
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
    def __init__(
        self,
        *,
        vllm_config: VllmConfig,
        base_layer: Callable[[VllmConfig, str], nn.Module],
        biases: Biases,
        prefix: str = "",
    ):
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
        if config.lora_rank:
            raise ValueError(
                ADAPTERS_KEPT_APART.format(checkpoint="This checkpoint", lora_rank=config.lora_rank)
            )
        self.config = config
        num_groups = config.num_kv_groups
        self.kv_size = config.num_key_value_heads // tp_size * head_dim(config)  # per group, on this rank

        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, quant_config=quant_config
        )
        rotary_emb = get_rope(
            head_dim(config),
            max_position=config.max_position_embeddings,
            rope_parameters=getattr(config, "rope_parameters", None),
            is_neox_style=True,
        )

        def make_layer(layer_prefix: str) -> nn.Module:
            if config.is_swiftkv_layer(extract_layer_index(layer_prefix)):
                return SwiftKVDecoderLayer(vllm_config, biases, rotary_emb, layer_prefix)
            return base_layer(vllm_config, layer_prefix)

        self.layers = nn.ModuleList(
            make_layer(f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_swiftkv = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if num_groups:
            self.rotary_emb = rotary_emb
            # K of every group, then V of every group: [K_0 .. K_{G-1}, V_0 .. V_{G-1}], one matmul.
            self.kv_proj_swiftkv = MergedColumnParallelLinear(
                config.hidden_size,
                [config.num_key_value_heads * head_dim(config)] * (2 * num_groups),
                bias=biases.qkv,
                quant_config=quant_config,
                prefix=f"{prefix}.kv_proj_swiftkv",
            )
        # Two torch.compile units (vLLM's default mode; eager with enforce_eager), as in vLLM's Gemma3n: the gather
        # of the sampled tokens between them has a data-dependent size. They hold references to the modules
        # above (registered after them, so parameter names are unchanged).
        with compile_unit_tag("swiftkv_self_decoder"):
            self.self_decoder = SwiftKVSelfDecoder(
                vllm_config=vllm_config, prefix=f"{prefix}.self_decoder", model=self
            )
        if num_groups:
            with compile_unit_tag("swiftkv_cross_decoder"):
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
                max_tokens, 2 * num_groups * self.kv_size, dtype=weight.dtype, device=weight.device
            )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, inputs_embeds=None) -> torch.Tensor:
        if not self.config.num_kv_groups:  # l == L: a plain Llama / Qwen2
            return self.self_decoder(input_ids, positions, inputs_embeds)
        stream, kv, *deps = self.self_decoder(input_ids, positions, inputs_embeds)
        first_swiftkv_attn = self.layers[self.config.num_key_value_layers].self_attn.attn
        logits_indices, num_logits = fast_prefill_logits_indices(first_swiftkv_attn.layer_name, kv.shape[0])
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


def route_swiftkv_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config
) -> Iterator[tuple[str, torch.Tensor]]:
    """The SwiftKV part of loading, before vLLM's name mapping: drop the teacher q/k/v of layers ``>= l`` (never
    used to serve), send each group leader's ``k/v_proj_swiftkv`` to its shard of the fused ``kv_proj_swiftkv``
    (K of groups ``0..G-1``, then V), and refuse them on a layer that is not a group leader."""
    num_groups = config.num_kv_groups
    for name, tensor in weights:
        if is_teacher_projection(name, config.num_key_value_layers):
            continue
        if (match := match_swiftkv_kv(name)) is not None:
            layer, kind, param = match
            if config.kv_group_leader(layer) != layer:
                raise ValueError(
                    f"{name}: layer {layer} is not the first layer of its AcrossKV group "
                    f"(num_key_value_layers={config.num_key_value_layers}, key_value_group_size="
                    f"{config.key_value_group_size}); the config and weights disagree."
                )
            shard = config.kv_group_index(layer) + (num_groups if kind == "v" else 0)
            name, tensor = f"model.kv_proj_swiftkv.{param}", with_shard_id(tensor, shard)
        yield name, tensor


class SwiftKVForCausalLM(nn.Module):
    """The SwiftKV model of one family; a family is a subclass that says what differs (the attributes below)."""

    # HF checkpoint name -> vLLM's stacked parameter and shard. The names end in "." so that the SwiftKV
    # projections (q_proj_swiftkv, ...) are not taken for the teacher's.
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".q_proj.": (".qkv_proj.", "q"),
            ".k_proj.": (".qkv_proj.", "k"),
            ".v_proj.": (".qkv_proj.", "v"),
            ".gate_proj.": (".gate_up_proj.", 0),
            ".up_proj.": (".gate_up_proj.", 1),
        }
    )
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    # --- what differs between families, set by each subclass ---
    default_rope_theta: float | None = None  # put in the config when it has none (as vLLM's own model does)

    @staticmethod
    def base_layer(vllm_config: VllmConfig, prefix: str) -> nn.Module:
        """A layer ``< l``: vLLM's own decoder layer of the family."""
        raise NotImplementedError

    @staticmethod
    def biases(config) -> Biases:
        raise NotImplementedError

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        if self.default_rope_theta is not None:
            set_default_rope_theta(config, default_theta=self.default_rope_theta)
        self.model = SwiftKVModel(
            vllm_config=vllm_config, base_layer=self.base_layer, biases=self.biases(config), prefix="model"
        )
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config, prefix="lm_head"
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size, scale=getattr(config, "logit_scale", 1.0))
        slow_prefill = config.num_kv_groups and not vllm_config.cache_config.kv_sharing_fast_prefill
        if slow_prefill and fast_prefill_requested(vllm_config.additional_config):  # not the user's choice
            logger.warning(
                "SwiftKV: kv_sharing_fast_prefill is off, so layers >= %d run for every prompt token (outputs are "
                "exact, the prefill saving is lost): the swiftkv_serve plugin's engine hook did not run.",
                config.num_key_value_layers,
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
        """Load HF-named weights through vLLM's ``AutoWeightsLoader``; returns the vLLM parameter names loaded.

        A weight with no place in the model raises ``ValueError``; a tied ``lm_head.weight`` is skipped.
        """
        loader = AutoWeightsLoader(self)
        return loader.load_weights(route_swiftkv_weights(weights, self.config), mapper=self.hf_to_vllm_mapper)


class LlamaSwiftKVForCausalLM(SwiftKVForCausalLM):
    """Llama (and Mistral) checkpoints: biases as the config says."""

    @staticmethod
    def base_layer(vllm_config: VllmConfig, prefix: str) -> nn.Module:
        return LlamaDecoderLayer(vllm_config=vllm_config, prefix=prefix)

    @staticmethod
    def biases(config) -> Biases:
        attention = bool(getattr(config, "attention_bias", False) or getattr(config, "bias", False))
        return Biases(qkv=attention, o=attention, mlp=bool(getattr(config, "mlp_bias", False)))


class Qwen2SwiftKVForCausalLM(SwiftKVForCausalLM):
    """Qwen2 checkpoints: q/k/v biases, none elsewhere; RoPE theta 1e6 when the config has none."""

    default_rope_theta = 1_000_000

    @staticmethod
    def base_layer(vllm_config: VllmConfig, prefix: str) -> nn.Module:
        return Qwen2DecoderLayer(
            vllm_config.model_config.hf_config,
            vllm_config.cache_config,
            vllm_config.quant_config,
            prefix=prefix,
        )

    @staticmethod
    def biases(config) -> Biases:
        return Biases(qkv=True, o=False, mlp=False)
