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
"""

from __future__ import annotations

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
    ):
        with torch.autocast(device_type=student_hidden.device.type, enabled=False):
            weight = head_weight.detach().float()
            t_weight = weight if teacher_weight is None else teacher_weight.detach().float()
            need_weight_grad = ctx.needs_input_grad[2]
            grad_hidden = torch.empty_like(student_hidden, dtype=torch.float32)
            grad_weight = torch.zeros_like(weight) if need_weight_grad else None
            total = student_hidden.new_zeros((), dtype=torch.float32)
            kl_rows = student_hidden.new_empty(student_hidden.shape[0], dtype=torch.float32)
            agree = torch.empty(student_hidden.shape[0], dtype=torch.bool, device=student_hidden.device)
            for start in range(0, student_hidden.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                s = student_hidden[rows].detach().float()
                t_logits = teacher_hidden[rows].detach().float() @ t_weight.T
                s_logits = s @ weight.T
                t_top = t_logits.argmax(-1)
                agree[rows] = s_logits.argmax(-1) == t_top
                w = row_weight[rows].float()
                if hard_weight:  # cross-entropy of the student (at T=1) on the teacher's top-1 token
                    log_ps1 = torch.log_softmax(s_logits, dim=-1)
                    total += hard_weight * (-log_ps1.gather(-1, t_top[:, None])[:, 0] * w).sum()
                    hard_grad = log_ps1.exp_()
                    del log_ps1
                    hard_grad[torch.arange(hard_grad.shape[0], device=hard_grad.device), t_top] -= 1
                    hard_grad.mul_((w * hard_weight)[:, None])
                log_pt = torch.log_softmax(t_logits.div_(temperature), dim=-1)
                log_ps = torch.log_softmax(s_logits.div_(temperature), dim=-1)
                del t_logits, s_logits
                pt = log_pt.exp()
                kl = (pt * (log_pt - log_ps)).sum(-1)
                del log_pt
                kl_rows[rows] = kl
                total += (kl * w).sum() * temperature**2
                # d(T^2 * KL)/d(student logits) = T^2 * (p_s - p_t) / T
                grad_logits = log_ps.exp_().sub_(pt).mul_((w * temperature)[:, None])
                del pt
                if hard_weight:
                    grad_logits.add_(hard_grad)
                    del hard_grad
                grad_hidden[rows] = grad_logits @ weight
                if need_weight_grad:
                    grad_weight.addmm_(grad_logits.T, s)
        ctx.save_for_backward(grad_hidden, grad_weight if need_weight_grad else None)
        ctx.dtypes = (student_hidden.dtype, head_weight.dtype)
        ctx.mark_non_differentiable(kl_rows, agree)
        return total, kl_rows, agree

    @staticmethod
    def backward(ctx, grad_total, _grad_kl_rows, _grad_agree):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        grad_hidden = (grad_hidden * grad_total).to(hidden_dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_total).to(weight_dtype)
        return grad_hidden, None, grad_weight, None, None, None, None, None


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
    top-1 token (a hard-label term that pulls directly on top-1 agreement)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return ChunkedDistillationKL.apply(
        student_hidden,
        teacher_hidden,
        head_weight,
        row_weight,
        float(temperature),
        int(chunk_size),
        teacher_weight,
        float(hard_weight),
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
    """KL, top-1 agreement and both next-token NLLs at T=1, chunked over positions like the loss."""
    weight = head_weight.float()
    n = student_hidden.shape[0]
    out = EvalStats(*(student_hidden.new_empty(n, dtype=torch.float32) for _ in range(4)))
    out.agree = torch.empty(n, dtype=torch.bool, device=student_hidden.device)
    with torch.autocast(device_type=student_hidden.device.type, enabled=False):
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            log_ps = torch.log_softmax(student_hidden[rows].float() @ weight.T, dim=-1)
            log_pt = torch.log_softmax(teacher_hidden[rows].float() @ weight.T, dim=-1)
            out.kl[rows] = (log_pt.exp() * (log_pt - log_ps)).sum(-1)
            out.agree[rows] = log_ps.argmax(-1) == log_pt.argmax(-1)
            label = labels[rows]
            valid = label >= 0
            index = label.clamp(min=0)[:, None]
            nan = torch.full_like(out.kl[rows], float("nan"))
            out.student_nll[rows] = torch.where(valid, -log_ps.gather(-1, index)[:, 0], nan)
            out.teacher_nll[rows] = torch.where(valid, -log_pt.gather(-1, index)[:, 0], nan)
    return out
