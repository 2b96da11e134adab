"""The FP8 KV cache: e4m3 round trip and scales, bytes equal to the accounting, closeness to the plain cache,
AcrossKV, SwiftKV on and off, chunked prefill, left padding, bad input."""

import pytest
import torch
from torch.testing import assert_close
from transformers import DynamicCache

from swiftkv.cli import main
from swiftkv_core.commands import generate as cli_generate
from swiftkv_core.convert import convert
from swiftkv_core.flops import LLAMA_3_1_70B, ModelShape, kv_cache_bytes_per_token
from swiftkv_core.kv_cache import (
    FP8_DTYPE,
    FP8KVCache,
    FP8KVLayer,
    dequantize_fp8,
    kv_cache_nbytes,
    make_kv_cache,
    quantize_fp8,
    storage_name,
)
from swiftkv_core.runtime import PeakMemory
from tests.conftest import tiny_base

# e4m3 keeps 3 mantissa bits: round-to-nearest is within 2^-4 of |x| for normal numbers; below e4m3's smallest
# normal (2^-6, in units of the scale) the spacing is 2^-9, so the absolute error is at most 2^-10 * scale.
E4M3_RELATIVE, E4M3_SUBNORMAL = 2**-4, 2**-10
# FP8 vs plain cache on the tiny random models (weights scaled x4, so their logits are very sensitive): measured
# max |logit error| / max |logit| 0.054-0.074 and top-1 agreement 0.89-0.97 over 5 seeds; the bounds allow
# twice one e4m3 rounding (2^-3) and 80% agreement.
LOGIT_RELATIVE_ERROR, TOP1_AGREEMENT = 2**-3, 0.8


def bits(t):
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def test_quantise_dequantise_round_trip_and_scales():
    torch.manual_seed(0)
    # per (token, head) magnitudes over 8 orders, one all-zero vector
    x = torch.randn(2, 3, 40, 16) * torch.logspace(-4, 4, 40)[:, None]
    x[1, 2, 5] = 0
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (2, 3, 40, 1)  # one per token and KV head
    assert_close(scale, (x.abs().amax(-1, keepdim=True) / 448).clamp_min(torch.finfo(torch.float32).tiny))
    back = dequantize_fp8(q, scale, torch.float32)
    assert torch.all((back - x).abs() <= E4M3_RELATIVE * x.abs() + E4M3_SUBNORMAL * scale)
    # each vector's largest element maps to 448 and back exactly (up to the fp32 product)
    largest = x.abs().argmax(-1, keepdim=True)
    assert_close(back.gather(-1, largest), x.gather(-1, largest), rtol=1e-6, atol=0)
    assert torch.all(back[1, 2, 5] == 0)
    assert dequantize_fp8(q, scale, torch.bfloat16).dtype == torch.bfloat16


# The FP8 cache's conversions hold one float32 temporary at most. Every decode step dequantises each layer's whole
# cache, and a prefill quantises each layer's new K/V: a float32 copy, then a product out of place, held two.
# (PeakMemory sees the tensors the operations return; a CPU kernel's own copies of mixed-dtype operands it does not,
# so on the CPU the conversions keep every operation in one dtype; CUDA's kernels convert on the fly.)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_dequantising_rounds_once_with_one_float32_temporary_at_most(dtype, device):
    """Each element is its e4m3 value times its scale in float32, rounded once to the compute dtype (as the
    float32 product would be); the memory taken beside the result: one float32 copy on the CPU, none on CUDA."""
    torch.manual_seed(0)
    q, scale = quantize_fp8(
        torch.randn(2, 4, 64, 128, device=device) * torch.logspace(-3, 3, 64, device=device)[:, None]
    )
    with PeakMemory(device) as meter:
        out = dequantize_fp8(q, scale, dtype)
    assert out.dtype == dtype and torch.equal(out, (q.float() * scale).to(dtype))
    float32_copy = 0 if device == "cuda" or dtype == torch.float32 else q.numel() * 4
    assert meter.peak_bytes - meter.resident_bytes == out.nbytes + float32_copy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantising_gives_the_float32_quotients_rounded_with_one_float32_temporary(dtype):
    x = (torch.randn(2, 4, 64, 128) * torch.logspace(-3, 3, 64)[:, None]).to(dtype)
    with PeakMemory("cpu") as meter:
        q, scale = quantize_fp8(x)
    expected = (x.float() / scale).clamp(-448, 448).to(FP8_DTYPE)
    assert torch.equal(bits(q), bits(expected))
    # the float32 quotients, the e4m3 result and the scales (with the amax's own)
    assert meter.peak_bytes <= x.numel() * (4 + 1) + 2 * scale.nbytes


def test_per_token_scales_make_quantisation_independent_of_other_tokens():
    x = torch.randn(2, 2, 30, 8)
    whole = quantize_fp8(x)
    parts = [quantize_fp8(x[:, :, :11]), quantize_fp8(x[:, :, 11:])]
    for i in range(2):
        assert torch.equal(bits(whole[i]), bits(torch.cat([p[i] for p in parts], dim=-2)))
    assert torch.equal(bits(quantize_fp8(x[1:])[0]), bits(whole[0][1:]))  # batch rows too


def test_layer_reorder_and_crop_keep_the_scales_aligned():
    layer = FP8KVLayer()
    layer.update(torch.randn(3, 2, 9, 8), torch.randn(3, 2, 9, 8))
    keys, values = layer.dequantized()
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    assert torch.equal(layer.dequantized()[0], keys[[2, 0, 1]])
    layer.crop(-3)
    assert layer.get_seq_length() == 6
    assert torch.equal(layer.dequantized()[1], values[[2, 0, 1], :, :6])
    layer.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer.dequantized()[0], keys[[0], :, :6])


def swift(family, l, g, swiftkv=True, dtype=torch.float32):
    return convert(tiny_base(family), l, g).swiftkv(swiftkv).to(dtype)


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(("l", "g", "swiftkv"), [(2, 2, False), (2, 1, True), (2, 2, True), (1, 3, True)])
@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"),
    [(torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float32, "fp8"), (torch.bfloat16, "fp8")],
)
def test_bytes_held_equal_the_accounting(family, l, g, swiftkv, dtype, kv_cache_dtype):
    model = swift(family, l, g, swiftkv, dtype)
    batch, tokens = 2, 13
    cache = make_kv_cache(model.config, kv_cache_dtype)
    model(torch.randint(0, 128, (batch, tokens)), past_key_values=cache, use_cache=True, logits_to_keep=1)
    storage = storage_name(dtype, kv_cache_dtype)
    per_token = kv_cache_bytes_per_token(
        ModelShape.from_config(model.config), l if swiftkv else None, g if swiftkv else 1, storage
    )
    assert kv_cache_nbytes(cache) == per_token * batch * tokens
    if kv_cache_dtype == "fp8":  # one e4m3 K/V per AcrossKV group under SwiftKV; every layer in the teacher
        written = [layer for layer in cache.layers if layer.get_seq_length()]
        assert len(written) == (model.config.num_kv_cache_layers if swiftkv else 4)
        assert all(
            layer.keys.dtype == FP8_DTYPE and layer.key_scales.dtype == torch.float32 for layer in written
        )


def decode_logits(model, ids, cache, prefill=8):
    """Next-token logits of every position after the prefill: prefill, then one token at a time through the cache."""
    logits = [model(ids[:, :prefill], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]]
    for t in range(prefill, ids.shape[1]):
        logits.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(logits, 1)


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(("l", "g", "swiftkv"), [(2, 2, False), (2, 2, True), (1, 3, True)])
def test_fp8_cache_is_close_to_the_plain_cache(family, l, g, swiftkv):
    model = swift(family, l, g, swiftkv)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (4, 40))
    plain = decode_logits(model, ids, DynamicCache(config=model.config))
    fp8 = decode_logits(model, ids, FP8KVCache(model.config))
    assert (fp8 - plain).abs().max() <= LOGIT_RELATIVE_ERROR * plain.abs().max()
    assert (fp8.argmax(-1) == plain.argmax(-1)).float().mean() >= TOP1_AGREEMENT


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("swiftkv", [False, True])
def test_chunked_prefill_and_token_by_token_equal_one_shot(family, swiftkv):
    """Per-token scales: the cache stores the same bits however the prompt is split, and one forward through the
    cache gives the logits of decoding token by token (each query reads the dequantised K/V of its past)."""
    model = swift(family, 2, 2, swiftkv)
    ids = torch.randint(0, 128, (2, 23))
    one_shot_cache = FP8KVCache(model.config)
    one_shot = model(ids, past_key_values=one_shot_cache, use_cache=True).logits
    chunked_cache = FP8KVCache(model.config)
    for start in range(0, 23, 7):
        chunk = model(
            ids[:, start : start + 7], past_key_values=chunked_cache, use_cache=True, logits_to_keep=1
        )
    assert_close(chunk.logits[:, -1], one_shot[:, -1], atol=1e-5, rtol=1e-5)
    for a, b in zip(chunked_cache.layers, one_shot_cache.layers, strict=True):
        if a.get_seq_length():
            # the same codes, except where float noise in K/V sits on a rounding boundary
            for name in ("keys", "values"):
                assert (bits(getattr(a, name)) != bits(getattr(b, name))).float().mean() < 1e-3, name
            assert_close(a.key_scales, b.key_scales, rtol=1e-5, atol=0)
            assert_close(a.value_scales, b.value_scales, rtol=1e-5, atol=0)
    by_token = decode_logits(model, ids, FP8KVCache(model.config), prefill=1)
    assert_close(by_token, one_shot, atol=1e-4, rtol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("swiftkv", [False, True])
def test_left_padded_batch_generates_as_each_prompt_alone(family, swiftkv):
    model = swift(family, 2, 2, swiftkv)
    prompts = [torch.randint(1, 128, (n,)) for n in (5, 11, 8)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    batched = model.generate(ids, attention_mask=mask, past_key_values=FP8KVCache(model.config), **options)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], past_key_values=FP8KVCache(model.config), **options)
        assert torch.equal(batched[i, width:], alone[0, len(p) :]), f"prompt {i}"


def test_unknown_kv_cache_dtypes_are_refused_before_any_work(tmp_path):
    config = swift("llama", 2, 2).config
    with pytest.raises(ValueError, match="'auto'.*'fp8'"):
        make_kv_cache(config, "fp4")
    with pytest.raises(ValueError, match="fp8.*float32 scale"):
        kv_cache_bytes_per_token(ModelShape.from_config(config), kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype='e5m2'"):  # before loading the (missing) model
        cli_generate(model=str(tmp_path / "missing"), kv_cache_dtype="e5m2")


def test_paper_setting_memory_and_the_flops_command(tmp_path, capsys):
    """Sec. 5.3: 50% SingleInputKV + 2-way AcrossKV + FP8 is -62.5% of the bf16 KV cache without scales; our
    float32 scale per token and KV head adds 4 bytes per 128 elements: 1 - 0.75 * (128 + 4) / 256 = 61.3%."""
    bf16 = kv_cache_bytes_per_token(LLAMA_3_1_70B)
    fp8 = kv_cache_bytes_per_token(LLAMA_3_1_70B, 40, 2, "fp8")
    assert fp8 == 2 * 60 * 8 * (128 + 4) and 1 - fp8 / bf16 == pytest.approx(0.61328125)
    convert(tiny_base("llama"), 2, 2).save_pretrained(tmp_path / "swift")
    main(["flops", "--model", str(tmp_path / "swift"), "--kv_cache_dtype", "fp8"])
    out = capsys.readouterr().out  # 2 * 4 layers * 2 heads * (16 + 4) = 320 B -> 3 layers: 240 B
    assert "KV cache per token (fp8): 0.3 KiB -> 0.2 KiB (1.33x more tokens" in out
    assert "53.1% less than the original model in bf16" in out  # 1 - 240 / (2 * 4 * 2 * 16 * 2)
    with pytest.raises(SystemExit, match="swiftkv flops: .*'fp4' is unknown"):
        main(["flops", "--model", str(tmp_path / "swift"), "--kv_cache_dtype", "fp4"])


@pytest.mark.parametrize("g", [1, 2])
def test_the_fp8_cache_holds_one_groups_dequantised_kv_at_a_time(g, monkeypatch):
    """An FP8 cache's reads are dequantised copies of a layer's whole cache. The SwiftKV forward takes each AcrossKV
    group's as its first layer runs and lets it go after its last: as each layer >= l starts, only its group's K and
    V are alive. Taken all at once, every group's copy was alive beside the FP8 cache: more memory than a bf16
    cache, whose reads are the stored tensors themselves."""
    import weakref

    model = convert(tiny_base("llama", num_hidden_layers=6), 2, g).eval()
    reads = []
    dequantized = FP8KVLayer.dequantized

    def recorded(layer):
        out = dequantized(layer)
        reads.extend(weakref.ref(t) for t in out)
        return out

    monkeypatch.setattr(FP8KVLayer, "dequantized", recorded)
    alive = []
    for layer in model.model.layers[2:]:
        layer.register_forward_pre_hook(lambda *_: alive.append(sum(r() is not None for r in reads)))
    cache = make_kv_cache(model.config, "fp8")
    with torch.no_grad():
        out = model(torch.tensor([[5, 17, 3, 99, 42, 7, 64, 11]]), past_key_values=cache, use_cache=True)
        model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)  # a decode step
    assert len(alive) == 2 * 4 and max(alive) == 2, alive
