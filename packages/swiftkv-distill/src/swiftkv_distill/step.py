"""One distillation step: teacher and student passes sharing the prefix, and the loss.

    h_l, ctx = prefix(tokens)                   # embeddings + layers < l, no grad, ONCE (same in both passes)
    teacher  = suffix(h_l, swiftkv=False)        # original layers >= l, no grad
    student  = suffix(h_l, swiftkv=True)         # SwiftKV layers >= l, the only pass with a graph
    loss = T^2 KL(teacher || student)            # chunked over positions (loss.py), distilled ones only
         + hidden_loss_weight * MSE(hidden entering the last layer)
         + early_exit_weight * T^2 KL(teacher || early_exit_head(h_l))   (optional)

The published trainer runs the whole teacher and the whole student, so layers < l run twice; here they run once
and without autograd (nothing before layer l is trainable, so nothing there needs a graph). The one exception is
``lora_prefix`` (student-only adapters below l): the student then runs its own prefix, with a graph.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, fields

import torch
from torch import nn
from torchmetrics import MeanMetric, SumMetric

from swiftkv_core.early_exit import EarlyExitHead
from swiftkv_core.modeling import runs_flash_attn
from swiftkv_core.weights import is_swiftkv_parameter

from .loss import EvalStats, distillation_kl, eval_stats


def is_trained_name(name: str) -> bool:
    """Whether a state-dict entry is one distillation trains: a SwiftKV parameter or the early-exit head's."""
    return is_swiftkv_parameter(name) or ".early_exit_head." in f".{name}"


def distilled_index(batch: dict, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The distilled positions of ``batch`` (of its ``positions`` only, where given), as indices into its rows x
    positions flattened: the collate's ``loss_index``, found on the host, where every position is kept; else found
    from ``loss_mask`` on the device, whose count the host then waits for (a GPU's queue drained). Code that slices,
    joins or re-pads a batch's rows must drop it (``batches.row_wise``: it indexes the whole batch)."""
    if positions is None and "loss_index" in batch:
        return batch["loss_index"]
    mask = batch["loss_mask"] if positions is None else batch["loss_mask"][:, positions]
    return mask.flatten().nonzero().flatten()


def select(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The ``index`` (``distilled_index``) entries of ``values`` (rows x positions x ...). A gather by a known
    index: unlike a boolean mask, it leaves the device's queue running, its backward too."""
    return values.flatten(0, 1).index_select(0, index)


def sampled_positions(length: int, fraction: float, step: int, device) -> torch.Tensor | None:
    """The positions distilled at optimizer step ``step``: all (None), or a random ``fraction`` of the ``length``
    drawn from the step number (the same on every process, and after a resume)."""
    if fraction >= 1:
        return None
    generator = torch.Generator().manual_seed(step)
    count = max(1, round(length * fraction))
    return torch.randperm(length, generator=generator)[:count].sort().values.to(device)


class AccumulationWindow:
    """The weight of each distilled position, such that an optimizer step's gradient is the mean over every position
    its batches distil on all processes: what one process taking them all at once computes.

    One batch per step: 1 / the batch's positions on all processes, times the processes (data-parallel training
    averages the gradients over them). Gradients accumulated over a window of batches: the window's positions are
    counted only at its end, so each weighs the same until then (times the window, which Lightning divides the loss
    by) and ``normalise`` divides the gradients by their count before anything reads them. Each batch's own mean
    would weigh the positions of a batch with fewer of them (shorter answers) more."""

    def __init__(self):
        self.positions: torch.Tensor | None = None  # the window's so far, on all processes
        self.loss: torch.Tensor | float = 0.0  # the window's summed loss so far, on this process
        self.metrics: dict[str, torch.Tensor] = {}  # the window's summed step metrics so far, on this process

    def row_scale(self, positions: torch.Tensor, processes: int, window: int) -> torch.Tensor | float:
        """The weight of each of a batch's ``positions`` (their count on all processes)."""
        if window == 1:
            # float32 as the loss is: under bf16-true Lightning makes bf16 the default dtype of a division's result
            return processes / positions.clamp(min=1).float()
        self.positions = positions if self.positions is None else self.positions + positions
        return float(processes * window)

    def mean_loss(self, loss: torch.Tensor, row_scale, positions: torch.Tensor) -> torch.Tensor:
        """This process's share of the mean of ``loss`` (a batch's, weighted by ``row_scale``) over every process:
        the batch's, or, accumulating, the window's so far (the step's at its last batch)."""
        if self.positions is None:
            return loss / (row_scale * positions.clamp(min=1))
        self.loss = self.loss + loss / row_scale
        return self.loss / self.positions.clamp(min=1)

    def mean_metric(self, name: str, value: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """This process's share of a step metric's mean (``value``: its sum over a batch's distilled positions) over
        every process's positions: the batch's, or, accumulating, the window's so far (the step's at its last
        batch, where Lightning logs it). No position anywhere gives 0, not NaN."""
        if self.positions is None:
            return value / positions.clamp(min=1)
        self.metrics[name] = self.metrics.get(name, 0.0) + value
        return self.metrics[name] / self.positions.clamp(min=1)

    def shares(self, out: dict, row_scale, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """This process's share of each of a step's means (``mean_loss``, ``mean_metric``): the loss, and the metrics
        the step's ``out`` has."""
        shares = {"loss": self.mean_loss(out["loss"].detach(), row_scale, positions)}
        for name in ("kl", "agreement", "hidden_mse", "early_exit_kl", "early_exit_agreement"):
            if name in out:
                shares[name] = self.mean_metric(name, out[name], positions)
        return shares

    def normalise(self, parameters) -> None:
        """At a window's end: the summed gradients made the window's mean."""
        if self.positions is None:
            return
        count = self.positions.clamp(min=1).float()  # on the device: the host does not wait for it
        for grad in (param.grad for param in parameters if param.grad is not None):
            if grad.dtype in (torch.float16, torch.bfloat16):
                # on a GPU a half gradient would take the divisor in its own dtype (fp16: inf above 65504)
                grad.copy_(grad.float().div_(count))
            else:
                grad.div_(count)
        self.positions, self.loss, self.metrics = None, 0.0, {}


class TokenCount:
    """The real tokens trained on by every process. Each batch's count stays on the device (summed over the processes
    with the step's metrics) until ``seen`` or ``last`` is read, after the step's work: the host never waits for it
    mid-step."""

    def __init__(self, seen: int = 0):
        self._seen, self._uncounted = seen, 0
        self.last: torch.Tensor | int = 0  # the last batch's

    def add(self, tokens: torch.Tensor) -> None:
        self.last, self._uncounted = tokens, self._uncounted + tokens

    @property
    def seen(self) -> int:
        self._seen, self._uncounted = self._seen + int(self._uncounted), 0
        return self._seen


@dataclass(frozen=True)
class LossSettings:
    """What the distillation loss weighs and how it is computed (the module builds it once from its arguments)."""

    temperature: float = 2.0
    """Softening temperature T of the KL (the KL terms are scaled by T^2)."""
    hidden_loss_weight: float = 0.0
    """Weight of the MSE between teacher and student hidden states entering the last layer (0: off)."""
    early_exit_weight: float = 1.0
    """Weight of the early-exit head's KL (used only when the step has an early-exit head)."""
    hard_label_weight: float = 0.0
    """Weight of the student's cross-entropy on the teacher's top-1 token (0: pure KL)."""
    chunk_size: int = 512
    """Positions per chunk of full-vocabulary logits (memory vs speed)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a number > 0, got {self.temperature}.")
        for name in ("hidden_loss_weight", "early_exit_weight", "hard_label_weight"):
            weight = getattr(self, name)
            if not (math.isfinite(weight) and weight >= 0):  # a negative weight would maximise its term
                raise ValueError(f"{name} must be a number >= 0 (0: off), got {weight}.")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}.")


def lowest_dtype(model) -> torch.dtype:
    """The lowest-precision dtype of ``model``'s parameters: the frozen ones' where they are held lower
    (``frozen_dtype``), else the weights' one dtype."""
    return min({p.dtype for p in model.parameters()}, key=lambda dtype: torch.finfo(dtype).bits)


@contextlib.contextmanager
def attention_that_computes_here(model):
    """flash-attn computes in fp16 and bf16 only: handed fp32 it raises ("FlashAttention only support fp16 and bf16
    data type"), and transformers hands it fp32 where neither autocast nor the weights say otherwise. A pass of a
    model set to flash attention that computes in fp32 (evaluation in the fp32 weights' own dtype, the K/V fit's
    teacher pass outside autocast: the GPU recipes' fp32 weights) attends with sdpa meanwhile: the same attention,
    exact in fp32, packed sequences kept apart by sdpa's dense mask. Under the recipes' bf16 autocast (the training
    steps) flash stays."""
    config = model.config
    implementation = config._attn_implementation or ""
    device = next(model.parameters()).device.type
    # as transformers' flash path reads it: autocast's dtype, else the weights'
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else lowest_dtype(model)
    swap = "flash" in implementation and dtype not in (torch.float16, torch.bfloat16)
    if swap:
        config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        if swap:
            config._attn_implementation = implementation


@dataclass
class Evaluation:
    """The validation statistics of one batch (temperature 1, no gradient)."""

    stats: EvalStats
    """Per-position KL, top-1 agreement and next-token NLLs of student and teacher."""
    early_exit_agreement: torch.Tensor | None
    """Per-position top-1 agreement of the early-exit head with the teacher (None without a head)."""

    def select(self, keep: torch.Tensor) -> Evaluation:
        """The statistics of the positions where ``keep`` is True."""
        early = self.early_exit_agreement
        stats = EvalStats(*(getattr(self.stats, field.name)[keep] for field in fields(EvalStats)))
        return Evaluation(stats, None if early is None else early[keep])


class DistillationStep(nn.Module):
    """Teacher + student forward and the loss, as ONE module call (the FSDP2 root: its call gathers the
    embeddings, norms and LM head; each decoder layer is its own FSDP2 unit, parallelize.py).

    ``forward`` is the training step; ``evaluate`` and ``teacher_pass`` are the other two uses (under FSDP2 they
    are registered as forward methods, so they gather the root's weights too)."""

    def __init__(
        self,
        model: nn.Module,
        settings: LossSettings | None = None,
        early_exit_head: EarlyExitHead | None = None,
    ):
        super().__init__()
        self.model = model
        self.settings = settings or LossSettings()
        self.early_exit_head = early_exit_head

    def _prefix(self, batch: dict, positions: torch.Tensor | None):
        varlen = {}
        if "cu_seq_lens" in batch and runs_flash_attn(self.model.config._attn_implementation):
            # the collate's, found on the host: the model would read the positions on the device to find them
            starts, longest = batch["cu_seq_lens"], batch["max_seq_len"]
            varlen = dict(
                cu_seq_lens_q=starts, cu_seq_lens_k=starts, max_length_q=longest, max_length_k=longest
            )
        return self.model.model.forward_prefix(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            attention_mask=None,
            use_cache=False,
            keep_positions=positions,
            **varlen,
        )

    def _prefix_and_teacher(self, batch: dict, positions: torch.Tensor | None):
        """Embeddings + layers < l (for every position) and the teacher's layers >= l, without autograd. The
        prefix is the student's too, unless the student has adapters of its own there (``lora_prefix``)."""
        own_prefix = self.model.config.lora_prefix
        with torch.no_grad(), self.model.swiftkv_mode(False) if own_prefix else contextlib.nullcontext():
            hidden, context = self._prefix(batch, positions)
            teacher, teacher_last_input = self.model.model.forward_suffix(
                hidden, context, swiftkv=False, return_last_layer_input=True
            )
        return hidden, context, teacher, teacher_last_input

    def _student(self, batch, hidden, context, index, positions):
        """The student's layers >= l (the graph; with ``lora_prefix`` its own layers < l first), its final hidden
        states and the early-exit head's input."""
        inner = self.model.model
        if self.model.config.lora_prefix:
            hidden, context = self._prefix(batch, positions)
        student, student_last_input = inner.forward_suffix(
            hidden, context, swiftkv=True, return_last_layer_input=True
        )
        student = select(inner.norm(student), index)
        kept = hidden if positions is None else hidden[:, positions]
        early = self.early_exit_head.norm(select(kept, index)) if self.early_exit_head is not None else None
        return student, student_last_input, early

    def forward(
        self, batch: dict, row_scale: float | torch.Tensor, positions: torch.Tensor | None = None
    ) -> dict:
        """The training loss (``loss``, with a graph) and its parts (detached) for ``batch``.

        ``row_scale``: the weight of each distilled position (``AccumulationWindow.row_scale``).
        ``positions``: distil only these sequence positions (sorted indices; None: all). Every position still gets
        its K/V; the student's layers >= l and both LM heads run for these positions only."""
        settings, head_weight = self.settings, self.model.lm_head.weight
        index = distilled_index(batch, positions)
        hidden, context, teacher, teacher_last_input = self._prefix_and_teacher(batch, positions)
        with torch.no_grad():
            teacher = select(self.model.model.norm(teacher), index)
        student, student_last_input, early = self._student(batch, hidden, context, index, positions)
        rows = torch.full((student.shape[0],), 1.0, dtype=torch.float32, device=student.device) * row_scale
        kl_sum, kl_rows, agree = distillation_kl(
            student,
            teacher,
            head_weight,
            rows,
            settings.temperature,
            settings.chunk_size,
            hard_weight=settings.hard_label_weight,
        )
        mse_rows = select(student_last_input - teacher_last_input, index).float().pow(2).mean(-1)
        loss = kl_sum
        if settings.hidden_loss_weight:
            loss = loss + settings.hidden_loss_weight * (mse_rows * rows).sum()
        out = {  # sums over the distilled positions: a caller divides by their count over every process
            "tokens": torch.full((), index.numel(), device=index.device),
            "kl": kl_rows.detach().sum(),
            "agreement": agree.float().sum(),
            "hidden_mse": mse_rows.detach().sum(),
        }
        if early is not None:
            early_sum, early_kl, early_agree = distillation_kl(
                early,
                teacher,
                self.early_exit_head.lm_head.weight,
                rows,
                settings.temperature,
                settings.chunk_size,
                teacher_weight=head_weight,
            )
            loss = loss + settings.early_exit_weight * early_sum
            out.update(early_exit_kl=early_kl.sum(), early_exit_agreement=early_agree.float().sum())
        out["loss"] = loss
        return out

    @torch.no_grad()
    def evaluate(self, batch: dict) -> Evaluation:
        """Validation statistics of ``batch`` at temperature 1 (every position, no gradient), computed in the
        weights' own dtype even when training runs under autocast (``bf16-mixed``): the held-out figures measure
        the model that is exported, and compare across training precisions. Frozen weights held in a lower
        precision than the trained ones (``frozen_dtype``) compute in theirs."""
        low, device = lowest_dtype(self.model), batch["input_ids"].device.type
        mixed = any(p.dtype != low for p in self.model.parameters())
        with (
            torch.autocast(device, dtype=low, enabled=mixed),
            attention_that_computes_here(self.model),
        ):
            return self._evaluate(batch)

    def _evaluate(self, batch: dict) -> Evaluation:
        index, chunk_size = distilled_index(batch), self.settings.chunk_size
        head_weight = self.model.lm_head.weight
        hidden, context, teacher, _ = self._prefix_and_teacher(batch, None)
        teacher = select(self.model.model.norm(teacher), index)
        student, _, early = self._student(batch, hidden, context, index, None)
        stats = eval_stats(student, teacher, head_weight, select(batch["labels"], index), chunk_size)
        early_agree = None
        if early is not None:
            early_agree = _top1_agreement(
                early, self.early_exit_head.lm_head.weight, teacher, head_weight, chunk_size
            )
        evaluation = Evaluation(stats, early_agree)
        if "counted" in batch:  # rows repeated to even out the processes (EvenSampler): run, not scored
            rows = index // batch["loss_mask"].shape[1]
            evaluation = evaluation.select(batch["counted"][rows])
        return evaluation

    @torch.no_grad()
    def teacher_pass(self, batch: dict) -> None:
        """The prefix and the teacher's layers only: what the K/V least-squares fit (kv_init.py) observes through
        its hooks on the layers (outside autocast: in the weights' dtype)."""
        with attention_that_computes_here(self.model):
            self._prefix_and_teacher(batch, None)


@torch.no_grad()
def _top1_agreement(hidden_a, weight_a, hidden_b, weight_b, chunk_size: int) -> torch.Tensor:
    agree = torch.empty(hidden_a.shape[0], dtype=torch.bool, device=hidden_a.device)
    for start in range(0, hidden_a.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        agree[rows] = (hidden_a[rows] @ weight_a.T).argmax(-1) == (hidden_b[rows] @ weight_b.T).argmax(-1)
    return agree


class ValidationMetrics(nn.Module):
    """Means of the validation statistics over batches (torchmetrics: summed over processes when computed)."""

    NAMES = ("kl", "agreement", "student_nll", "teacher_nll", "early_exit_agreement")

    def __init__(self):
        super().__init__()
        self.means = nn.ModuleDict({name: MeanMetric() for name in self.NAMES})
        self.tokens = SumMetric()  # the positions scored

    def _apply(self, fn, recurse: bool = True):
        """Moved as any module, but the sums stay float32: ``bf16-true`` converts the whole LightningModule to bf16,
        and a bf16 running sum of thousands of values drifts by percents."""
        super()._apply(fn, recurse)
        for metric in (*self.means.values(), self.tokens):
            metric.set_dtype(torch.float32)
        return self

    def update(self, evaluation: Evaluation) -> None:
        stats, m = evaluation.stats, self.means
        m["kl"].update(stats.kl)
        m["agreement"].update(stats.agree.float())
        self.tokens.update(float(stats.agree.numel()))
        # updated even when empty (a batch of repeated rows): each process must compute what the others do
        valid = ~torch.isnan(stats.student_nll)
        m["student_nll"].update(stats.student_nll[valid])
        m["teacher_nll"].update(stats.teacher_nll[valid])
        if evaluation.early_exit_agreement is not None:
            m["early_exit_agreement"].update(evaluation.early_exit_agreement.float())

    def compute(self, early_exit: bool = False) -> dict[str, float]:
        """``kl``, ``agreement``, ``tokens`` (positions scored), ``student_ppl`` / ``teacher_ppl`` (where there were
        labels) and ``early_exit_agreement`` (with ``early_exit``); then starts over."""
        m = self.means
        values = {
            "kl": m["kl"].compute(),
            "agreement": m["agreement"].compute(),
            "tokens": self.tokens.compute(),
        }
        if m["student_nll"].update_count:
            # computed on every process (summed over them); NaN where no position had a next token
            student, teacher = m["student_nll"].compute(), m["teacher_nll"].compute()
            if not torch.isnan(student):
                values["student_ppl"], values["teacher_ppl"] = student.exp(), teacher.exp()
        if m["early_exit_agreement"].update_count or early_exit:
            values["early_exit_agreement"] = m["early_exit_agreement"].compute()
        self.reset()
        return {k: float(v) for k, v in values.items()}

    def reset(self) -> None:
        for metric in self.means.values():
            metric.reset()
        self.tokens.reset()
