"""flash-attn's two entry points that transformers' ``flash_attention_2`` calls, written in plain PyTorch so that
transformers' flash-attn path (its padding, variable-length and packed-sequence handling) and SwiftKV's use of it
run on a CPU, where flash-attn cannot be installed. Semantics as flash-attn 2.x documents them: tensors are
(tokens, heads, dim), grouped K/V heads are shared by consecutive query heads, and the causal mask is aligned to
the BOTTOM-RIGHT corner (query ``i`` of ``q_len`` sees key ``j`` iff ``j <= i + k_len - q_len``; a row that sees
no key gives 0). Only what the project's models use: no dropout, sliding window, softcap or ALiBi. Where
flash-attn is installed on a GPU, a test compares it with this."""

from __future__ import annotations

import contextlib
import functools

import torch


def _attend(q, k, v, softmax_scale, causal):
    """One sequence: q (q_len, heads, dim), k/v (k_len, kv_heads, dim) -> (q_len, heads, dim)."""
    q_len, heads, dim = q.shape
    k_len, kv_heads = k.shape[:2]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if causal:
        seen = torch.arange(k_len, device=q.device)[None] <= (
            torch.arange(q_len, device=q.device)[:, None] + k_len - q_len
        )
        scores = scores.masked_fill(~seen, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees no key: 0, as flash-attn
    return torch.einsum("hqk,khd->qhd", weights, v.float()).to(q.dtype)


def _check(dropout_p, window_size, softcap, alibi_slopes):
    if dropout_p or tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None:
        raise NotImplementedError("the reference has no dropout, sliding window, softcap or ALiBi")


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (batch, q_len, heads, dim), k/v (batch, k_len, kv_heads, dim)."""
    _check(dropout_p, window_size, softcap, alibi_slopes)
    return torch.stack([_attend(*row, softmax_scale, causal) for row in zip(q, k, v, strict=True)])


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """q (total_q, heads, dim), k/v (total_k, kv_heads, dim); sequence ``s`` is rows ``cu_seqlens[s]:cu_seqlens[s+1]``."""
    _check(dropout_p, window_size, softcap, alibi_slopes)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(starts_q) != len(starts_k):
        raise ValueError(f"cu_seqlens_q has {len(starts_q)} entries, cu_seqlens_k {len(starts_k)}")
    out = torch.zeros_like(q)
    for s in range(len(starts_q) - 1):
        rows_q, rows_k = slice(starts_q[s], starts_q[s + 1]), slice(starts_k[s], starts_k[s + 1])
        if rows_q.stop - rows_q.start > int(max_seqlen_q) or rows_k.stop - rows_k.start > int(max_seqlen_k):
            raise ValueError(f"sequence {s} is longer than max_seqlen_q/k")
        out[rows_q] = _attend(q[rows_q], k[rows_k], v[rows_k], softmax_scale, causal)
    return out


@contextlib.contextmanager
def flash_attention_2_on_the_reference(half_only: bool = False):
    """transformers' ``flash_attention_2`` path with this module's kernels (and transformers' own pad/unpad). Yields
    the dtype of each kernel call's queries. ``half_only``: fp32 is refused, as flash-attn refuses it (it computes in
    fp16 and bf16 only); the tests that compare the path's masking with sdpa's exactly run it in fp32."""
    import transformers.modeling_flash_attention_utils as fa

    seen: list[torch.dtype] = []

    def checked(kernel):
        @functools.wraps(kernel)  # transformers reads the kernels' signatures to decide what to pass
        def call(q, *args, **kwargs):
            seen.append(q.dtype)
            if half_only and q.dtype not in (torch.float16, torch.bfloat16):
                raise RuntimeError(
                    "FlashAttention only support fp16 and bf16 data type"
                )  # flash-attn's words
            return kernel(q, *args, **kwargs)

        return call

    def reference_imports(implementation, *_args, **_kwargs):
        return checked(flash_attn_func), checked(flash_attn_varlen_func), None, fa._pad_input, fa._unpad_input

    original = fa._lazy_imports
    fa._lazy_imports, fa._loaded_implementation = reference_imports, None
    try:
        yield seen
    finally:
        fa._lazy_imports, fa._loaded_implementation = original, None
