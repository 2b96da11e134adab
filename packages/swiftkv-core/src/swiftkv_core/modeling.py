"""THE SwiftKV model definition, as a small diff over HF Llama / Qwen2 (arXiv 2410.03960).

With ``config.swiftkv`` on, the forward is rewired:

    h = embed(tokens)
    for i < l:  h = layer_i(h)                      # as usual, K/V cached per layer
    x = norm_swiftkv(h)                             # the single input of every later K/V
    for each AcrossKV group G (leader j):  K_G, V_G = rope(k_proj_swiftkv_j(x)), v_proj_swiftkv_j(x)
    h = h[keep]                                     # only the positions whose logits are wanted
    for j >= l: h = layer_j(h, K/V = K_G(j), V_G(j), query = q_proj_swiftkv_j)
    logits = lm_head(norm(h))

With ``config.lora_rank = r > 0`` (ours, beyond the paper) the rewired layers ``j >= l`` also add rank-``r``
adapters to ``o_proj`` and the MLP's three projections: the student can then change what those layers do with the
K/V it gives them, while the teacher (``swiftkv`` off) still runs the original weights, in the same single copy.
``config.lora_prefix`` adds rank-``r`` adapters to the MLP of layers ``< l`` too, on whenever ``swiftkv`` is: the
student may then also change what layer ``l``'s input (the single input of every later K/V) carries.

Prompt tokens therefore skip query, attention and MLP of every layer ``>= l``: when only the last position's
logits are wanted (``logits_to_keep=1``, what ``generate`` asks for) the later layers run for ONE position.
With ``swiftkv`` off the original model runs unchanged (the distillation teacher).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    create_causal_mask,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
    padding_mask_function,
)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2Attention,
    Qwen2DecoderLayer,
    Qwen2ForCausalLM,
    Qwen2MLP,
    Qwen2Model,
    Qwen2RMSNorm,
    Qwen2RotaryEmbedding,
)
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration import LlamaSwiftKVConfig, Qwen2SwiftKVConfig, cache_slots
from .runtime import check_flex_attention


def _rope(x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = (t.unsqueeze(1) for t in position_embeddings)
    return x * cos + rotate_half(x) * sin


class LowRankAdapter(nn.Module):
    """``x -> x A^T B^T``: a rank-``r`` update of a frozen linear layer's weight (``W + B A``), zero at the start
    (``B = 0``, ``A`` as ``nn.Linear`` initialises its weight), so the student begins as the converted model."""

    def __init__(self, in_features: int, out_features: int, rank: int):
        super().__init__()
        self.lora_a = nn.Parameter(torch.empty(rank, in_features))
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.lora_a, a=5**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(nn.functional.linear(x, self.lora_a), self.lora_b)

    def delta(self) -> torch.Tensor:
        """The update ``B A`` (the shape of the adapted weight)."""
        return self.lora_b @ self.lora_a


LORA_SUFFIX = "_lora_swiftkv"  # an adapter of projection P is the module P + LORA_SUFFIX beside P


def add_adapters(module: nn.Module, projections: tuple[str, ...], rank: int) -> None:
    """Give each ``module.<projection>`` (an ``nn.Linear``) an adapter ``<projection>_lora_swiftkv`` beside it, on
    the projection's device and dtype."""
    for name in projections:
        linear = getattr(module, name)
        adapter = LowRankAdapter(linear.in_features, linear.out_features, rank)
        setattr(module, name + LORA_SUFFIX, adapter.to(linear.weight.device, linear.weight.dtype))


def _adapted(module: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """``module.<name>(x)``, plus its adapter's update where it has one."""
    out = getattr(module, name)(x)
    adapter = getattr(module, name + LORA_SUFFIX, None)
    return out if adapter is None else out + adapter(x)


class SwiftKVAttentionMixin:
    """Adds ``q_proj_swiftkv`` (and, on AcrossKV group leaders, ``k/v_proj_swiftkv``) to layers ``>= l``."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        if not config.is_swiftkv_layer(layer_idx):
            return
        bias = self.q_proj.bias is not None
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj_swiftkv = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        if config.kv_group_leader(layer_idx) == layer_idx:
            self.k_proj_swiftkv = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
            self.v_proj_swiftkv = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        if config.serving_only:  # the teacher projections are never needed: do not allocate them
            del self.q_proj, self.k_proj, self.v_proj
        if config.lora_rank:
            add_adapters(self, ("o_proj",), config.lora_rank)

    def swiftkv_key_value(self, swiftkv_input, position_embeddings):
        """K (rotated) and V of this layer's AcrossKV group, from the shared normalised input."""
        shape = (*swiftkv_input.shape[:-1], -1, self.head_dim)
        key = self.k_proj_swiftkv(swiftkv_input).view(shape).transpose(1, 2)
        value = self.v_proj_swiftkv(swiftkv_input).view(shape).transpose(1, 2)
        # on the projection's device: with a model split across devices (device_map), the rotary embedding's
        # cos/sin are on its own device, and only the forward of a module moves its inputs
        cos, sin = (t.to(key.device) for t in position_embeddings)
        return _rope(key, (cos, sin)), value

    # Set where each decoder layer is compiled alone (regional compilation, as distillation's compiled layers are):
    # then, in a compiled layer, flex_attention runs outside the layer's graph, as eager runs it.
    flex_outside_compiled_graph = False

    def forward(self, *args, **kwargs):
        if (
            self.flex_outside_compiled_graph
            and self.config._attn_implementation == "flex_attention"
            and torch.compiler.is_compiling()
        ):
            return self._attend_outside_the_graph(*args, **kwargs)
        return self._attend(*args, **kwargs)

    @torch.compiler.disable
    def _attend_outside_the_graph(self, *args, **kwargs):
        """The attention module run eagerly, a graph break in a compiled layer: its projections and RoPE unfused,
        its flex_attention on transformers' own compiled kernel, whose loss and gradients equal the dense mask's on
        a GPU. Lowered inside compiled layers' graphs instead (torch 2.11, an H100, packed rows), flex_attention
        gave a distillation loss 17% off the eager one; run here, the eager loss and gradients on an H200
        (``tests/distill/test_attention.py``)."""
        return self._attend(*args, **kwargs)

    def _attend(
        self,
        hidden_states,
        position_embeddings,
        attention_mask,
        past_key_values=None,
        swiftkv_key_value=None,
        **kwargs,
    ):
        if swiftkv_key_value is None:  # original attention (layers < l, or the teacher)
            return super().forward(
                hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs
            )
        input_shape = hidden_states.shape[:-1]
        query = self.q_proj_swiftkv(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
        query = _rope(query, position_embeddings)
        key, value = swiftkv_key_value
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        output, weights = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        return _adapted(self, "o_proj", output.reshape(*input_shape, -1).contiguous()), weights


MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class SwiftKVDecoderLayerMixin:
    """The family's decoder layer (its forward unchanged) with SwiftKV attention, built once.

    Each module is built here exactly once: calling the HF layer's ``__init__`` would build its attention and then
    ours would replace it (litgpt's ``lora.py`` does the same). ``tests/core/test_modeling.py`` checks that the
    result has the HF layer's modules and weights.
    """

    attention_class: type[nn.Module]
    mlp_class: type[nn.Module]
    norm_class: type[nn.Module]

    def __init__(self, config, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.self_attn = self.attention_class(config, layer_idx)
        self.mlp = self.mlp_class(config)
        self.input_layernorm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.swiftkv_layer = config.is_swiftkv_layer(layer_idx)
        if config.lora_rank and (self.swiftkv_layer or config.lora_prefix):
            add_adapters(self.mlp, MLP_PROJECTIONS, config.lora_rank)

    def forward(self, hidden_states, swiftkv_key=None, swiftkv_value=None, **kwargs):
        """The HF layer's forward, or the student's: a layer ``>= l`` when it runs rewired (``swiftkv_key`` and
        ``swiftkv_value``, its group's shared K/V, given), a layer ``< l`` with the MLP's adapters when the model runs
        with SwiftKV on. The shared K/V come as positional arguments, like ``hidden_states``: HF's gradient
        checkpointing with ``use_reentrant=True`` sends gradients back only to the positional tensors of a layer.

        The student's forward is the HF layer's, written out (with the adapters where there are any). With a graph
        (training) it keeps less for the backward pass: the norms and the MLP's activation keep only their inputs
        and recompute the rest in the backward (the same values and gradients; an elementwise pass each), where
        autograd would keep their fp32 intermediates and three MLP-wide tensors: a quarter of the activation memory
        of every layer ``>= l``, the memory that grows with the tokens of a distillation step. Under HF's gradient
        checkpointing the whole layer is recomputed already, and these run plainly."""
        rewired = swiftkv_key is not None
        student = rewired if self.swiftkv_layer else self.self_attn.config.swiftkv
        if not (student and (rewired or hasattr(self.mlp, "gate_proj" + LORA_SUFFIX))):
            return super().forward(hidden_states, **kwargs)
        lean = _called if self.gradient_checkpointing and self.training else _recomputed
        attended, _ = self.self_attn(
            hidden_states=lean(self.input_layernorm, hidden_states),
            swiftkv_key_value=(swiftkv_key, swiftkv_value) if rewired else None,
            **kwargs,
        )
        hidden_states = hidden_states + attended
        x, mlp = lean(self.post_attention_layernorm, hidden_states), self.mlp
        gate, up = _adapted(mlp, "gate_proj", x), _adapted(mlp, "up_proj", x)
        inner = lean(lambda gate, up: mlp.act_fn(gate) * up, gate, up)
        return hidden_states + _adapted(mlp, "down_proj", inner)


def _recomputed(function, *inputs: torch.Tensor) -> torch.Tensor:
    """``function(*inputs)``; with a graph, only ``inputs`` are kept for the backward pass, which recomputes the
    rest (activation checkpointing of one cheap elementwise step)."""
    if not torch.is_grad_enabled():
        return function(*inputs)
    return checkpoint(function, *inputs, use_reentrant=False)


def _called(function, *inputs: torch.Tensor) -> torch.Tensor:
    return function(*inputs)


class SwiftKVModelMixin:
    """Adds ``norm_swiftkv`` and the rewired forward to a HF decoder-only ``*Model``, built once.

    ``hf_model_class`` is the HF model this is a diff over: its ``__init__`` is skipped (the base
    ``PreTrainedModel.__init__`` runs) so that no stock decoder layer is ever built.
    """

    hf_model_class: type[nn.Module]
    decoder_layer_class: type[nn.Module]
    norm_class: type[nn.Module]
    rotary_class: type[nn.Module]

    def __init__(self, config):
        super(self.hf_model_class, self).__init__(config)  # PreTrainedModel.__init__, not the HF model's
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_swiftkv = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = self.rotary_class(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def _apply(self, fn, recurse=True):
        """RoPE's inverse frequencies stay fp32 when the model is cast to fp16 or bf16 (``model.to(torch.bfloat16)``,
        Lightning's ``bf16-true``), as ``from_pretrained(dtype=...)`` leaves them: rounded to bf16 they are off by
        up to 0.2%, radians of phase by position 8k, and the teacher would no longer be the model it came from."""
        before = dict(self.rotary_emb.named_buffers())
        super()._apply(fn, recurse)
        buffers = self.rotary_emb._buffers
        for name, kept in before.items():
            cast = buffers[name]
            if kept.dtype == torch.float32 and cast.dtype in (torch.float16, torch.bfloat16):
                buffers[name] = cast.float() if kept.is_meta else kept.to(cast.device)
        return self

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        use_cache=None,
        keep_positions: int | torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """As the HF model, plus ``keep_positions``: return only these positions (an int N: the last N).

        With SwiftKV on, layers ``>= l`` run only for the kept positions; every position still gets its K/V.
        """
        hidden, context = self.forward_prefix(
            input_ids,
            attention_mask,
            position_ids,
            past_key_values,
            inputs_embeds,
            use_cache,
            keep_positions,
            **kwargs,
        )
        hidden = self.forward_suffix(hidden, context, swiftkv=self.config.swiftkv)
        return BaseModelOutputWithPast(
            last_hidden_state=self.norm(hidden), past_key_values=context.past_key_values
        )

    def forward_prefix(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        use_cache=None,
        keep_positions=None,
        **kwargs,
    ):
        """Embeddings and layers ``< l`` (identical in teacher and student, but with ``lora_prefix``: its adapters
        on their MLPs run in the student only): ``(hidden entering layer l, context)``.

        Distillation runs this once and ``forward_suffix`` twice (teacher and student) on its output (with
        ``lora_prefix``, this twice too).
        Packed sequences (``position_ids`` restarting at 0, no ``attention_mask``) are kept apart by the causal
        mask only without a cache: pass ``use_cache=False`` (transformers' mask ignores packing with a cache).
        With flash-attn, a caller that knows where the packed sequences start passes flash-attn's variable-length
        arguments (``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``: the sequences of the
        flattened rows) and the forward reads nothing from the device to find them.
        """
        config = self.config
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if config._attn_implementation == "flex_attention" and not torch.compiler.is_compiling():
            device = (input_ids if input_ids is not None else inputs_embeds).device
            check_flex_attention(self.layers[0].self_attn.head_dim, device)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        # masks per layer type, as generate builds them for a static cache: full attention is the only type here
        # (sliding windows are refused)
        if isinstance(attention_mask, dict):
            attention_mask = attention_mask["full_attention"]
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=config)
        _check_cache_slots(past_key_values, config)
        past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        length = inputs_embeds.shape[1]
        implementation = config._attn_implementation
        flash = runs_flash_attn(implementation)
        # the caller's own flash-attn variable-length arguments: rows of several sequences, known without a read
        varlen = flash and "cu_seq_lens_q" in kwargs
        plain = (
            (implementation == "sdpa" or flash)
            and length > 1
            and not varlen
            and _plain_prompt(attention_mask, position_ids, past_seen, length)
        )
        if position_ids is None:
            position_ids = torch.arange(length, device=inputs_embeds.device)[None] + past_seen

        keep = _keep_index(keep_positions, length)
        mask_kwargs = dict(
            config=config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        # a plain prompt with nothing cached: sdpa's is_causal is the whole mask, so none is passed, as transformers
        # does in eager mode (under torch.compile with torch < 2.13 transformers builds the mask for every prompt,
        # since dynamo folds torch.compiler.is_exporting() to True there, and the compiled sdpa leaves its flash
        # kernels)
        sdpa_is_causal = plain and past_seen == 0 and implementation == "sdpa"
        # flash-attn's mask is the padding mask alone: none without one (transformers would read the positions first)
        no_mask = sdpa_is_causal or (flash and attention_mask is None)
        causal_mask = None if no_mask else create_causal_mask(**mask_kwargs)
        if flash and not varlen:
            kwargs = {**_flash_varlen_kwargs(mask_kwargs), **kwargs}
        subset = config.swiftkv and keep is not None
        subset_mask = _kept_rows_mask(mask_kwargs, causal_mask, keep, plain, kwargs) if subset else None
        context = LayerContext(
            attention_mask=causal_mask,
            position_embeddings=self.rotary_emb(inputs_embeds, position_ids=position_ids),
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            keep=keep,
            subset=subset and subset_mask is not NO_SUBSET,
            subset_mask=subset_mask,
            kwargs=kwargs,
        )
        hidden = inputs_embeds
        for layer in self.layers[: config.num_key_value_layers]:
            hidden = layer(hidden, **context.layer_kwargs())
        return hidden, context

    def forward_suffix(
        self, hidden, context: LayerContext, swiftkv: bool, return_last_layer_input: bool = False
    ):
        """Layers ``>= l`` from ``hidden`` (the input of layer ``l``), before the final norm.

        ``swiftkv=False`` runs the original layers (the teacher); ``swiftkv=True`` the rewired ones (the student),
        for the kept positions only when the context has a subset. ``return_last_layer_input`` also returns the
        hidden state entering the last layer (for a hidden-state distillation loss).
        """
        config = self.config
        layer_kwargs = context.layer_kwargs()
        last_input = hidden
        if not swiftkv:
            for layer in self.layers[config.num_key_value_layers :]:
                last_input = hidden
                hidden = layer(hidden, **layer_kwargs)
        else:
            key_values = self.swiftkv_key_values(hidden, context.position_embeddings)
            cache = context.past_key_values
            # the K/V of layers >= l are written here, not by the layers
            layer_kwargs["past_key_values"] = None
            if context.subset:
                keep = context.keep
                hidden = hidden[:, keep]
                layer_kwargs["position_embeddings"] = tuple(t[:, keep] for t in context.position_embeddings)
                layer_kwargs["attention_mask"] = context.subset_mask
                layer_kwargs["position_ids"] = context.position_ids[:, keep]
            for j in range(config.num_key_value_layers, config.num_hidden_layers):
                leader = config.kv_group_leader(j)
                if cache is not None and j == leader:
                    # each group's K/V join the cache as its first layer runs, and are let go after its last: a
                    # cache that returns copies (FP8KVCache's dequantised K/V) holds one group's at a time
                    key_values[j] = cache.update(*key_values[j], config.kv_cache_index(j, swiftkv=True))
                last_input = hidden
                hidden = self.layers[j](hidden, *key_values[leader], **layer_kwargs)
                if config.kv_group_leader(j + 1) != leader:
                    del key_values[leader]
        if context.keep is not None and not (swiftkv and context.subset):
            hidden, last_input = hidden[:, context.keep], last_input[:, context.keep]
        return (hidden, last_input) if return_last_layer_input else hidden

    def swiftkv_key_values(self, hidden, position_embeddings):
        """K/V of every layer ``>= l`` from ``hidden`` (the input of layer ``l``), one per AcrossKV group:
        ``{group leader: (key, value)}`` of ``hidden``'s positions (a cache takes them with
        ``update(key, value, config.kv_cache_index(leader, swiftkv=True))``)."""
        config = self.config
        swiftkv_input = self.norm_swiftkv(hidden)
        device = swiftkv_input.device.type
        # under autocast, cast once (one copy kept for the backward), not once per layer's projection
        if torch.is_autocast_enabled(device):
            swiftkv_input = swiftkv_input.to(torch.get_autocast_dtype(device))
        key_values = {}
        for j in config.kv_group_leaders:
            key_values[j] = self.layers[j].self_attn.swiftkv_key_value(swiftkv_input, position_embeddings)
        return key_values


@dataclass
class LayerContext:
    """What every decoder layer of one forward needs besides the hidden state."""

    attention_mask: torch.Tensor | None
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    position_ids: torch.Tensor
    past_key_values: object | None
    use_cache: bool | None
    keep: slice | torch.Tensor | None  # positions whose output is wanted (None: all)
    subset: bool  # whether the SwiftKV layers run for the kept positions only
    subset_mask: object  # their attention mask then (``_kept_rows_mask``)
    kwargs: dict

    def layer_kwargs(self) -> dict:
        return dict(
            attention_mask=self.attention_mask,
            position_embeddings=self.position_embeddings,
            position_ids=self.position_ids,
            past_key_values=self.past_key_values,
            use_cache=self.use_cache,
            **self.kwargs,
        )


def _check_cache_slots(cache, config) -> None:
    """Refuse a cache built for the other mode: its slots are fixed when it is built from a config (one per layer,
    or with SwiftKV on one per layer ``< l`` and per AcrossKV group: ``num_kv_shared_layers``)."""
    if cache is None or getattr(cache, "layer_class_to_replicate", None) is not None or not cache.layers:
        return  # no cache, or one that grows its slots as they are written
    needed = cache_slots(config)
    if len(cache.layers) != needed:
        raise ValueError(
            f"this cache holds {len(cache.layers)} layer slots and the model, with SwiftKV "
            f"{'on' if config.swiftkv else 'off'}, writes {needed}: it was built while SwiftKV was "
            f"{'off' if config.swiftkv else 'on'}; build the cache after model.swiftkv(...)."
        )


def _plain_prompt(attention_mask, position_ids, past_seen: int, length: int) -> bool:
    """Whether the causal mask follows from the positions alone: no padding, and positions counting on from the
    cache (so no packed sequences). Given masks and positions are read as transformers reads them in eager mode;
    under ``torch.compile`` only a prompt given without either counts."""
    if attention_mask is None and position_ids is None:
        return True
    if torch.compiler.is_compiling():
        return False
    if attention_mask is not None and not (attention_mask.dim() == 2 and bool(attention_mask.all())):
        return False  # padding, or a 4-D mask of the caller's own
    if position_ids is None:
        return True
    counting = torch.arange(past_seen, past_seen + length, device=position_ids.device)
    return bool((position_ids == counting).all())


NO_SUBSET = object()  # ``_kept_rows_mask``: the attention implementation cannot run the kept rows alone


def runs_flash_attn(implementation: str) -> bool:
    """Whether ``implementation`` runs transformers' flash-attn path: ``flash_attention_2/3/4``, or a kernel from the
    hub with flash-attn's entry points (``"kernels-community/flash-attn3"``, registered to the same path). Its
    padding mask is passed as it is, its causal mask aligned to the bottom-right corner, and packed rows need its
    variable-length arguments."""
    return ALL_ATTENTION_FUNCTIONS.get(implementation) is flash_attention_forward


def _kept_rows_mask(mask_kwargs: dict, causal_mask, keep, plain: bool, attention_kwargs: dict):
    """The attention mask of layers ``>= l`` when they run for the kept query positions only, for the model's
    attention implementation; ``NO_SUBSET`` where it cannot express one (those layers then run for every position,
    with the same outputs and no saving). ``plain``: a prompt whose mask follows from its positions
    (``_plain_prompt``; worked out for sdpa and flash-attn only); ``attention_kwargs``: what every layer's attention
    gets besides (flash-attn's variable-length arguments among them).

    - eager / sdpa: the full mask's kept rows, always explicit (sdpa's ``is_causal`` aligns the upper-left corner,
      which is wrong for a subset of the rows); for a ``plain`` prompt, only those rows are built (the full mask
      is prompt length squared: 1 GiB at 32k tokens, 16 GiB at 128k); otherwise (padding, packing, a 4-D mask)
      layers < l hold transformers' full mask anyway, and the kept rows are taken from it, not from a second one;
    - flex_attention: a block mask of the kept rows (blocks a kept row cannot see are skipped);
    - flash-attn (``runs_flash_attn``): its causal mask is aligned to the bottom-right corner, which is what the
      LAST rows need (``logits_to_keep=N``, what ``generate`` asks for); its mask is the padding mask as it is. Other row
      subsets, and packed sequences, have no flash-attn form here: ours (``_flash_varlen_kwargs``), a caller's own
      variable-length arguments, and those transformers' flash path finds by itself in ONE row with no padding (from
      its positions, with a cache too: its rule, not sdpa's; an all-ones mask is no padding to it).
    """
    implementation = mask_kwargs["config"]._attn_implementation
    if plain and implementation == "sdpa":
        embeds = mask_kwargs["inputs_embeds"]
        rows = _row_positions(mask_kwargs)[keep]
        keys = torch.arange(_key_length(mask_kwargs), device=embeds.device)
        return (keys[None, :] <= rows[:, None])[None, None]  # kept row i sees the keys up to its own position
    if implementation in ("sdpa", "eager"):
        if not isinstance(causal_mask, torch.Tensor):  # transformers skipped it (sdpa's is_causal): build it
            causal_mask = create_causal_mask(**mask_kwargs, allow_is_causal_skip=False)
        return causal_mask[:, :, keep]  # the rows of layers < l's own mask: no second full mask
    if implementation == "flex_attention":
        mask = mask_kwargs["attention_mask"]
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            return NO_SUBSET  # a caller's own 4-D mask or BlockMask: no kept-rows form of it here
        return _kept_rows_block_mask(mask_kwargs, keep)
    if runs_flash_attn(implementation) and isinstance(keep, slice):
        if "cu_seq_lens_q" in attention_kwargs:
            return NO_SUBSET
        if plain:
            return causal_mask
        positions = mask_kwargs["position_ids"]
        one_row_packed = (  # under torch.compile, any one row without padding: its positions are not read there
            causal_mask is None
            and positions.shape[0] == 1
            and find_packed_sequence_indices(positions) is not None
        )
        return NO_SUBSET if one_row_packed or _packed_sequences(mask_kwargs) is not None else causal_mask
    return NO_SUBSET


def _packed_sequences(mask_kwargs: dict) -> torch.Tensor | None:
    """Which packed sequence each position of each row belongs to (``position_ids`` restarting at 0, no padding
    mask, no cache: transformers' convention; one row of positions stands for every row, as transformers reads
    it), or ``None`` when the rows hold one sequence each."""
    if mask_kwargs["attention_mask"] is not None or mask_kwargs["past_key_values"] is not None:
        return None
    packed = find_packed_sequence_indices(mask_kwargs["position_ids"])
    return None if packed is None else packed.expand(mask_kwargs["inputs_embeds"].shape[0], -1)


def _flash_varlen_kwargs(mask_kwargs: dict) -> dict:
    """flash-attn's variable-length arguments for packed rows: every packed sequence of every row as one sequence
    of the flattened batch. transformers finds packed sequences from ``position_ids`` itself only in a batch of
    ONE row; with more rows its flash path would attend across the packed sequences. Not inside a compiled graph
    (the number of sequences is data): a whole compiled forward keeps transformers' own handling."""
    packed = None if torch.compiler.is_compiling() else _packed_sequences(mask_kwargs)
    if packed is None:
        return {}
    starts = torch.ones_like(packed, dtype=torch.bool)
    starts[:, 1:] = packed[:, 1:] != packed[:, :-1]  # each row starts a sequence too
    total = torch.tensor([packed.numel()], device=packed.device)
    cu_seq_lens = torch.cat([starts.flatten().nonzero().flatten(), total]).to(torch.int32)
    longest = int(cu_seq_lens.diff().max())
    return dict(
        cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=longest, max_length_k=longest
    )


def _kept_rows_block_mask(mask_kwargs: dict, keep):
    """flex_attention's block mask for the kept query rows: kept row ``q`` is the sequence's position
    ``rows[q]`` and sees the keys a causal mask lets that position see (padding and packed sequences included)."""
    batch = mask_kwargs["inputs_embeds"].shape[0]
    rows, key_length = _row_positions(mask_kwargs)[keep], _key_length(mask_kwargs)
    mask_function = causal_mask_function
    if mask_kwargs["attention_mask"] is not None:
        padding = mask_kwargs["attention_mask"].bool()  # a static cache's keys run past it: not attended
        padding = torch.nn.functional.pad(padding, (0, key_length - padding.shape[-1]), value=False)
        mask_function = and_masks(mask_function, padding_mask_function(padding))
    packed = _packed_sequences(mask_kwargs)
    if packed is not None:
        mask_function = and_masks(mask_function, packed_sequence_mask_function(packed))

    def kept_row(b, h, q, kv):
        return mask_function(b, h, rows[q], kv)

    # compiled, as transformers builds its own block masks: uncompiled, create_block_mask first builds the dense
    # rows x keys mask (gigabytes for a distillation batch's position_fraction rows)
    return torch.compile(create_block_mask)(
        kept_row, B=batch, H=None, Q_LEN=rows.shape[0], KV_LEN=key_length, device=rows.device
    )


def _row_positions(mask_kwargs: dict) -> torch.Tensor:
    """The cache positions of this forward's rows: the past's length on, one per row."""
    embeds, cache = mask_kwargs["inputs_embeds"], mask_kwargs["past_key_values"]
    past = cache.get_seq_length() if cache is not None else 0
    return torch.arange(embeds.shape[1], device=embeds.device) + past


def _key_length(mask_kwargs: dict) -> int:
    """The keys layers ``>= l`` attend to: the past and this forward's rows, or all of a static cache's slots (its
    keys are as long as it is; transformers' masks are sized the same way, ``Cache.get_mask_sizes``)."""
    config, cache = mask_kwargs["config"], mask_kwargs["past_key_values"]
    length = mask_kwargs["inputs_embeds"].shape[1]
    if cache is None:
        return length
    return cache.get_mask_sizes(length, config.kv_cache_index(config.num_key_value_layers, swiftkv=True))[0]


def _keep_index(keep_positions, seq_len: int):
    """``None`` (all positions), a slice of the last N, or an index tensor."""
    if keep_positions is None:
        return None
    if isinstance(keep_positions, int):
        return slice(-keep_positions, None) if 0 < keep_positions < seq_len else None
    return keep_positions


class SwiftKVForCausalLMMixin:
    """Adds the SwiftKV switch and the kept-positions forward to a HF ``*ForCausalLM``, built once (as the model)."""

    hf_model_class: type[nn.Module]
    model_class: type[nn.Module]

    def __init__(self, config):
        super(self.hf_model_class, self).__init__(config)  # PreTrainedModel.__init__, not the HF model's
        self.model = self.model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def swiftkv(self, enabled: bool = True):
        """Switch between the rewired forward (``True``, the student) and the original one (the teacher)."""
        if not enabled and self.config.serving_only:
            raise ValueError(
                "This model was loaded from a serving export (serving_only=True): it has no teacher q/k/v for "
                f"layers >= {self.config.num_key_value_layers}, so swiftkv(False) cannot run. "
                "Load the full checkpoint to run the original model."
            )
        self.config.swiftkv = bool(enabled)
        return self

    def add_lora(self, rank: int, prefix: bool = False):
        """Give every layer ``>= l`` rank-``rank`` adapters on ``o_proj`` and the MLP (``prefix``: and the MLP of every
        layer ``< l``), zero at the start (the model's outputs do not change), for a checkpoint that has none; they
        are SwiftKV parameters (they train)."""
        config = self.config
        if config.lora_rank:
            raise ValueError(f"This model already has adapters of rank {config.lora_rank}; load it as it is.")
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"lora rank must be an integer >= 1, got {rank!r}.")
        for j, layer in enumerate(self.model.layers):
            if j >= config.num_key_value_layers:
                add_adapters(layer.self_attn, ("o_proj",), rank)
            if j >= config.num_key_value_layers or prefix:
                add_adapters(layer.mlp, MLP_PROJECTIONS, rank)
        config.lora_rank, config.lora_prefix = rank, bool(prefix)
        return self

    @contextmanager
    def swiftkv_mode(self, enabled: bool) -> Iterator:
        """``with model.swiftkv_mode(False): ...`` runs the block as the teacher (or the student with ``True``) and
        switches back afterwards, also when the block raises; both switches go through ``swiftkv()``'s checks."""
        previous = self.config.swiftkv
        self.swiftkv(enabled)
        try:
            yield self
        finally:
            self.swiftkv(previous)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """As HF's, but weights that do not match the config are an error, not a warning.

        A checkpoint whose ``num_key_value_layers`` / ``key_value_group_size`` disagree with its weights would
        otherwise load with randomly initialised projections and generate garbage.
        """
        return_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        problems = {
            kind: sorted(info.get(kind) or [])
            for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
        }
        problems = {kind: names for kind, names in problems.items() if names}
        if problems:
            c = model.config
            raise ValueError(
                f"The checkpoint's weights do not match its config (num_hidden_layers={c.num_hidden_layers}, "
                f"num_key_value_layers={c.num_key_value_layers}, key_value_group_size={c.key_value_group_size}, "
                f"serving_only={c.serving_only}): "
                + "; ".join(
                    f"{kind}: {names[:6]}{' ...' if len(names) > 6 else ''}"
                    for kind, names in problems.items()
                )
                + ". Fix config.json to the values the weights were trained with, or re-export the checkpoint."
            )
        if model.config.lora_rank and (model.tp_size or 1) > 1:
            raise ValueError(
                f"This checkpoint has rank-{model.config.lora_rank} adapters, which the tensor-parallel plan does not "
                "split: export it for serving (export_for_serving merges them into the weights) and load that."
            )
        return (model, info) if return_info else model

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """As the HF model; ``logits_to_keep`` also decides which positions run layers ``>= l`` under SwiftKV (so
        with ``output_hidden_states``, the states of those layers are of the kept positions only)."""
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            keep_positions=logits_to_keep if labels is None else None,
            **kwargs,
        )
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


# --- Llama (and Mistral checkpoints, converted to Llama) ---
class LlamaSwiftKVAttention(SwiftKVAttentionMixin, LlamaAttention):
    pass


class LlamaSwiftKVDecoderLayer(SwiftKVDecoderLayerMixin, LlamaDecoderLayer):
    attention_class, mlp_class, norm_class = LlamaSwiftKVAttention, LlamaMLP, LlamaRMSNorm


class LlamaSwiftKVModel(SwiftKVModelMixin, LlamaModel):
    config_class = LlamaSwiftKVConfig
    hf_model_class, decoder_layer_class = LlamaModel, LlamaSwiftKVDecoderLayer
    norm_class, rotary_class = LlamaRMSNorm, LlamaRotaryEmbedding
    _no_split_modules = ["LlamaSwiftKVDecoderLayer"]


class LlamaSwiftKVForCausalLM(SwiftKVForCausalLMMixin, LlamaForCausalLM):
    config_class = LlamaSwiftKVConfig
    hf_model_class, model_class = LlamaForCausalLM, LlamaSwiftKVModel
    _no_split_modules = ["LlamaSwiftKVDecoderLayer"]


# --- Qwen2 ---
class Qwen2SwiftKVAttention(SwiftKVAttentionMixin, Qwen2Attention):
    pass


class Qwen2SwiftKVDecoderLayer(SwiftKVDecoderLayerMixin, Qwen2DecoderLayer):
    attention_class, mlp_class, norm_class = Qwen2SwiftKVAttention, Qwen2MLP, Qwen2RMSNorm


class Qwen2SwiftKVModel(SwiftKVModelMixin, Qwen2Model):
    config_class = Qwen2SwiftKVConfig
    hf_model_class, decoder_layer_class = Qwen2Model, Qwen2SwiftKVDecoderLayer
    norm_class, rotary_class = Qwen2RMSNorm, Qwen2RotaryEmbedding
    _no_split_modules = ["Qwen2SwiftKVDecoderLayer"]


class Qwen2SwiftKVForCausalLM(SwiftKVForCausalLMMixin, Qwen2ForCausalLM):
    config_class = Qwen2SwiftKVConfig
    hf_model_class, model_class = Qwen2ForCausalLM, Qwen2SwiftKVModel
    _no_split_modules = ["Qwen2SwiftKVDecoderLayer"]
