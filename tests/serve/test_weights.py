"""Checkpoint names -> the vLLM model's parameters, without an engine: the SwiftKV routing and vLLM's mapping."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")


@pytest.fixture
def config():
    from swiftkv_core.configuration import LlamaSwiftKVConfig
    from tests.serve.checkpoints import TINY

    # 8 layers, l=4, AcrossKV groups {4, 5} and {6, 7}
    assert TINY["num_hidden_layers"] == 8
    return LlamaSwiftKVConfig(
        **TINY, vocab_size=100, swiftkv=True, num_key_value_layers=4, key_value_group_size=2
    )


def _route(names, config):
    from swiftkv_serve.model import route_swiftkv_weights

    return [
        (name, getattr(tensor, "shard_id", None))
        for name, tensor in route_swiftkv_weights(((n, torch.zeros(1)) for n in names), config)
    ]


def test_teacher_projections_of_swiftkv_layers_are_dropped(config):
    names = [f"model.layers.{j}.self_attn.{p}_proj.weight" for j in (3, 4, 7) for p in "qkv"]
    names += ["model.layers.4.self_attn.o_proj.weight", "model.layers.4.self_attn.q_proj_swiftkv.weight"]
    kept = [name for name, _ in _route(names, config)]
    assert kept == [
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.v_proj.weight",
        "model.layers.4.self_attn.o_proj.weight",
        "model.layers.4.self_attn.q_proj_swiftkv.weight",
    ]


def test_group_leaders_kv_go_to_their_shard_of_the_fused_projection(config):
    names = [
        f"model.layers.{j}.self_attn.{p}_proj_swiftkv.{w}"
        for j in (4, 6)
        for p in "kv"
        for w in ("weight", "bias")
    ]
    # K of groups 0, 1 are shards 0, 1; V of groups 0, 1 are shards 2, 3.
    assert _route(names, config) == [
        ("model.kv_proj_swiftkv.weight", 0),
        ("model.kv_proj_swiftkv.bias", 0),
        ("model.kv_proj_swiftkv.weight", 2),
        ("model.kv_proj_swiftkv.bias", 2),
        ("model.kv_proj_swiftkv.weight", 1),
        ("model.kv_proj_swiftkv.bias", 1),
        ("model.kv_proj_swiftkv.weight", 3),
        ("model.kv_proj_swiftkv.bias", 3),
    ]


def test_kv_of_a_non_leader_layer_is_refused(config):
    with pytest.raises(ValueError, match="layer 5 is not the first layer of its AcrossKV group"):
        _route(["model.layers.5.self_attn.v_proj_swiftkv.weight"], config)


def test_vllm_mapping_stacks_the_teacher_projections_but_not_the_swiftkv_ones():
    from swiftkv_serve.model import LlamaSwiftKVForCausalLM, Qwen2SwiftKVForCausalLM

    assert LlamaSwiftKVForCausalLM.hf_to_vllm_mapper is Qwen2SwiftKVForCausalLM.hf_to_vllm_mapper
    mapper = LlamaSwiftKVForCausalLM.hf_to_vllm_mapper
    mapped = {
        name: mapper._map_name_with_shard(name)
        for name in (
            "model.layers.1.self_attn.k_proj.bias",
            "model.layers.1.mlp.up_proj.weight",
            "model.layers.5.self_attn.q_proj_swiftkv.weight",
            "model.kv_proj_swiftkv.weight",
            "model.norm_swiftkv.weight",
        )
    }
    assert mapped == {
        "model.layers.1.self_attn.k_proj.bias": ("model.layers.1.self_attn.qkv_proj.bias", "k"),
        "model.layers.1.mlp.up_proj.weight": ("model.layers.1.mlp.gate_up_proj.weight", 1),
        "model.layers.5.self_attn.q_proj_swiftkv.weight": (
            "model.layers.5.self_attn.q_proj_swiftkv.weight",
            None,
        ),
        "model.kv_proj_swiftkv.weight": ("model.kv_proj_swiftkv.weight", None),
        "model.norm_swiftkv.weight": ("model.norm_swiftkv.weight", None),
    }


def test_families_differ_in_data_only():
    from types import SimpleNamespace

    from swiftkv_serve.model import Biases, LlamaSwiftKVForCausalLM, Qwen2SwiftKVForCausalLM

    assert Qwen2SwiftKVForCausalLM.biases(SimpleNamespace()) == Biases(qkv=True, o=False, mlp=False)
    assert Qwen2SwiftKVForCausalLM.default_rope_theta == 1_000_000
    assert LlamaSwiftKVForCausalLM.default_rope_theta is None
    llama_bias = SimpleNamespace(attention_bias=True, mlp_bias=False)
    assert LlamaSwiftKVForCausalLM.biases(llama_bias) == Biases(qkv=True, o=True, mlp=False)
    assert LlamaSwiftKVForCausalLM.biases(SimpleNamespace()) == Biases(qkv=False, o=False, mlp=False)
