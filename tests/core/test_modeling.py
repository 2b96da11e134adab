"""The SwiftKV forward: equivalences, the real prefill savings, AcrossKV cache size, chunking, padding."""

import pytest
import torch
from torch.testing import assert_close
from transformers import DynamicCache

from swiftkv_core.convert import convert
from tests.conftest import tiny_base


def swift(family="llama", l=2, g=1, seed=0):
    base = tiny_base(family, seed=seed)
    return base, convert(tiny_base(family, seed=seed), l, g)


def greedy_reference(model, ids, steps):
    """Greedy decoding with NO cache: every token through every layer (the full SwiftKV forward)."""
    for _ in range(steps):
        next_token = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_token], 1)
    return ids


@torch.no_grad()
def test_no_skipped_layers_matches_stock_hf(family):
    base, model = swift(family, l=4)
    ids = torch.randint(0, 128, (2, 12))
    assert_close(model(ids).logits, base(ids).logits)
    assert torch.equal(
        model.generate(ids, max_new_tokens=6, do_sample=False),
        base.generate(ids, max_new_tokens=6, do_sample=False),
    )


@torch.no_grad()
@pytest.mark.parametrize("g", [1, 2])
def test_teacher_mode_is_the_original_model(family, g):
    base, model = swift(family, l=2, g=g)
    ids = torch.randint(0, 128, (2, 12))
    assert_close(model.swiftkv(False)(ids).logits, base(ids).logits)
    assert not torch.allclose(model.swiftkv(True)(ids).logits, base(ids).logits)


def count_rows(model):
    """Records the number of positions each decoder layer processes."""
    rows = {}
    for j, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(
            lambda mod, args, kwargs, j=j: rows.setdefault(j, []).append(args[0].shape[1]), with_kwargs=True
        )
    return rows


@torch.no_grad()
@pytest.mark.parametrize("g", [1, 2])
def test_prefill_runs_later_layers_only_for_kept_positions(family, g):
    _, model = swift(family, l=2, g=g)
    ids = torch.randint(0, 128, (2, 20))
    full = model(ids, use_cache=False).logits
    rows = count_rows(model)
    cache = DynamicCache(config=model.config)
    last = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    assert rows == {0: [20], 1: [20], 2: [1], 3: [1]}  # layers >= l: one position, not 20
    assert_close(last[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)
    # logits_to_keep as indices, and as the last N
    idx = torch.tensor([3, 7, 19])
    assert_close(model(ids, logits_to_keep=idx).logits, full[:, idx], atol=1e-5, rtol=1e-5)
    assert_close(model(ids, logits_to_keep=4).logits, full[:, -4:], atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize(("l", "g"), [(2, 1), (1, 3), (2, 2)])
def test_generate_equals_full_forward_and_cache_holds_one_kv_per_group(family, l, g):
    _, model = swift(family, l=l, g=g)
    ids = torch.randint(0, 128, (1, 16))
    rows = count_rows(model)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    assert rows[3][0] == 1 and rows[0][0] == 16  # the prefill skipped layers >= l for prompt tokens
    assert torch.equal(out.sequences, greedy_reference(model, ids, 8))
    L, tokens = 4, out.sequences.shape[1] - 1  # the last generated token is never fed back
    stored = sum(
        layer.keys.shape[2]
        for layer in out.past_key_values.layers
        if getattr(layer, "keys", None) is not None and layer.keys.numel()
    )
    assert stored == (l + (L - l) // g) * tokens
    assert len(out.past_key_values.layers) == l + (L - l) // g  # no empty slot (num_kv_shared_layers)


@torch.no_grad()
@pytest.mark.parametrize(("l", "g"), [(2, 1), (1, 3), (2, 2)])
@pytest.mark.parametrize(
    "mode",
    [dict(cache_implementation="static"), dict(prompt_lookup_num_tokens=3), dict(num_beams=3)],
    ids=["static-cache", "prompt-lookup", "beam-search"],
)
def test_generate_with_each_cache_and_decoding_of_hf_equals_it_without_a_cache(family, l, g, mode):
    """HF ``generate``'s static cache (a mask sized to its maximum length, what compiled decoding uses), prompt
    lookup decoding (drafts from the prompt, the cache cropped where they are rejected) and beam search (the cache
    reordered) give what the same search gives with no cache, every token through every layer."""
    _, model = swift(family, l=l, g=g)
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (1, 9)).repeat(1, 2)  # a repeated prompt: prompt lookup finds drafts in it
    search = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, num_beams=mode.get("num_beams", 1))
    assert torch.equal(
        model.generate(ids, **{**search, **mode}), model.generate(ids, use_cache=False, **search)
    )


@torch.no_grad()
def test_a_cache_built_in_the_other_mode_is_refused_with_the_fix():
    """A cache's slots follow the config it is built from (with AcrossKV, fewer with SwiftKV on): one built while
    SwiftKV was off, used with it on (or the other way), gets a one-line error, not an IndexError or a crash later."""
    from swiftkv_core.kv_cache import make_kv_cache

    _, model = swift(l=2, g=2)
    ids = torch.randint(1, 128, (1, 8))
    for kv_cache_dtype in ("auto", "fp8"):
        with model.swiftkv_mode(False):
            teacher_cache = make_kv_cache(model.config, kv_cache_dtype)
        with model.swiftkv_mode(True):
            student_cache = make_kv_cache(model.config, kv_cache_dtype)
            with pytest.raises(ValueError, match="built while SwiftKV was off; build the cache after"):
                model(ids, past_key_values=teacher_cache, use_cache=True)
            model(ids, past_key_values=student_cache, use_cache=True)
        with model.swiftkv_mode(False), pytest.raises(ValueError, match="built while SwiftKV was on"):
            model(ids, past_key_values=student_cache, use_cache=True)


@torch.no_grad()
def test_early_exit_decoding_takes_a_head_of_another_dtype():
    """The early-exit head saved in the dtype it trained in (fp32 master weights) beside a model cast to bf16, or
    the other way round, decodes in the model's dtype: a vocabulary-sized fp32 projection would read twice the
    bytes of the model's own LM head at every step."""
    from swiftkv_core.early_exit import EarlyExitHead, generate_with_early_exit

    _, model = swift(l=2, g=1)
    head = EarlyExitHead.from_model(model)
    ids = torch.randint(1, 128, (1, 12))
    for model_dtype, head_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        out, exited = generate_with_early_exit(
            model.to(model_dtype), head.to(head_dtype), ids, 4, threshold=0.0
        )
        assert out.shape == (1, 16) and exited == 3, (model_dtype, head_dtype)
        assert head.lm_head.weight.dtype == model_dtype


@torch.no_grad()
def test_chunked_prefill_equals_one_shot(family):
    _, model = swift(family, l=2, g=2)
    ids = torch.randint(0, 128, (1, 23))
    one_shot = model(ids, use_cache=True, logits_to_keep=1)
    cache = DynamicCache(config=model.config)
    for start in range(0, 23, 7):
        chunk = model(ids[:, start : start + 7], past_key_values=cache, use_cache=True, logits_to_keep=1)
    assert_close(chunk.logits, one_shot.logits, atol=1e-5, rtol=1e-5)
    for a, b in zip(cache.layers, one_shot.past_key_values.layers, strict=True):
        if getattr(a, "keys", None) is not None and a.keys.numel():
            assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
    # decoding continues identically from either cache
    next_token = one_shot.logits[:, -1:].argmax(-1)
    assert_close(
        model(next_token, past_key_values=cache).logits,
        model(next_token, past_key_values=one_shot.past_key_values).logits,
        atol=1e-5,
        rtol=1e-5,
    )


@torch.no_grad()
def test_batched_generation_with_left_padding(family):
    _, model = swift(family, l=2, g=1)
    prompts = [torch.randint(1, 128, (n,)) for n in (5, 11, 8)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(batched[i, width:], alone[0, len(p) :]), f"prompt {i}"


def test_gradients_reach_only_swiftkv_parameters():
    _, model = swift("llama", l=2, g=2)
    model.train()
    ids = torch.randint(0, 128, (2, 10))
    model(ids).logits.float().pow(2).mean().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == {n for n, p in model.named_parameters() if "swiftkv" in n}
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in with_grad)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("lora", [0, 4])
def test_the_student_layers_keep_less_for_backward_with_the_same_gradients(family, lora, monkeypatch):
    """Layers >= l recompute their norms and MLP activation in the backward pass: autograd keeps less in them,
    the loss and every gradient stay exactly those of the plain forward."""
    from swiftkv_core import modeling

    _, model = swift(family, l=2, g=1)
    if lora:
        model.add_lora(lora)
        for adapter in (m for m in model.modules() if isinstance(m, modeling.LowRankAdapter)):
            torch.nn.init.normal_(adapter.lora_b, std=0.02)  # adapters start as zero updates: make them act
    model.train()
    ids = torch.randint(0, 128, (2, 24))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept, inside = [], []  # bytes autograd keeps inside layers >= l, beyond the weights (there anyway)
    for layer in model.model.layers[2:]:
        layer.register_forward_pre_hook(lambda *_: inside.append(1))
        layer.register_forward_hook(lambda *_: inside.pop() and None)

    def keep(tensor):
        if inside and tensor.untyped_storage().data_ptr() not in weights:
            kept.append(tensor.nbytes)
        return tensor

    def run():
        model.zero_grad()
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = model(ids).logits.float().pow(2).mean()
        loss.backward()
        return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, sum(kept)

    lean_loss, lean_grads, lean_kept = run()
    monkeypatch.setattr(modeling, "_recomputed", lambda function, *inputs: function(*inputs))
    plain_loss, plain_grads, plain_kept = run()
    assert torch.equal(lean_loss, plain_loss) and lean_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        assert_close(lean_grads[name], grad, rtol=0, atol=0, msg=name)
    # at least one MLP-wide fp32 tensor less per token of each layer >= l (the activation's output; at the 8B
    # shape in bf16 the norms' fp32 copies too: benchmarks/results/distill-memory-cpu-8b-widths.md)
    mlp_wide = ids.numel() * model.config.intermediate_size * 4
    assert plain_kept - lean_kept >= 2 * mlp_wide, (lean_kept, plain_kept)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_hf_gradient_checkpointing_recomputes_the_layers_with_the_same_gradients(family, reentrant):
    """HF's ``gradient_checkpointing_enable`` on a SwiftKV model (what distillation's ``activation_checkpointing``
    sets): the layers keep only their inputs for the backward pass and recompute the rest, the student's lean
    layers included; the loss and every gradient are exactly those without it, with less memory at the peak.
    With ``use_reentrant=True`` too: it sends gradients back to a layer's positional tensors only, and the shared
    K/V of the layers ``>= l`` once came as a keyword (the backward then failed: "backward through the graph a
    second time"). g = 2: one K/V read by two layers."""
    from swiftkv_core.runtime import PeakMemory

    _, model = swift(family, l=2, g=2)
    model.train()
    ids = torch.randint(0, 128, (2, 96))

    def run():
        model.zero_grad(set_to_none=True)
        with PeakMemory("cpu") as meter:  # what the step creates: activations, temporaries, gradients
            loss = model(ids, use_cache=False).logits.float().pow(2).mean()
            loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, meter.peak_bytes

    plain_loss, plain_grads, plain_peak = run()
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    loss, grads, peak = run()
    assert torch.equal(loss, plain_loss) and grads.keys() == plain_grads.keys() and grads
    for name, grad in plain_grads.items():
        assert_close(grads[name], grad, rtol=0, atol=0, msg=name)
    # the peak (in the backward pass, the weights' gradients growing as the layers' activations are freed) holds at
    # least the gate and up projections' outputs of one layer (fp32) less
    mlp_wide = ids.numel() * model.config.intermediate_size * 4
    assert plain_peak - peak >= 2 * mlp_wide, (plain_peak, peak)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_each_module_is_built_once_and_matches_hf(family, monkeypatch):
    """No stock model, decoder layer or attention is built and then replaced; the result has HF's structure."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    from swiftkv_core.convert import swiftkv_config_from

    hf = {"llama": modeling_llama, "qwen2": modeling_qwen2}[family]
    prefix = {"llama": "Llama", "qwen2": "Qwen2"}[family]
    base = tiny_base(family)
    config = swiftkv_config_from(base.config, 2, 2)
    swiftkv_class = type(convert(tiny_base(family), 2, 2))
    attention_inits = []
    real_attention_init = getattr(hf, f"{prefix}Attention").__init__

    def refuse(*args, **kwargs):
        raise AssertionError("a stock module was built")

    for name in ("Model", "DecoderLayer", "ForCausalLM"):
        monkeypatch.setattr(getattr(hf, f"{prefix}{name}"), "__init__", refuse)
    monkeypatch.setattr(
        getattr(hf, f"{prefix}Attention"),
        "__init__",
        lambda self, *a, **k: attention_inits.append(1) or real_attention_init(self, *a, **k),
    )
    model = swiftkv_class(config)
    monkeypatch.undo()
    assert len(attention_inits) == config.num_hidden_layers
    swiftkv = {n for n in model.state_dict() if "swiftkv" in n}
    assert set(model.state_dict()) - swiftkv == set(base.state_dict())
    for (name, module), (base_name, base_module) in zip(
        model.model.layers[0].named_modules(), base.model.layers[0].named_modules(), strict=True
    ):
        assert name == base_name and isinstance(module, type(base_module))


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cast_model_keeps_its_rope_frequencies_and_is_the_model_loaded_in_that_dtype(
    tmp_path, family, dtype
):
    """``model.to(bf16)`` (what Lightning's bf16-true does) leaves RoPE's inverse frequencies in fp32, as
    ``from_pretrained(dtype=bf16)`` does: the cast model and the loaded one give the same logits, far into a long
    prompt, where bf16 frequencies would be radians off."""
    from transformers import AutoModelForCausalLM

    import swiftkv_core  # noqa: F401  (registers the SwiftKV configs with the Auto classes)
    from swiftkv_core.convert import save_checkpoint

    _, model = swift(family)
    expected = {name: buffer.clone() for name, buffer in model.model.rotary_emb.named_buffers()}
    save_checkpoint(model, tmp_path / "ckpt")
    model.to(dtype)
    assert model.lm_head.weight.dtype == dtype and expected
    for name, buffer in model.model.rotary_emb.named_buffers():
        assert buffer.dtype == torch.float32 and torch.equal(buffer, expected[name]), name
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=dtype).eval()
    ids = torch.randint(0, 128, (1, 12))
    positions = torch.arange(8000, 8012)[None]
    for swiftkv in (False, True):
        model.swiftkv(swiftkv), loaded.swiftkv(swiftkv)
        assert torch.equal(
            model(ids, position_ids=positions).logits, loaded(ids, position_ids=positions).logits
        )


def test_swiftkv_key_value_on_another_device_than_the_rotary_embedding():
    """A model split across devices (``device_map``) computes a layer's K/V on the layer's device while the rotary
    embedding's cos/sin stay on its own; only a module's forward moves its inputs. Here the layer sits on the meta
    device and the cos/sin on the CPU."""
    model = convert(tiny_base("llama"), 2).eval()
    x = torch.randn(1, 5, 64)
    cos, sin = model.model.rotary_emb(x, torch.arange(5)[None])
    attention = model.model.layers[3].self_attn.to("meta")
    key, value = attention.swiftkv_key_value(x.to("meta"), (cos, sin))
    assert key.device.type == value.device.type == "meta"
    assert key.shape == value.shape == (1, 2, 5, 16)
