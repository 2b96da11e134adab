"""Least-squares initialisation of the SwiftKV K/V projections (before distillation).

The published initialisation copies layer ``j``'s ``k_proj`` / ``v_proj`` into ``k/v_proj_swiftkv``, although those
now read the hidden state entering layer ``l``, not the one entering layer ``j``. Here each group's projections are
instead FITTED, in closed form, to reproduce the teacher's own K/V from that single input:

    x   = norm_swiftkv(h_l)                                  # the shared input, shape (tokens, hidden)
    Y_G = mean over the group's layers j of [k_proj_j(x_j), v_proj_j(x_j)]    # the teacher's K/V (before RoPE)
    W_G = argmin ||x W - Y_G||^2 + ridge * mean(diag(x^T x)) * ||W||^2

(RoPE rotates teacher and student keys alike at each position, so fitting keys before RoPE is the same as after.)

An AcrossKV group (``g > 1``) shares one K/V among layers that read it differently, so the group fit weights each
member ``j``'s error by what that layer makes of it (``member_metric``, the default): a key error ``e`` changes
member ``j``'s attention logits by ``q_j . e``, so key dimensions are weighted by the energy of ``j``'s queries there
(averaged over RoPE's rotations, which mixes each rotated pair of dimensions evenly); a value error reaches the
residual stream through ``j``'s ``o_proj`` slices, so values are weighted by ``M_j = sum_q O_q^T O_q`` over the
query heads ``q`` reading that KV head. With the members' token weights replaced by their mean, the normal equations
``sum_j X^T D X W M_j = sum_j X^T D Y_j M_j`` solve in closed form:

    W = (X^T D X)^-1 (sum_j X^T D Y_j M_j) (sum_j M_j)^-1

which for one member (``g = 1``) is the plain fit, and with equal metrics the fit to the members' mean K/V
(``member_metric=False``). SmolLM2 at l=16, g=2: the init's held-out chat agreement 36.4% -> 40.9%
(``benchmarks/results/group-kv-init.md``).
With ``weighting="attention"`` each token's error is weighted, per layer and KV head, by the attention the
teacher's queries pay that token (``KVLeastSquares``). Only the normal equations ``x^T x`` and ``x^T Y`` are kept (in
float64), so any number of tokens fits in memory and data-parallel ranks just sum them before solving.

A far better start than the published init before any gradient step; distillation then starts from there (the
measurements: ``benchmarks/results/distill-smollm2.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

ROW_TOKENS = 256  # tokens per row of the fit (text_batches): a text shorter than this gives the fit nothing


class KVLeastSquares:
    """Normal equations of the K/V fit, accumulated from teacher forwards of ``model`` (hooks on its layers).

    Use: ``with KVLeastSquares(model) as fit: [forward(batch); fit.collect() for batch in batches]``, then
    ``fit.solve_and_apply()``. ``forward`` must run layers ``>= l`` in teacher mode (``swiftkv=False``); tokens
    outside ``fit.mask`` (set per batch, e.g. padding) are left out.

    ``weighting="attention"`` weights each token's K/V error, per KV head and layer, by ``sum_q a_qt^2``: the
    squared attention the teacher's queries pay it (averaged over the query heads sharing the KV head), the
    diagonal of how a V error at token ``t`` reaches the attention output. Tokens attended to (attention sinks,
    recent words) are then reproduced more exactly. It reads the attention probabilities, so the fit's forwards
    run eager attention, and it keeps one ``hidden x hidden`` matrix per layer group and KV head (SmolLM2-135M:
    120 MB; uniform keeps one in all).
    """

    def __init__(
        self, model: nn.Module, ridge: float = 1e-4, weighting: str = "uniform", member_metric: bool = True
    ):
        if weighting not in ("uniform", "attention"):
            raise ValueError(f"weighting must be 'uniform' or 'attention', got {weighting!r}.")
        self.model, self.ridge, self.weighting = model, ridge, weighting
        config = model.config
        self.l, self.L, self.g = (
            config.num_key_value_layers,
            config.num_hidden_layers,
            config.key_value_group_size,
        )
        if self.l >= self.L:
            raise ValueError("num_key_value_layers == num_hidden_layers: there are no SwiftKV K/V to fit.")
        self.layers = model.model.layers
        attn = self.layers[self.l].self_attn
        self.bias = attn.k_proj_swiftkv.bias is not None
        self.head_dim, self.kv_heads = attn.head_dim, config.num_key_value_heads
        self.leaders = config.kv_group_leaders
        self.heads = config.num_attention_heads
        self.member_metric = member_metric and self.g > 1  # one member: the metric cancels out
        # member -> (kv_heads, head_dim): its squared queries summed over tokens (mean over a KV head's query heads)
        self.query_energy: dict[int, torch.Tensor] = {}
        self.mask: torch.Tensor | None = None
        self.tokens = 0
        self._x: torch.Tensor | None = None
        self._outputs: dict[tuple[int, str], torch.Tensor] = {}
        # keyed by (group leader, KV head); uniform weighting fits all heads at once (head None) and shares x^T x
        self.xx: dict = {}
        self.xy: dict = {}
        self.yy: dict = {}
        self._hooks: list = []
        self._attn_implementation = None

    def statistics_bytes(self) -> int:
        """The bytes of the float64 normal equations this fit accumulates, held whole by every process: ``x^T x``
        once under uniform weighting, once per layer group and KV head under attention weighting, and ``x^T y``
        per layer ``>= l`` (attention / uniform: SmolLM2-135M at l = 15, 0.15 / 0.03 GB; Llama-3.1-8B at l = 16,
        18 / 1.2 GB; 70B at l = 40, 177 / 5.9 GB). Known before any forward (a model on the meta device will do)."""
        inputs = self.model.config.hidden_size + self.bias
        squares = 1 if self.weighting == "uniform" else len(self.leaders) * self.kv_heads
        return 8 * inputs * (squares * inputs + (self.L - self.l) * 2 * self.kv_heads * self.head_dim)

    # --- accumulation ----------------------------------------------------------------------------------------
    def __enter__(self):
        inner = self.model.model

        def layer_input(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            self._x = inner.norm_swiftkv(hidden)

        def keep(key):
            return lambda module, args, output: self._outputs.__setitem__(key, output)

        if not all(hasattr(self.layers[j].self_attn, "k_proj") for j in range(self.l, self.L)):
            raise ValueError(  # (before a hook is in place: a refused model is left as it was)
                "This model has no teacher k_proj/v_proj (a serving export): fit from the full checkpoint."
            )
        self._hooks.append(self.layers[self.l].register_forward_pre_hook(layer_input, with_kwargs=True))
        for j in range(self.l, self.L):
            attn = self.layers[j].self_attn
            self._hooks += [
                attn.k_proj.register_forward_hook(keep((j, "k"))),
                attn.v_proj.register_forward_hook(keep((j, "v"))),
            ]
            if self.member_metric:
                self._hooks.append(attn.q_proj.register_forward_hook(keep((j, "q"))))
            if self.weighting == "attention":  # (attn_output, attn_probs): eager attention returns the probs
                self._hooks.append(attn.register_forward_hook(self._keep_attention_weights(j)))
        if self.weighting == "attention":
            self._attn_implementation = self.model.config._attn_implementation
            self.model.config._attn_implementation = "eager"
        return self

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._attn_implementation is not None:
            self.model.config._attn_implementation = self._attn_implementation
            self._attn_implementation = None
        self._x, self._outputs = None, {}

    @torch.no_grad()
    def collect(self) -> None:
        """Add the tokens of the forward that just ran (called after each ``forward``)."""
        per_layer = 2 + (self.weighting == "attention") + self.member_metric
        if self._x is None or len(self._outputs) != per_layer * (self.L - self.l):
            raise RuntimeError(
                "No teacher forward of layers >= l was seen: run the model with swiftkv=False inside the `with`."
            )
        keep = self.mask.reshape(-1).bool() if self.mask is not None else None
        x = self._rows(self._x, keep)
        if self.bias:
            x = torch.cat([x, torch.ones_like(x[:, :1])], 1)
        if self.weighting == "uniform":
            _add(self.xx, None, x.T @ x)
        for leader in self.leaders:
            for j in range(leader, leader + self.g):  # the group's members: every one's K/V is a target
                k, v = (self._rows(self._outputs[(j, n)], keep) for n in ("k", "v"))
                if self.member_metric:
                    q = self._rows(self._outputs[(j, "q")], keep).view(
                        -1, self.kv_heads, self.heads // self.kv_heads, self.head_dim
                    )
                    _add(self.query_energy, j, q.pow(2).sum(0).mean(1))
                if self.weighting == "uniform":
                    y = torch.cat([k, v], 1)
                    _add(self.xy, (j, None), x.T @ y)
                    _add(self.yy, (leader, None), (y * y).sum())
                    continue
                weights = self._outputs[(j, "a")]
                for h in range(self.kv_heads):
                    cols = slice(h * self.head_dim, (h + 1) * self.head_dim)
                    y, w = torch.cat([k[:, cols], v[:, cols]], 1), weights[:, h : h + 1]
                    _add(self.xx, (leader, h), x.T @ (w * x))
                    _add(self.xy, (j, h), x.T @ (w * y))
                    _add(self.yy, (leader, h), (w * y * y).sum())
        self.tokens += x.shape[0]
        self._x, self._outputs = None, {}

    def _keep_attention_weights(self, j: int):
        """The forward hook of layer ``j``'s attention: its probabilities reduced to per-token weights at once, so
        that no layer's ``heads x T x T`` matrix outlives its layer (at 8B and 8k tokens, 16 layers' would be 69 GB)."""

        def hook(module, args, out):
            keep = self.mask.reshape(-1).bool() if self.mask is not None else None
            self._outputs[(j, "a")] = self._attention_weights(out[1], keep)

        return hook

    def _attention_weights(self, probs: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """``(tokens, kv_heads)``: sum over real queries of the squared attention each key token receives (in
        float64, one head at a time: no float64 copy of the whole matrix)."""
        if probs is None:
            raise RuntimeError("weighting='attention' needs the attention probabilities (eager attention).")
        batch, heads, queries, length = probs.shape
        real = torch.ones(batch, queries, dtype=torch.float64, device=probs.device)
        if self.mask is not None:  # padding queries do not count
            real = self.mask.to(real)
        received = torch.stack(
            [(probs[:, h].double().pow(2) * real[:, :, None]).sum(1) for h in range(heads)], 1
        )
        received = received.view(batch, self.kv_heads, heads // self.kv_heads, length).mean(2)
        received = received.permute(0, 2, 1).reshape(-1, self.kv_heads)
        return received[keep] if keep is not None else received

    @staticmethod
    def _rows(t: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        t = t.reshape(-1, t.shape[-1]).double()
        return t[keep] if keep is not None else t

    def all_reduce(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Sum the normal equations over data-parallel ranks (``reduce`` returns the summed tensor). The ranks that
        collected nothing are counted first: the others would wait for sums they never send, so every rank stops,
        saying so."""
        device = next(self.model.parameters()).device
        idle = int(reduce(torch.tensor(float(not self.xy), device=device)).item())
        if idle:
            raise RuntimeError(
                f"{idle} process(es) collected no tokens for the K/V fit: give each of them batches."
            )
        for sums in (self.xx, self.xy, self.yy, self.query_energy):
            for key in sums:
                sums[key] = reduce(sums[key])
        self.tokens = int(reduce(torch.tensor(float(self.tokens), dtype=torch.float64, device=device)))

    # --- solution --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def solve_and_apply(self) -> dict[str, float]:
        """Solve, write ``k/v_proj_swiftkv`` (also into FSDP2-sharded parameters) and return the fit quality:
        ``explained/<leader>``: the fraction of the teacher K/V's energy (sum of squares, over the group's layers;
        attention-weighted under that weighting) that the fit reproduces; ``explained_min`` / ``explained_mean``
        over the groups; ``tokens``."""
        if not self.xy:
            raise RuntimeError(
                "No tokens were collected: run at least one teacher forward inside the `with`."
            )
        report: dict[str, float] = {"tokens": float(self.tokens)}
        explained = []
        heads = [None] if self.weighting == "uniform" else list(range(self.kv_heads))
        for leader in self.leaders:
            keys, values, residual, energy = [], [], 0.0, 0.0
            for h in heads:
                # uniform: the group's g members share the inputs, so their sum of x^T x is g times one
                xx = self.xx[None] * self.g if h is None else self.xx[(leader, h)]
                members = range(leader, leader + self.g)
                xy, yy = sum(self.xy[(j, h)] for j in members), self.yy[(leader, h)]
                hidden = xx.shape[0] - int(self.bias)
                penalty = torch.zeros_like(xx)
                penalty.diagonal()[:hidden] = self.ridge * xx.diagonal()[:hidden].mean()
                if self.member_metric:
                    metrics = [self._member_metric(j, h) for j in members]
                    weighted = sum(self.xy[(j, h)] @ m for j, m in zip(members, metrics, strict=True))
                    w = self.g * torch.linalg.solve(xx + penalty, weighted) @ torch.linalg.inv(sum(metrics))
                else:
                    w = torch.linalg.solve(xx + penalty, xy)
                # residual energy from the normal equations: y.y - 2 w.xy + w.xx.w
                residual += float(yy - 2 * (w * xy).sum() + (w * (xx @ w)).sum())
                energy += float(yy)
                keys.append(w[:, : w.shape[1] // 2])
                values.append(w[:, w.shape[1] // 2 :])
            explained.append(1 - residual / energy)
            report[f"explained/{leader}"] = explained[-1]
            attn = self.layers[leader].self_attn
            for name, parts in (("k_proj_swiftkv", keys), ("v_proj_swiftkv", values)):
                solution, linear = torch.cat(parts, 1), getattr(attn, name)
                _assign(linear.weight, solution[:hidden].T)
                if self.bias:
                    _assign(linear.bias, solution[hidden])
        report.update(explained_min=min(explained), explained_mean=sum(explained) / len(explained))
        return report

    def _member_metric(self, j: int, head: int | None) -> torch.Tensor:
        """How member ``j`` weighs errors in the K/V columns of KV head ``head`` (all heads: ``None``): block-diagonal,
        keys by ``j``'s query energy per dimension (each RoPE pair averaged), values by ``sum_q O_q^T O_q``."""
        d, per_kv = self.head_dim, self.heads // self.kv_heads
        energy = self.query_energy[j] / max(self.tokens, 1)
        pairs = (energy[:, : d // 2] + energy[:, d // 2 :]) / 2  # RoPE (rotate_half) mixes c and c + d/2
        energy = pairs.repeat(1, 2)
        o_proj = self.layers[j].self_attn.o_proj.weight.detach()
        if isinstance(o_proj, DTensor):  # FSDP2: every rank needs the whole weight (one layer's, once)
            o_proj = o_proj.full_tensor()
        o_proj = o_proj.double()
        heads = range(self.kv_heads) if head is None else [head]
        key_blocks, value_blocks = [], []
        for h in heads:
            slices = [o_proj[:, q * d : (q + 1) * d] for q in range(h * per_kv, (h + 1) * per_kv)]
            key_blocks.append(torch.diag(energy[h]))
            value_blocks.append(sum(o.T @ o for o in slices))
        metric = torch.block_diag(*key_blocks, *value_blocks)
        return metric.to(self.xx[next(iter(self.xx))].device)


def _add(sums: dict, key, value: torch.Tensor) -> None:
    sums[key] = sums[key] + value if key in sums else value


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    from torch.distributed.tensor import distribute_tensor

    if isinstance(param, DTensor):  # FSDP2: every rank holds the full solution, keeps its shard
        value = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements)
    param.copy_(value.to(param.dtype))


@torch.no_grad()
def fit_kv_projections(
    model: nn.Module,
    batches: Iterable[dict],
    max_tokens: int = 32768,
    ridge: float = 1e-4,
    weighting: str = "uniform",
    member_metric: bool = True,
    all_processes: bool = False,
) -> dict[str, float]:
    """Fit ``k/v_proj_swiftkv`` of a SwiftKV model (e.g. fresh from ``convert``) to its teacher's K/V, in place.

    ``batches``: dicts with ``input_ids`` and optionally ``attention_mask`` (padding is left out) and
    ``position_ids``, on the model's device. Stops after ``max_tokens`` tokens. Returns the fit report (see
    ``KVLeastSquares.solve_and_apply``). ``weighting``: ``"uniform"`` or ``"attention"`` (see ``KVLeastSquares``);
    ``member_metric``: an AcrossKV group's members weigh their errors by their queries and ``o_proj`` (the module
    docstring); ``False``: the fit to the members' mean K/V.
    ``all_processes``: every process of ``torch.distributed``'s default group calls this with its own batches (at
    least one each, ``max_tokens`` each), and all get the one fit to all of them (the normal equations summed). A
    process with none stops them all, saying so, where each holds the whole model; a sharded one (FSDP2, whose
    forwards gather across the processes) needs the same number of batches on each.
    The model's ``swiftkv`` switch is restored afterwards.
    """
    if all_processes and not torch.distributed.is_initialized():
        raise RuntimeError(
            "all_processes=True: no torch.distributed process group is set up in this process."
        )
    was_training = model.training
    model.eval()
    try:
        with model.swiftkv_mode(False), KVLeastSquares(model, ridge, weighting, member_metric) as fit:
            for batch in batches:
                fit.mask = batch.get("attention_mask")
                model(
                    **{
                        k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")
                    },
                    logits_to_keep=1,
                    use_cache=False,
                )
                fit.collect()
                if fit.tokens >= max_tokens:
                    break
            if all_processes:
                fit.all_reduce(_summed_over_processes)
            return fit.solve_and_apply()
    finally:
        model.train(was_training)


def _summed_over_processes(tensor: torch.Tensor) -> torch.Tensor:
    torch.distributed.all_reduce(tensor)
    return tensor


def text_batches(
    tokenizer,
    texts: Iterable[str],
    length: int = ROW_TOKENS,
    batch_size: int = 4,
    device: torch.device | str = "cpu",
) -> Iterable[dict]:
    """Batches of ``batch_size`` x ``length`` token rows cut from ``texts`` (each text tokenised on its own, its
    rows never mixing texts; a text's last partial row is dropped), on ``device``, for ``fit_kv_projections``.
    ``ValueError`` where the texts make no row at all (every one shorter than ``length`` tokens)."""
    rows, longest, made = [], 0, False
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        longest = max(longest, len(ids))
        rows.extend(ids[i : i + length] for i in range(0, len(ids) - length + 1, length))
        while len(rows) >= batch_size:
            yield {"input_ids": torch.tensor(rows[:batch_size], device=device)}
            rows, made = rows[batch_size:], True
    if rows:
        yield {"input_ids": torch.tensor(rows, device=device)}
    elif not made:
        raise ValueError(
            f"the K/V fit's text makes no row of {length} tokens (the longest text has {longest}): give more "
            f"text, at least {length} tokens in one file."
        )
