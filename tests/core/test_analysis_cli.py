"""Input-similarity analysis (paper Eq. 1) and the ``swiftkv`` console script."""

import json

import pytest
import torch
import torch.nn.functional as F

from swiftkv.cli import main
from swiftkv_core.analysis import (
    layer_input_similarity,
    recommend_num_key_value_layers,
    write_similarity_report,
)
from tests.conftest import tiny_base


class CharTokenizer:
    """Bytes as token ids: enough to feed text to a tiny model."""

    def __call__(self, text, return_tensors="pt", truncation=True, max_length=512):
        ids = torch.tensor([[b % 128 for b in text.encode()[:max_length]]])
        return type("Batch", (), {"input_ids": ids})()


@torch.no_grad()
def test_similarity_is_equation_1():
    model = tiny_base("llama")
    text = "The quick brown fox jumps over the lazy dog."
    similarity = layer_input_similarity(model, CharTokenizer(), [text])
    ids = CharTokenizer()(text).input_ids
    states = model(ids, output_hidden_states=True).hidden_states[:4]
    expected = [
        torch.stack([F.cosine_similarity(states[i][0], states[j][0], dim=-1).mean() for j in range(i + 1, 4)])
        .mean()
        .item()
        for i in range(3)
    ]
    assert similarity == pytest.approx(expected, abs=1e-5)


def test_recommendation_and_report(tmp_path):
    similarity = [0.1, 0.5, 0.8, 0.92, 0.95]
    assert recommend_num_key_value_layers(similarity, 0.9) == 3
    assert recommend_num_key_value_layers(similarity, 0.99) == 6
    result = write_similarity_report(similarity, 0.9, tmp_path)
    assert result["recommended_num_key_value_layers"] == 3
    assert json.loads((tmp_path / "similarity.json").read_text())["skipped_fraction"] == pytest.approx(0.5)
    assert (tmp_path / "similarity.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_convert_and_flops(tmp_path, capsys):
    tiny_base("llama").save_pretrained(tmp_path / "base")
    main(
        [
            "convert",
            "--model",
            str(tmp_path / "base"),
            "--out_dir",
            str(tmp_path / "swift"),
            "--num_key_value_layers",
            "2",
            "--key_value_group_size",
            "2",
            "--serving",
            "true",
        ]
    )
    config = json.loads((tmp_path / "swift/config.json").read_text())
    assert (config["model_type"], config["num_key_value_layers"], config["key_value_group_size"]) == (
        "llama_swiftkv",
        2,
        2,
    )
    assert config["serving_only"] is True
    main(["flops"])
    assert "50% SingleInputKV" in capsys.readouterr().out
    main(["flops", "--model", str(tmp_path / "swift"), "--seq_len", "64"])
    out = capsys.readouterr().out
    assert "SwiftKV l=2/4, g=2" in out and "1.33x more tokens" in out  # 4 / (2 + 2/2) KV layers


def test_cli_rejects_a_folder_that_is_no_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="swiftkv convert: .*not a HF checkpoint folder"):
        main(["convert", "--model", str(tmp_path), "--out_dir", str(tmp_path / "x")])


def test_cli_convert_with_least_squares_kv_init(tmp_path, capsys):
    import inspect

    from transformers import AutoModelForCausalLM

    from tests.distill.conftest import tiny_llama

    base = tiny_llama(tmp_path / "base")  # real SmolLM2 tokenizer, tiny random weights
    text = tmp_path / "docs.txt"
    text.write_text(inspect.getdoc(json) + inspect.getdoc(inspect))
    out = tmp_path / "swift"
    main(["convert", "--model", str(base), "--out_dir", str(out), "--num_key_value_layers", "2",
          "--kv_init_text_files", f"[{text}]"])  # fmt: skip
    assert "least-squares K/V init on" in capsys.readouterr().out
    layers = AutoModelForCausalLM.from_pretrained(out).model.layers
    attn = layers[2].self_attn
    # layer l's own K/V are a linear function of its input: the fit recovers k/v_proj (the published init
    # would too); layer 3's fit must differ from the published copy of its k/v_proj
    torch.testing.assert_close(attn.k_proj_swiftkv.weight, attn.k_proj.weight, atol=2e-3, rtol=0)
    layer3 = layers[3].self_attn
    assert not torch.allclose(layer3.k_proj_swiftkv.weight, layer3.k_proj.weight, atol=1e-2)


def test_cli_commands_run_where_and_in_the_dtype_asked(tmp_path, capsys):
    """``--device`` / ``--dtype``: each command says where it runs; ``convert`` writes the dtype it computed in (an
    8B model in bf16 is 16 GB, not fp32's 32); ``generate`` and ``analyze`` run in that dtype."""
    import inspect

    from safetensors.torch import load_file

    from tests.distill.conftest import tiny_llama

    base = tiny_llama(tmp_path / "base")
    text = tmp_path / "docs.txt"
    text.write_text(inspect.getdoc(json))
    out = tmp_path / "swift"
    main(["convert", "--model", str(base), "--out_dir", str(out), "--num_key_value_layers", "2",
          "--kv_init_text_files", f"[{text}]", "--device", "cpu", "--dtype", "bfloat16"])  # fmt: skip
    printed = capsys.readouterr().out
    assert "swiftkv convert: on CPU (" in printed and "bfloat16 (--device cpu -> cpu)" in printed
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}

    main(["generate", "--model", str(out), "--max_new_tokens", "3", "--dtype", "bfloat16"])
    printed = capsys.readouterr().out
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"bfloat16 (--device auto -> {auto})" in printed and "SwiftKV l=2/4" in printed
    main(["analyze", "--model", str(base), "--out_dir", str(tmp_path / "analyze"), "--device", "cpu"])
    printed = capsys.readouterr().out
    assert "swiftkv analyze: on CPU (" in printed and "float32 (--device cpu -> cpu)" in printed
    assert (tmp_path / "analyze" / "similarity.png").is_file()


def test_weights_that_outgrow_the_device_are_refused_before_any_is_read(tmp_path, capsys, monkeypatch):
    """The count comes from the safetensors headers (every stored number, tied weights once); a device without room
    for them is refused naming what fits: the CPU in bf16 for a GPU, bf16 for fp32; a GPU with more memory else."""
    from swiftkv_core.checkpoints import stored_parameter_count
    from swiftkv_core.commands import check_weights_fit

    model = tiny_base("llama")
    model.save_pretrained(tmp_path / "base")
    count = stored_parameter_count(tmp_path / "base")
    assert count == sum(p.numel() for p in model.parameters())
    assert stored_parameter_count(tmp_path / "none") is None
    base, cpu, gpu = str(tmp_path / "base"), torch.device("cpu"), torch.device("cuda")
    check_weights_fit(base, cpu, torch.float32, have=count * 4)  # fits
    with pytest.raises(
        ValueError, match=r"take .* GiB in float32 and CPU .* use --dtype bfloat16 .* or a device"
    ):
        check_weights_fit(base, cpu, torch.float32, have=count * 3)
    with pytest.raises(ValueError, match=r"in bfloat16 and CPU .*: use a device with more memory\.$"):
        check_weights_fit(base, cpu, torch.bfloat16, have=count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    with pytest.raises(
        ValueError, match=r"and NVIDIA H100 80GB HBM3 has .*: use --device cpu --dtype bfloat16 \("
    ):
        check_weights_fit(base, gpu, torch.bfloat16, have=count)
    # a model that fits goes on through the command
    main(["convert", "--model", base, "--out_dir", str(tmp_path / "swiftkv"), "--device", "cpu"])
    assert "swiftkv convert: on CPU" in capsys.readouterr().out
