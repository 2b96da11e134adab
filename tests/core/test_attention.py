"""The SwiftKV prefill with each attention implementation: layers >= l run for the kept rows only (what makes
prefill cheaper), and the logits equal sdpa's, on a Llama (g=1) and, for the main cases, a Qwen2 with AcrossKV (g=2).
flex_attention compiles its kernels on first use (about ten seconds a shape on a CPU). flash_attention_2 runs
flash-attn where it is installed with a GPU; elsewhere transformers' flash path runs on the CPU with flash-attn's
kernels written in plain PyTorch (``tests/flash_reference.py``), which a ``gpu`` test compares with flash-attn; so
does a flash-attn kernel from the hub (``kernels-community/flash-attn3``) by the same path."""

from __future__ import annotations

import contextlib
import copy
import importlib.util

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

from swiftkv_core.convert import convert
from tests.conftest import FLEX_HEADS, tiny_base
from tests.flash_reference import flash_attention_2_on_the_reference

# a flash-attn kernel from the hub (FA3 on Hopper), registered as transformers registers one it downloads (its
# flash-attn entry points through transformers' flash path and mask), here with the reference kernels: no hub
HUB_FLASH = "kernels-community/flash-attn3"
AttentionInterface.register(HUB_FLASH, flash_attention_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(HUB_FLASH, flash_attention_mask)
IMPLEMENTATIONS = ["eager", "sdpa", "flex_attention", "flash_attention_2", HUB_FLASH]
FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    """flex_attention compiles its kernels per shape; after a few recompilations in one process torch 2.13's CPU
    code generation can fail (an inductor bug, CPU only): every test starts from empty compile caches."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def rows_through_layers_from_l(model, run) -> set[int]:
    """The number of query rows each SwiftKV layer (>= l) saw during ``run()``."""
    seen = set()
    l = model.config.num_key_value_layers
    hooks = [
        layer.register_forward_pre_hook(
            lambda _m, args, kwargs: seen.add(args[0].shape[1] if args else kwargs["hidden_states"].shape[1]),
            with_kwargs=True,
        )
        for layer in model.model.layers[l:]
    ]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@pytest.fixture(scope="module")
def swift():
    return convert(tiny_base("llama", **FLEX_HEADS), 2, 1)


@pytest.fixture(scope="module", params=["llama-g1", "qwen2-g2"])
def swift_family(request, swift):
    """The Llama (g=1) above, and a Qwen2 (q/k/v biases) with AcrossKV (g=2: layers 2 and 3 share one K/V)."""
    if request.param == "llama-g1":
        return swift
    return convert(tiny_base("qwen2", **FLEX_HEADS), 2, 2)


def model_and_kernels(swift, implementation: str):
    """The model to run ``implementation`` on and the kernels' context: for flash_attention_2 a bf16 copy on the GPU
    (flash-attn takes no fp32) where flash-attn is installed, else (and for the hub kernel) the CPU model on the
    reference kernels."""
    if "flash" not in implementation:
        return swift, contextlib.nullcontext()
    if FLASH_ATTN and implementation == "flash_attention_2":
        return copy.deepcopy(swift).to("cuda", torch.bfloat16), contextlib.nullcontext()
    return swift, reached(flash_attention_2_on_the_reference())


@contextlib.contextmanager
def reached(kernels):
    """``kernels``, and at the end the check that the forward called them (not a path around flash-attn)."""
    with kernels as seen:
        yield seen
    assert seen, "the flash_attention_2 path never called its kernels"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("keep", [1, 3], ids=lambda k: f"last{k}")
def test_kept_rows_only_and_the_same_logits_as_sdpa(swift_family, implementation, keep):
    model, kernels = model_and_kernels(swift_family, implementation)
    device = model.device.type
    ids = torch.randint(1, 128, (2, 40), device=device)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0  # a left-padded row, as generate() batches prompts
    with torch.no_grad(), kernels:
        model.config._attn_implementation = (
            "sdpa"  # every row through every layer: no kept-rows mask involved
        )
        reference = model(ids, attention_mask=mask).logits[:, -keep:]
        model.config._attn_implementation = implementation
        out = {}
        rows = rows_through_layers_from_l(
            model, lambda: out.update(logits=model(ids, attention_mask=mask, logits_to_keep=keep).logits)
        )
    model.config._attn_implementation = "sdpa"
    assert rows == {keep}  # layers >= l ran for the kept rows only
    torch.testing.assert_close(out["logits"], reference, atol=2e-5 if device == "cpu" else 2e-2, rtol=0)


def test_generate_through_the_flash_attention_path_matches_sdpa(swift):
    """``generate`` on a left-padded batch: the prompt's kept row, then decode steps against the cache (transformers
    unpads them for flash-attn's variable-length kernel), the same tokens and scores as sdpa."""
    model, kernels = model_and_kernels(swift, "flash_attention_2")
    device = model.device.type
    ids = torch.randint(1, 128, (2, 20), device=device)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    out = {}
    with kernels:
        for implementation in ("sdpa", "flash_attention_2"):
            model.config._attn_implementation = implementation
            out[implementation] = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=8,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
    model.config._attn_implementation = "sdpa"
    if device == "cpu":
        assert torch.equal(out["flash_attention_2"].sequences, out["sdpa"].sequences)
    # in bf16 (a GPU) a near-tie may pick another token later on: the first step's scores only there
    steps = len(out["sdpa"].scores) if device == "cpu" else 1
    for flash, sdpa in zip(out["flash_attention_2"].scores[:steps], out["sdpa"].scores[:steps], strict=True):
        torch.testing.assert_close(flash, sdpa, atol=2e-5 if device == "cpu" else 2e-2, rtol=0)


# flex_attention with a static cache is left out: on this CPU torch 2.13's compiled flex_attention gets it wrong in
# stock transformers too (a Llama's logits 1.6 off sdpa's), and fails to compile after a few shapes
@pytest.mark.parametrize(
    ("implementation", "cache_class"),
    [("eager", "DynamicCache"), ("flex_attention", "DynamicCache"), ("eager", "StaticCache")],
)
def test_any_kept_positions_with_a_cache_match_sdpa(swift, implementation, cache_class):
    """A chunk after a cached prefix and an arbitrary set of kept positions (the distillation's position subsets),
    with a 2-D mask; in a static cache too (its keys and transformers' masks run to its maximum length, past the
    2-D mask: what ``generate(cache_implementation="static")`` and compiled decoding use), sdpa's kept rows
    among them."""
    import transformers

    def new_cache():
        if cache_class == "StaticCache":
            return transformers.StaticCache(config=swift.config, max_cache_len=64)
        return transformers.DynamicCache(config=swift.config)

    ids = torch.randint(1, 128, (1, 48))
    mask = torch.ones_like(ids)
    keep = torch.tensor([0, 7, 20, 31])  # positions of the 32-token chunk after 16 cached tokens
    out = {}
    swift.config._attn_implementation = "sdpa"  # the reference: the whole chunk through every layer
    with torch.no_grad():
        cache = new_cache()
        swift(ids[:, :16], past_key_values=cache, use_cache=True)
        whole = swift(ids[:, 16:], attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, keep]
    for impl in ("sdpa", implementation):
        swift.config._attn_implementation = impl
        cache = new_cache()
        with torch.no_grad():
            swift(ids[:, :16], past_key_values=cache, use_cache=True)
            chunk = dict(attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=keep)
            rows = rows_through_layers_from_l(
                swift, lambda impl=impl, chunk=chunk: out.update({impl: swift(ids[:, 16:], **chunk).logits})
            )
        assert rows == {len(keep)}
    swift.config._attn_implementation = "sdpa"
    for impl in ("sdpa", implementation):
        torch.testing.assert_close(out[impl], whole, atol=2e-5, rtol=0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_packed_rows_given_one_row_of_positions_match_the_whole_forward(swift_family, implementation):
    """Two rows of two packed sequences each, their positions given as ONE row for the whole batch (transformers
    widens it): the kept rows (the last ones, then any) have the logits of sdpa's whole forward there. flash-attn has
    no kept-rows form for packed rows (every row runs layers >= l); the others run the kept rows alone."""
    model, kernels = model_and_kernels(swift_family, implementation)
    device = model.device.type
    ids = torch.randint(1, 128, (2, 24), device=device)
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None].to(device)
    with torch.no_grad(), kernels:
        model.config._attn_implementation = "sdpa"
        whole = model(ids, position_ids=positions, use_cache=False).logits
        model.config._attn_implementation = implementation
        for keep in (3, torch.tensor([2, 11, 12, 23], device=device)):
            out = {}
            rows = rows_through_layers_from_l(
                model,
                lambda keep=keep, out=out: out.update(
                    logits=model(ids, position_ids=positions, use_cache=False, logits_to_keep=keep).logits
                ),
            )
            kept = slice(-keep, None) if isinstance(keep, int) else keep
            expected_rows = 24 if "flash" in implementation else len(whole[0, kept])
            assert rows == {expected_rows}
            torch.testing.assert_close(
                out["logits"], whole[:, kept], atol=2e-5 if device == "cpu" else 2e-2, rtol=0
            )
    model.config._attn_implementation = "sdpa"


@pytest.mark.parametrize("implementation", ["flex_attention", "flash_attention_2", HUB_FLASH])
def test_packed_rows_over_several_blocks_match_sdpa(swift, implementation):
    """Rows longer than flex_attention's 128-token blocks (blocks a sequence cannot see skipped, blocks cut by a
    sequence's start masked), a one-token sequence, a row ending in padding (collate's: positions restarting, its own
    sequence), positions given per row: the whole forward and the kept rows have sdpa's logits (its dense mask)."""
    model, kernels = model_and_kernels(swift, implementation)
    device = model.device.type
    lengths = ([130, 1, 169], [200, 60, 40])  # the second row's last 40: padding
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths]).to(device)
    ids = torch.randint(1, 128, (2, 300), device=device)
    ids[1, 260:] = 0
    atol = 2e-5 if device == "cpu" else 2e-2
    with torch.no_grad(), kernels:
        model.config._attn_implementation = "sdpa"
        whole = model(ids, position_ids=positions, use_cache=False).logits
        model.config._attn_implementation = implementation
        out = model(ids, position_ids=positions, use_cache=False).logits
        torch.testing.assert_close(out, whole, atol=atol, rtol=0)
        keeps = [5] if "flash" in implementation else [5, torch.tensor([0, 129, 130, 131, 250, 299])]
        for keep in keeps:
            kept = slice(-keep, None) if isinstance(keep, int) else keep.to(device)
            out = model(ids, position_ids=positions, use_cache=False, logits_to_keep=keep).logits
            torch.testing.assert_close(out, whole[:, kept], atol=atol, rtol=0)
    model.config._attn_implementation = "sdpa"


@pytest.mark.parametrize("given", ["an all-ones mask", "a cache", "varlen arguments"])
def test_flash_attention_runs_every_row_where_it_keeps_sequences_apart_by_itself(swift, given):
    """ONE row of two packed sequences: transformers' flash path keeps them apart from the positions by itself, with
    an all-ones mask or a cache too (not sdpa's rule), and a caller may give flash-attn's variable-length arguments
    directly. Neither has a kept-rows form (the kept rows alone would attend across the sequences, or past the
    arguments' rows): layers >= l run every row, and the kept logits are the whole forward's."""
    model, kernels = model_and_kernels(swift, "flash_attention_2")
    device = model.device.type
    ids = torch.randint(1, 128, (1, 24), device=device)
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None].to(device)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32, device=device)
    inputs = {
        "an all-ones mask": dict(
            position_ids=positions, attention_mask=torch.ones_like(ids), use_cache=False
        ),
        "a cache": dict(position_ids=positions, use_cache=True),
        "varlen arguments": dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=14, max_length_k=14),
    }[given]
    model.config._attn_implementation = "flash_attention_2"
    with torch.no_grad(), kernels:
        whole = model(ids, **inputs).logits
        for keep in (3, 16):
            out = {}
            rows = rows_through_layers_from_l(
                model,
                lambda keep=keep, out=out: out.update(
                    logits=model(ids, **inputs, logits_to_keep=keep).logits
                ),
            )
            assert rows == {24}
            torch.testing.assert_close(
                out["logits"], whole[:, -keep:], atol=2e-5 if device == "cpu" else 2e-2, rtol=0
            )
    model.config._attn_implementation = "sdpa"
    # the sequences were kept apart, as sdpa keeps them without a mask or a cache
    if given != "varlen arguments":
        with torch.no_grad():
            packed = model(ids, position_ids=positions, use_cache=False).logits
        torch.testing.assert_close(whole, packed, atol=2e-5 if device == "cpu" else 2e-2, rtol=0)


def test_flex_attention_runs_every_row_for_a_callers_own_4d_mask(swift):
    """flex_attention's kept-rows block mask reads a 2-D padding mask; a caller's 4-D mask (or BlockMask) has no
    kept-rows form here: layers >= l then run every row (``NO_SUBSET``), as they do without SwiftKV. The choice is
    checked, not a forward: flex_attention with a 4-D mask crashes on this CPU inside torch, without SwiftKV too."""
    from swiftkv_core.modeling import NO_SUBSET, _kept_rows_mask

    config = copy.deepcopy(swift.config)
    config._attn_implementation = "flex_attention"
    embeds = torch.zeros(2, 24, config.hidden_size)
    mask_kwargs = dict(
        config=config, inputs_embeds=embeds, past_key_values=None, position_ids=torch.arange(24)[None]
    )
    block = torch.ones(2, 1, 24, 24, dtype=torch.bool).tril()
    assert (
        _kept_rows_mask({**mask_kwargs, "attention_mask": block}, None, slice(-3, None), False, {})
        is NO_SUBSET
    )
    padding = torch.ones(2, 24, dtype=torch.long)
    padding[0, :4] = 0
    kept = _kept_rows_mask({**mask_kwargs, "attention_mask": padding}, None, slice(-3, None), False, {})
    assert kept is not NO_SUBSET and kept.shape[-2:] == (3, 24)  # a BlockMask of the kept rows


def test_flex_attention_is_refused_where_torchs_cpu_kernel_is_wrong(monkeypatch):
    """On a CPU with AVX2 and no AVX-512, torch 2.13's compiled flex_attention is wrong below head_dim 32 (the
    kept-rows tests above gave NaN logits with head_dim 16 there): such a model's forward is refused, with the fix,
    before a layer runs. head_dim 32, a GPU and an AVX-512 CPU are not refused."""
    from swiftkv_core.runtime import check_flex_attention

    model = convert(tiny_base("llama"), 2, 1)
    assert model.model.layers[0].self_attn.head_dim == 16
    model.config._attn_implementation = "flex_attention"
    ran = []
    model.model.layers[0].register_forward_pre_hook(lambda *_: ran.append(True))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with pytest.raises(ValueError, match=r"head_dim 16 .* Use attn_implementation='sdpa'"):
        model(torch.randint(1, 128, (1, 8)))
    assert not ran
    check_flex_attention(32, torch.device("cpu"))
    check_flex_attention(16, torch.device("cuda"))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    check_flex_attention(16, torch.device("cpu"))


def test_a_plain_prompt_gives_sdpa_no_mask_and_the_kept_rows_only_theirs(monkeypatch):
    """A prompt without padding whose positions count on from the cache (given or not, as ``generate`` gives
    them): sdpa's ``is_causal`` for layers < l, and for the kept rows of layers >= l a mask of those rows alone (the
    full one is prompt length squared: 16 GiB at 128k tokens), with the logits of eager attention's full masks.
    Under torch.compile with torch < 2.13, transformers builds the causal mask for every prompt (dynamo folds
    ``torch.compiler.is_exporting()`` to True), and sdpa then leaves its flash kernels: emulated here by making
    transformers' check answer as it does under that compile."""
    import transformers.masking_utils

    model = convert(tiny_base("llama"), 2, 1).eval()
    l = model.config.num_key_value_layers
    ids = torch.randint(1, 100, (2, 24))
    masks = {0: [], l: []}
    for j, seen in masks.items():
        model.model.layers[j].register_forward_pre_hook(
            lambda _m, _args, kwargs, seen=seen: seen.append(kwargs["attention_mask"]), with_kwargs=True
        )
    monkeypatch.setattr(transformers.masking_utils, "is_torchdynamo_exporting", lambda: True)
    ones, counting = torch.ones_like(ids), torch.arange(24)[None]
    with torch.no_grad():
        for keep in (1, 3, torch.tensor([2, 9, 23])):
            model.config._attn_implementation = "eager"
            expected = model(ids, logits_to_keep=keep).logits
            model.config._attn_implementation = "sdpa"
            rows = keep if isinstance(keep, int) else len(keep)
            for given in ({}, {"attention_mask": ones, "position_ids": counting}):
                masks[0].clear(), masks[l].clear()
                logits = model(ids, logits_to_keep=keep, **given).logits
                torch.testing.assert_close(logits, expected, atol=2e-5, rtol=0)
                (below,), (kept,) = masks[0], masks[l]
                assert below is None  # is_causal: the flash kernels' case
                assert kept.shape[-2:] == (rows, 24) and kept.untyped_storage().nbytes() == rows * 24
        # where the positions alone do not give the mask, transformers' masks: padding, packed positions, a 4-D
        # mask of the caller's own, the kept rows taken from the one mask layers < l hold, no second one of prompt
        # length squared (and with earlier tokens cached, layers < l need a mask too)
        padded = ones.clone()
        padded[0, :3] = 0
        packed = torch.cat([torch.arange(12), torch.arange(12)])[None].expand(2, -1)
        custom = torch.ones(2, 1, 24, 24, dtype=torch.bool)
        cache = model(ids[:, :8], use_cache=True).past_key_values
        masks[0].clear()
        for given in ({"attention_mask": padded}, {"position_ids": packed}, {"attention_mask": custom}):
            masks[l].clear()
            model(ids, logits_to_keep=1, **given)
            below, kept = masks[0][-1], masks[l][0]
            assert kept.shape[-2:] == (1, 24) and below.shape[-2:] == (24, 24)
            assert kept.untyped_storage().data_ptr() == below.untyped_storage().data_ptr()
        model(ids[:, 8:], past_key_values=cache, use_cache=True)
        assert len(masks[0]) == 4 and all(mask is not None for mask in masks[0])


@pytest.mark.gpu
@pytest.mark.skipif(not FLASH_ATTN, reason="flash-attn is not installed")
def test_the_flash_reference_computes_what_flash_attn_does():
    """``tests/flash_reference.py`` (what the CPU tests run for flash-attn) against flash-attn itself: grouped heads,
    a bottom-right causal mask with fewer queries than keys, and variable-length sequences."""
    import flash_attn

    from tests import flash_reference

    torch.manual_seed(0)
    q = torch.randn(2, 5, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 19, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for causal in (False, True):
        torch.testing.assert_close(
            flash_reference.flash_attn_func(q, k, v, causal=causal),
            flash_attn.flash_attn_func(q, k, v, causal=causal),
            atol=2e-2,
            rtol=0,
        )
    cu = torch.tensor([0, 7, 19, 38], device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(38, heads, 64, device="cuda", dtype=torch.bfloat16) for heads in (8, 2, 2))
    torch.testing.assert_close(
        flash_reference.flash_attn_varlen_func(q, k, v, cu, cu, 19, 19, causal=True),
        flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 19, 19, causal=True),
        atol=2e-2,
        rtol=0,
    )
