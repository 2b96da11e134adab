"""convert / save_checkpoint / export_for_serving and loading through the Auto classes."""

import json

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, LlamaConfig

from swiftkv_core import LlamaSwiftKVForCausalLM, Qwen2SwiftKVForCausalLM
from swiftkv_core.convert import convert, export_for_serving, save_checkpoint, swiftkv_parameter_names
from tests.conftest import tiny_base

EXPECTED_CLASS = {
    "llama": LlamaSwiftKVForCausalLM,
    "mistral": LlamaSwiftKVForCausalLM,
    "qwen2": Qwen2SwiftKVForCausalLM,
}


@torch.no_grad()
def test_published_init_recipe_and_trainable_split(family):
    base = tiny_base(family)
    reference = {k: v.clone() for k, v in base.state_dict().items()}
    model = convert(base, 1, 3)
    assert type(model) is EXPECTED_CLASS[family]
    layers = model.model.layers
    assert_close(model.model.norm_swiftkv.weight, reference["model.layers.1.input_layernorm.weight"])
    for j in (1, 2, 3):
        assert_close(
            layers[j].self_attn.q_proj_swiftkv.weight, reference[f"model.layers.{j}.self_attn.q_proj.weight"]
        )
    for name in ("k_proj", "v_proj"):
        mean = torch.stack([reference[f"model.layers.{j}.self_attn.{name}.weight"] for j in (1, 2, 3)]).mean(
            0
        )
        assert_close(getattr(layers[1].self_attn, f"{name}_swiftkv").weight, mean)
        assert not hasattr(layers[2].self_attn, f"{name}_swiftkv")  # only the group leader owns K/V
    if family == "qwen2":  # Qwen2's projections carry biases, and so do the SwiftKV ones
        assert_close(
            layers[2].self_attn.q_proj_swiftkv.bias, reference["model.layers.2.self_attn.q_proj.bias"]
        )
        assert layers[1].self_attn.k_proj_swiftkv.bias is not None
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(swiftkv_parameter_names(model))
    assert trainable and all("swiftkv" in n for n in trainable)
    for name, value in reference.items():  # base weights untouched
        assert torch.equal(model.state_dict()[name], value), name


def test_convert_refuses_unknown_architectures_and_bad_settings():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match=r"Unknown architecture model_type='gpt2'.*llama.*mistral.*qwen2"):
        convert(GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2)), 1)
    with pytest.raises(Exception, match="num_key_value_layers=7 is out of range"):
        convert(tiny_base("llama"), 7)
    with pytest.raises(Exception, match="key_value_group_size=2 must divide"):
        convert(tiny_base("llama"), 1, 2)
    from transformers import MistralConfig, MistralForCausalLM

    sliding = MistralForCausalLM(
        MistralConfig(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            sliding_window=16,
        )
    )
    with pytest.raises(ValueError, match="sliding_window=16"):
        convert(sliding, 1)


@torch.no_grad()
def test_checkpoint_round_trip_and_serving_export(family, tmp_path):
    model = convert(tiny_base(family), 2, 2)
    ids = torch.randint(0, 128, (2, 9))
    expected = model(ids).logits
    save_checkpoint(model, tmp_path / "full")
    export_for_serving(model, tmp_path / "serve")
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "serve")
    assert type(full) is type(served) is EXPECTED_CLASS[family]
    assert served.config.swiftkv and served.config.serving_only
    assert_close(full(ids).logits, expected)
    assert_close(served(ids).logits, expected)
    assert (tmp_path / "serve/model.safetensors").stat().st_size < (
        tmp_path / "full/model.safetensors"
    ).stat().st_size
    assert not any(
        n.endswith(("layers.3.self_attn.q_proj.weight", "layers.2.self_attn.k_proj.weight"))
        for n, _ in served.named_parameters()
    )  # teacher projections never allocated
    with pytest.raises(ValueError, match="serving export"):
        served.swiftkv(False)
    assert_close(
        full.swiftkv(False)(ids).logits, tiny_base(family)(ids).logits
    )  # the teacher survives a save
    with pytest.raises(ValueError, match="teacher mode"):
        export_for_serving(full, tmp_path / "other")


def test_published_format_loads(tmp_path):
    """A checkpoint as the published ones are written: our config keys, teacher q/k/v kept, no serving_only."""
    model = convert(tiny_base("llama"), 2)
    save_checkpoint(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("serving_only")
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.architectures == ["LlamaSwiftKVForCausalLM"] and loaded.config.swiftkv


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_checkpoint_writes_rope_as_the_published_ones_do(family, tmp_path):
    """Transformers 5 writes RoPE under ``rope_parameters`` alone; the published checkpoints (and every loader of
    transformers 4, the published plugin's stack) read ``rope_theta`` and ``rope_scaling``, and without them take
    theta 10000 and no scaling. Both are written; loaded again, the model's RoPE and logits are unchanged."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}  # fmt: skip
    scaling = {"rope_scaling": dict(llama3)} if family == "llama" else {}  # (a copy: transformers adds to it)
    model = convert(tiny_base(family, rope_theta=500000.0, max_position_embeddings=512, **scaling), 2)
    save_checkpoint(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_theta"] == 500000.0
    assert config["rope_scaling"] == (llama3 if family == "llama" else None)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.rope_parameters == model.config.rope_parameters
    ids = torch.randint(0, 128, (1, 16))
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_mismatched_weights_fail_at_load_time(tmp_path):
    save_checkpoint(convert(tiny_base("llama"), 2), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_key_value_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"do not match its config .*num_key_value_layers=3.*unexpected_keys"
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_failed_save_leaves_the_earlier_checkpoint_intact(tmp_path):
    model = convert(tiny_base("llama"), 2)
    save_checkpoint(model, tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}

    class BrokenTokenizer:
        def save_pretrained(self, path):
            raise OSError("disk full")

    with torch.no_grad():
        model.model.norm_swiftkv.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(model, tmp_path / "ckpt", tokenizer=BrokenTokenizer())
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary folder left behind


def test_a_save_never_replaces_a_folder_of_other_files(tmp_path):
    """The checkpoint replaces its whole folder: an earlier checkpoint is overwritten, but a folder of other files
    (a run's logs beside the weights) or a file is refused before anything is written, and stays as it was."""
    model = convert(tiny_base("llama"), 2)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train_log.csv").write_text("step,kl\n")
    (tmp_path / "file").write_text("x")
    for folder, refusal in (("run", "not a checkpoint folder"), ("file", "is a file")):
        for save in (save_checkpoint, export_for_serving):
            with pytest.raises((ValueError, NotADirectoryError), match=refusal):
                save(model, tmp_path / folder)
    assert (tmp_path / "run" / "train_log.csv").read_text() == "step,kl\n" and (
        tmp_path / "file"
    ).read_text() == "x"
    save_checkpoint(model, tmp_path / "ckpt")
    with torch.no_grad():
        model.model.layers[2].self_attn.k_proj_swiftkv.weight.add_(1.0)
    save_checkpoint(model, tmp_path / "ckpt")  # an earlier checkpoint: replaced
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert_close(
        reloaded.model.layers[2].self_attn.k_proj_swiftkv.weight,
        model.model.layers[2].self_attn.k_proj_swiftkv.weight,
    )


def test_convert_from_a_path(tmp_path):
    tiny_base("qwen2").save_pretrained(tmp_path)
    model = convert(tmp_path, 3)
    assert type(model) is Qwen2SwiftKVForCausalLM and model.config.num_key_value_layers == 3


def test_direct_construction_with_l_equal_L():
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2)
    from swiftkv_core.convert import swiftkv_config_from

    model = LlamaSwiftKVForCausalLM(swiftkv_config_from(config, 2))
    assert not [n for n in swiftkv_parameter_names(model) if "proj" in n]
