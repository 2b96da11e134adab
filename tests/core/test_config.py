import pytest
from transformers import AutoConfig

from swiftkv_core import LlamaSwiftKVConfig, Qwen2SwiftKVConfig
from swiftkv_core.configuration import num_kv_cache_layers, validate_layers

SMALL = dict(num_hidden_layers=8, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("cls", [LlamaSwiftKVConfig, Qwen2SwiftKVConfig])
def test_defaults_and_round_trip(cls, tmp_path):
    config = cls(**SMALL)
    assert (config.swiftkv, config.num_key_value_layers, config.key_value_group_size) == (False, 8, 1)
    config = cls(**SMALL, swiftkv=True, num_key_value_layers=4, key_value_group_size=2)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is cls
    assert (loaded.swiftkv, loaded.num_key_value_layers, loaded.key_value_group_size) == (True, 4, 2)
    assert loaded.num_kv_cache_layers == 4 + 4 // 2


def test_layer_bookkeeping():
    config = LlamaSwiftKVConfig(**SMALL, swiftkv=True, num_key_value_layers=2, key_value_group_size=3)
    assert [config.kv_group_leader(j) for j in range(8)] == [0, 1, 2, 2, 2, 5, 5, 5]
    assert [config.kv_cache_index(j) for j in range(8)] == [0, 1, 2, 2, 2, 3, 3, 3]
    assert [config.kv_cache_index(j, swiftkv=False) for j in range(8)] == list(range(8))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(num_key_value_layers=9), r"num_key_value_layers=9 is out of range: .*\[1, 8\]"),
        (dict(num_key_value_layers=0), r"num_key_value_layers=0 is out of range"),
        (
            dict(num_key_value_layers=5, key_value_group_size=2),
            r"key_value_group_size=2 must divide .* = 3.*\[1, 3\]",
        ),
        (dict(key_value_group_size=0), r"key_value_group_size=0 must be a positive integer"),
        (dict(swiftkv=False, serving_only=True), r"serving_only"),
    ],
)
def test_invalid_configs_name_the_key_and_range(overrides, message):
    with pytest.raises(Exception, match=message):
        LlamaSwiftKVConfig(**SMALL, **overrides)


def test_qwen2_sliding_window_refused():
    with pytest.raises(Exception, match="sliding-window"):
        Qwen2SwiftKVConfig(**SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=0)


def test_group_arithmetic_is_one_definition():
    config = LlamaSwiftKVConfig(**SMALL, swiftkv=True, num_key_value_layers=2, key_value_group_size=3)
    assert config.kv_group_leaders == [2, 5] and config.num_kv_groups == 2
    assert [config.kv_group_index(j) for j in range(2, 8)] == [0, 0, 0, 1, 1, 1]
    assert config.num_kv_cache_layers == num_kv_cache_layers(8, 2, 3) == 4


@pytest.mark.parametrize(
    ("l", "g", "allow_no_skip", "message"),
    [
        (8, 1, False, r"must be an integer in \[1, 7\].*l=8 would skip nothing"),
        (0, 1, True, r"must be an integer in \[1, 8\]"),
        (True, 1, True, r"must be an integer"),
        (4, 3, True, r"must divide .* = 4.*\[1, 2, 4\]"),
    ],
)
def test_validate_layers_says_what_is_valid(l, g, allow_no_skip, message):
    with pytest.raises(ValueError, match=message):
        validate_layers(8, l, g, allow_no_skip=allow_no_skip)


def test_validate_layers_accepts_no_skip_only_where_allowed():
    validate_layers(8, 8, 1)  # a SwiftKV checkpoint equal to its base model
    validate_layers(8, 7, 1, allow_no_skip=False)
    with pytest.raises(ValueError, match="l=8 would skip nothing"):
        validate_layers(8, 8, 1, allow_no_skip=False)
