"""Distillation loss over the vocabulary, computed in chunks of positions.

Full-vocabulary logits are the largest tensors of a distillation step (positions x vocab: 2048 x 128k fp32 is
1 GiB, twice, plus the softmaxes). ``ChunkedDistillationKL`` never holds more than one chunk of them: it
projects ``chunk_size`` positions at a time, and because the LM head is frozen (or, for the early-exit head, a
plain linear) it computes the gradient with respect to its inputs in the same pass, so nothing is kept for the
backward pass but that gradient (positions x hidden).

KL(teacher || student) at temperature T, per position:

    sum_v p_t(v) (log p_t(v) - log p_s(v)),   p = softmax(logits / T),

scaled by T^2 (the gradient of the softened KL shrinks as 1/T^2; Hinton et al.), and its gradient with respect
to the student logits is T * (p_s - p_t) * weight.

Under autocast (``trainer.precision: bf16-mixed``) the three LM-head products (teacher logits, student logits,
the gradient back to the hidden states) run in the autocast dtype, and with a bf16 or fp16 head and no autocast
(``bf16-true``) in the head's dtype, as the model's own logits; the softmaxes and the KL in fp32: on a CPU
with bf16 instructions those products run several times faster than in fp32, and they are most of a small
model's step. The bf16 rounding of a logit (0.4% at most) changes the KL by far less than the distillation's own error.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor


class ChunkedDistillationKL(torch.autograd.Function):
    """``sum_i weight_i * T^2 * KL_i`` over rows of ``student_hidden @ head_weight.T`` (student logits) vs
    ``teacher_hidden @ teacher_weight.T`` (teacher logits, a constant; ``teacher_weight`` defaults to ``head_weight``).

    ``student_hidden`` (N, H) and ``teacher_hidden`` (N, H) are the final-normed hidden states of the masked
    positions; ``head_weight`` (V, H) the LM head (a gradient is computed for it only if it requires grad: the
    early-exit head). Also returns, without gradient, the per-row KL at T (nats) and whether the student's top-1
    token equals the teacher's.
    """

    @staticmethod
    def forward(
        ctx,
        student_hidden: Tensor,
        teacher_hidden: Tensor,
        head_weight: Tensor,
        row_weight: Tensor,
        temperature: float,
        chunk_size: int,
        teacher_weight: Tensor | None,
        hard_weight: float = 0.0,
        matmul_dtype: torch.dtype = torch.float32,
    ):
        with torch.autocast(device_type=student_hidden.device.type, enabled=False):
            # the heads in the matmul dtype: the weights themselves where they already are (a copy of an 8B
            # model's head is 1 GiB in bf16), one copy shared by teacher and student where they are one head
            weight_mm = head_weight.detach().to(matmul_dtype)
            t_weight_mm = weight_mm if teacher_weight is None else teacher_weight.detach().to(matmul_dtype)
            need_weight_grad = ctx.needs_input_grad[2]
            grad_hidden = torch.empty_like(student_hidden, dtype=torch.float32)
            grad_weight = torch.zeros_like(head_weight, dtype=torch.float32) if need_weight_grad else None
            total = student_hidden.new_zeros((), dtype=torch.float32)
            kl_rows = student_hidden.new_empty(student_hidden.shape[0], dtype=torch.float32)
            agree = torch.empty(student_hidden.shape[0], dtype=torch.bool, device=student_hidden.device)
            for start in range(0, student_hidden.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                s = student_hidden[rows].detach().float()
                t_logits = teacher_hidden[rows].detach().to(matmul_dtype) @ t_weight_mm.T
                s_logits = s.to(matmul_dtype) @ weight_mm.T
                w = row_weight[rows].float()
                kl, grad_logits, agree[rows] = _kl_chunk(t_logits, s_logits, w, temperature)
                kl_rows[rows] = kl
                total += (kl * w).sum() * temperature**2
                if hard_weight:  # cross-entropy of the student (at T=1) on the teacher's top-1 token
                    t_top = t_logits.argmax(-1)
                    log_ps1 = torch.log_softmax(s_logits.float(), dim=-1)
                    total += hard_weight * (-log_ps1.gather(-1, t_top[:, None])[:, 0] * w).sum()
                    hard_grad = log_ps1.exp_()
                    del log_ps1
                    hard_grad[torch.arange(hard_grad.shape[0], device=hard_grad.device), t_top] -= 1
                    grad_logits = hard_grad.mul_((w * hard_weight)[:, None]).add_(grad_logits)
                    del hard_grad
                del t_logits, s_logits
                grad_hidden[rows] = grad_logits.to(matmul_dtype) @ weight_mm
                if need_weight_grad:
                    grad_weight.addmm_(grad_logits.float().T, s)
        ctx.save_for_backward(grad_hidden, grad_weight if need_weight_grad else None)
        ctx.dtypes = (student_hidden.dtype, head_weight.dtype)
        ctx.mark_non_differentiable(kl_rows, agree)
        return total, kl_rows, agree

    @staticmethod
    def backward(ctx, grad_total, _grad_kl_rows, _grad_agree):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        # in place: each saved gradient is used once (an early-exit head's at 70B is 4.2 GB in fp32)
        grad_hidden = grad_hidden.mul_(grad_total).to(hidden_dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_total).to(weight_dtype)
        return grad_hidden, None, grad_weight, None, None, None, None, None, None


def _kl_chunk_eager(t_logits: Tensor, s_logits: Tensor, row_weight: Tensor, temperature: float):
    """One chunk's per-row KL(teacher || student) at ``temperature``, its gradient with respect to the student
    logits (``T * (p_s - p_t) * weight``, in the logits' dtype) and the top-1 agreement; fp32 inside, in place
    where it can (at most four fp32 chunks alive: 1 GiB each for 2048 positions of a 128k vocabulary)."""
    agree = s_logits.argmax(-1) == t_logits.argmax(-1)
    log_pt = torch.log_softmax(t_logits.to(torch.float32, copy=True).div_(temperature), dim=-1)
    log_ps = torch.log_softmax(s_logits.to(torch.float32, copy=True).div_(temperature), dim=-1)
    pt = log_pt.exp()
    kl = log_pt.sub_(log_ps).mul_(pt).sum(-1)
    del log_pt
    grad = log_ps.exp_().sub_(pt).mul_((row_weight * temperature)[:, None]).to(s_logits.dtype)
    return kl, grad, agree


_compiled_kl_chunk = None  # built at the first call (importing the compiler costs seconds)


def _kl_chunk(t_logits: Tensor, s_logits: Tensor, row_weight: Tensor, temperature: float):
    """``_kl_chunk_eager`` through torch.compile, which fuses its dozen passes over positions x vocabulary into a
    few; the eager function where compiling fails (no C++ compiler, an
    unsupported platform), with one warning: the same numbers either way."""
    global _compiled_kl_chunk
    if _compiled_kl_chunk is None:
        _compiled_kl_chunk = torch.compile(_kl_chunk_eager, dynamic=True)
    if _compiled_kl_chunk is not _kl_chunk_eager:
        try:
            return _compiled_kl_chunk(t_logits, s_logits, row_weight, temperature)
        except (torch.OutOfMemoryError, torch.AcceleratorError):
            raise  # the device's own failure, not the compiler's: the eager function would meet it too
        except Exception as error:  # noqa: BLE001 - any compiler failure: the eager function is exact
            _compiled_kl_chunk = _kl_chunk_eager
            warnings.warn(
                f"the distillation KL runs uncompiled: torch.compile failed ({error!s:.300})", stacklevel=2
            )
    return _kl_chunk_eager(t_logits, s_logits, row_weight, temperature)


def distillation_kl(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    head_weight: Tensor,
    row_weight: Tensor,
    temperature: float = 2.0,
    chunk_size: int = 512,
    teacher_weight: Tensor | None = None,
    hard_weight: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(weighted T^2-scaled KL sum, per-row KL at T, per-row top-1 agreement)``; see ``ChunkedDistillationKL``.

    ``hard_weight`` > 0 adds ``hard_weight * weight_i * CE_i``: the student's cross-entropy at T=1 on the teacher's
    top-1 token (a hard-label term that pulls directly on top-1 agreement). Under autocast the LM-head products
    run in the autocast dtype, without it in a bf16 or fp16 head's own dtype (see the module's docstring)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    device = student_hidden.device.type
    if torch.is_autocast_enabled(device):
        matmul_dtype = torch.get_autocast_dtype(device)
    elif head_weight.dtype in (torch.float16, torch.bfloat16):
        matmul_dtype = head_weight.dtype  # bf16-true: the head's own dtype, no fp32 copy of it
    else:
        matmul_dtype = torch.float32
    return ChunkedDistillationKL.apply(
        student_hidden,
        teacher_hidden,
        head_weight,
        row_weight,
        float(temperature),
        int(chunk_size),
        teacher_weight,
        float(hard_weight),
        matmul_dtype,
    )


@dataclass
class EvalStats:
    """Per-position statistics at temperature 1 (no gradient)."""

    kl: Tensor  # KL(teacher || student), nats
    agree: Tensor  # student top-1 == teacher top-1
    student_nll: Tensor  # -log p_student(next token); NaN where there is no next token
    teacher_nll: Tensor


@torch.no_grad()
def eval_stats(
    student_hidden: Tensor, teacher_hidden: Tensor, head_weight: Tensor, labels: Tensor, chunk_size: int = 512
) -> EvalStats:
    """KL, top-1 agreement and both next-token NLLs at T=1, chunked over positions like the loss, in fp32."""
    n = student_hidden.shape[0]
    out = EvalStats(*(student_hidden.new_empty(n, dtype=torch.float32) for _ in range(4)))
    out.agree = torch.empty(n, dtype=torch.bool, device=student_hidden.device)
    with torch.autocast(device_type=student_hidden.device.type, enabled=False):
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            # three chunks of fp32 logits alive at most: the two logits and a log-softmax, then in place
            s_logits, t_logits = fp32_logits(
                (student_hidden[rows], teacher_hidden[rows]), head_weight, chunk_size
            )
            log_ps = torch.log_softmax(s_logits, dim=-1)
            del s_logits
            log_pt = torch.log_softmax(t_logits, dim=-1)
            del t_logits
            out.agree[rows] = log_ps.argmax(-1) == log_pt.argmax(-1)
            label = labels[rows]
            valid = label >= 0
            index = label.clamp(min=0)[:, None]
            nan = torch.full((len(index),), float("nan"), device=index.device)
            out.student_nll[rows] = torch.where(valid, -log_ps.gather(-1, index)[:, 0], nan)
            out.teacher_nll[rows] = torch.where(valid, -log_pt.gather(-1, index)[:, 0], nan)
            out.kl[rows] = log_pt.exp().mul_(log_pt.sub_(log_ps)).sum(-1)
    return out


def fp32_logits(hiddens: tuple[Tensor, ...], head_weight: Tensor, chunk_size: int) -> list[Tensor]:
    """``hidden @ head_weight.T`` in fp32 for each of ``hiddens`` (at most ``chunk_size`` positions each). A head held
    in a lower precision is widened a block of vocabulary rows at a time, each block no larger than one chunk's fp32
    logits: a whole fp32 copy of it (2.1 GB at 8B, 4.2 GB at 70B) would be held on top of them."""
    hiddens = [hidden.float() for hidden in hiddens]
    vocab, width = head_weight.shape
    block = vocab if head_weight.dtype == torch.float32 else max(1, chunk_size * vocab // width)
    if block >= vocab:
        weight = head_weight.float()
        return [hidden @ weight.T for hidden in hiddens]
    logits = [hidden.new_empty(hidden.shape[0], vocab) for hidden in hiddens]
    for start in range(0, vocab, block):
        weight = head_weight[start : start + block].float()
        for hidden, out in zip(hiddens, logits, strict=True):
            out[:, start : start + block] = hidden @ weight.T
        del weight  # before the next block is widened
    return logits
