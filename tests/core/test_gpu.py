"""CUDA: the SwiftKV forward in bf16 on the GPU agrees with fp32 on the CPU (skipped without a GPU)."""

import pytest
import torch

from swiftkv_core.convert import convert
from tests.conftest import tiny_base


@pytest.mark.gpu
@torch.no_grad()
def test_swiftkv_on_cuda_bf16_matches_cpu():
    model = convert(tiny_base("llama"), 2, 2)
    ids = torch.randint(0, 128, (2, 64))
    expected = model(ids, use_cache=True, logits_to_keep=1).logits
    gpu = model.to("cuda", torch.bfloat16)
    got = gpu(ids.cuda(), use_cache=True, logits_to_keep=1).logits.float().cpu()
    torch.testing.assert_close(got, expected, atol=0.1, rtol=0.05)
    out = gpu.generate(ids.cuda(), max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 68)


@pytest.mark.gpu
@torch.no_grad()
def test_a_checkpoint_is_loaded_straight_onto_the_gpu(tmp_path):
    """``generation.load`` on ``cuda``: every weight and buffer there (RoPE's frequencies in fp32, as on the CPU),
    and the logits of the CPU's load."""
    from swiftkv_core.generation import load

    convert(tiny_base("llama"), 2, 2).save_pretrained(tmp_path)
    ids = torch.randint(0, 128, (1, 64))
    expected = load(tmp_path, need_tokenizer=False)[0](ids).logits
    model, _ = load(tmp_path, torch.bfloat16, need_tokenizer=False, device="cuda")
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cuda"}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(model(ids.cuda()).logits.float().cpu(), expected, atol=0.1, rtol=0.05)


@pytest.mark.gpu
def test_commands_take_the_gpu_in_bf16_by_default(tmp_path, capsys):
    """``swiftkv convert`` (with the least-squares K/V fit), ``generate`` and ``analyze`` with no ``--device``:
    on the GPU, in bf16, and say so; the converted checkpoint is written in bf16."""
    import inspect
    import json

    from swiftkv.cli import main
    from tests.distill.conftest import tiny_llama

    base = tiny_llama(tmp_path / "base")
    text = tmp_path / "docs.txt"
    text.write_text(inspect.getdoc(json))
    out = tmp_path / "swift"
    main(["convert", "--model", str(base), "--out_dir", str(out), "--num_key_value_layers", "2",
          "--kv_init_text_files", f"[{text}]"])  # fmt: skip
    assert "bfloat16 (--device auto -> cuda)" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    main(["generate", "--model", str(out), "--max_new_tokens", "3"])
    assert "bfloat16 (--device auto -> cuda)" in capsys.readouterr().out
    main(["analyze", "--model", str(base), "--out_dir", str(tmp_path / "analyze")])
    assert "bfloat16 (--device auto -> cuda)" in capsys.readouterr().out


@pytest.mark.gpu
@torch.no_grad()
def test_an_offloaded_cache_with_acrosskv_generates_what_the_dynamic_one_does():
    """transformers' offloaded cache (each slot's K/V back to the CPU once used, the next slot prefetched) on a model
    with AcrossKV: the cache holds the slots in use only (``num_kv_shared_layers``), so the prefetch after the last
    group's slot wraps to layer 0's; with an empty slot after it, layer 0 stayed on the CPU and the next step failed."""
    model = convert(tiny_base("llama"), 2, 2).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 128, (1, 32), device="cuda")
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    offloaded = model.generate(ids, cache_implementation="offloaded", **settings)
    assert torch.equal(offloaded, model.generate(ids, **settings))


@pytest.mark.gpu
@torch.no_grad()
def test_early_exit_decoding_on_the_gpu_takes_a_head_loaded_on_the_cpu(tmp_path):
    """``EarlyExitHead.load`` gives the head on the CPU; ``generate_with_early_exit`` on a GPU model moves it there
    (it raised a device mismatch at the first exit)."""
    from swiftkv_core.early_exit import EarlyExitHead, generate_with_early_exit

    model = convert(tiny_base("llama"), 2, 1)
    EarlyExitHead.from_model(model).save(tmp_path)
    head = EarlyExitHead.load(tmp_path)
    gpu = model.swiftkv(True).to("cuda", torch.bfloat16)  # the head stays fp32, as trained
    ids, exited = generate_with_early_exit(
        gpu, head, torch.randint(1, 128, (1, 16), device="cuda"), 6, threshold=0.0
    )
    assert ids.shape == (1, 22) and exited == 5  # every token after the first exits at layer l
