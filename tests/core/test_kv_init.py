"""The least-squares K/V initialisation (swiftkv_core.kv_init) against direct computations."""

from datetime import timedelta

import pytest
import torch
from torch.testing import assert_close

from swiftkv_core.convert import convert
from swiftkv_core.kv_init import KVLeastSquares, fit_kv_projections
from tests.conftest import tiny_base


def _batches(n_batches=4, rows=4, length=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 128, (rows, length), generator=g)} for _ in range(n_batches)]


@torch.no_grad()
def _teacher_targets(model, batches):
    """(x = norm_swiftkv(h_l), {j: [k_proj_j(x_j), v_proj_j(x_j)]}) from the teacher's hidden states, no hooks."""
    config, inner = model.config, model.model
    l = config.num_key_value_layers
    xs, ys = [], {j: [] for j in range(l, config.num_hidden_layers)}
    model.swiftkv(False)
    for batch in batches:
        states = model(**batch, output_hidden_states=True).hidden_states  # states[j] enters layer j
        xs.append(inner.norm_swiftkv(states[l]).flatten(0, 1))
        for j in ys:
            attn, x_j = inner.layers[j].self_attn, inner.layers[j].input_layernorm(states[j])
            ys[j].append(torch.cat([attn.k_proj(x_j), attn.v_proj(x_j)], -1).flatten(0, 1))
    model.swiftkv(True)
    return torch.cat(xs), {j: torch.cat(y) for j, y in ys.items()}


def _student_kv(model, x, leader):
    attn = model.model.layers[leader].self_attn
    return torch.cat([attn.k_proj_swiftkv(x), attn.v_proj_swiftkv(x)], -1)


@torch.no_grad()
@pytest.mark.parametrize("weighting", ["uniform", "attention"])
def test_layer_l_recovers_its_own_projections(family, weighting):
    """Layer l's teacher K/V are an exact linear function of norm_swiftkv(h_l): the fit must find k/v_proj
    (under any positive token weighting)."""
    model = convert(tiny_base(family), 2, 1)
    implementation = model.config._attn_implementation
    attn = model.model.layers[2].self_attn
    for name in ("k_proj_swiftkv", "v_proj_swiftkv"):  # start far from the answer
        getattr(attn, name).weight.zero_()
    report = fit_kv_projections(model, _batches(), ridge=0.0, weighting=weighting)
    assert model.config.swiftkv and model.config._attn_implementation == implementation  # both restored
    assert report["tokens"] == 4 * 4 * 48
    assert report["explained/2"] == pytest.approx(1.0, abs=1e-6)
    for name in ("k_proj", "v_proj"):
        assert_close(
            getattr(attn, f"{name}_swiftkv").weight, getattr(attn, name).weight, atol=1e-4, rtol=1e-4
        )
        if family == "qwen2":
            assert_close(
                getattr(attn, f"{name}_swiftkv").bias, getattr(attn, name).bias, atol=1e-4, rtol=1e-4
            )
    assert report["explained/3"] < 1.0  # a later layer is not a linear function of h_l


@torch.no_grad()
def _member_metric(model, batches, j):
    """What member ``j`` makes of a K/V error, computed directly: keys by the energy of its queries per dimension
    (each RoPE pair, c and c + d/2, averaged), values by ``sum_q O_q^T O_q`` over its KV head's query heads."""
    heads, kv_heads, d = 4, 2, 16
    attn = model.model.layers[j].self_attn
    model.swiftkv(False)
    queries = []
    for batch in batches:
        states = model(**batch, output_hidden_states=True).hidden_states
        queries.append(attn.q_proj(model.model.layers[j].input_layernorm(states[j])).flatten(0, 1))
    model.swiftkv(True)
    q = torch.cat(queries).double().view(-1, kv_heads, heads // kv_heads, d)
    energy = q.pow(2).mean((0, 2))
    energy = torch.cat([(energy[:, : d // 2] + energy[:, d // 2 :]) / 2] * 2, 1)
    o = attn.o_proj.weight.double()
    values = [
        sum(o[:, i * d : (i + 1) * d].T @ o[:, i * d : (i + 1) * d] for i in (2 * h, 2 * h + 1))
        for h in (0, 1)
    ]
    return torch.block_diag(*[torch.diag(e) for e in energy], *values)


@torch.no_grad()
@pytest.mark.parametrize("group, member_metric", [(1, True), (2, False), (2, True)])
def test_fit_is_the_least_squares_solution_and_report_is_exact(group, member_metric):
    batches = _batches()
    model = convert(tiny_base("llama"), 2, group)
    x, targets = _teacher_targets(model, batches)
    published = ((_student_kv(model, x, 3) - targets[3]) ** 2).sum() if group == 1 else None
    metrics = {j: _member_metric(model, batches, j) for j in (2, 3)} if member_metric else {}
    report = fit_kv_projections(model, batches, ridge=0.0, member_metric=member_metric)
    xd = x.double()
    for leader in range(2, 4, group):
        members = [targets[j] for j in range(leader, leader + group)]
        residuals = [(_student_kv(model, x, leader) - y).double() for y in members]
        # optimality (normal equations): the gradient of sum_j ||(x W - Y_j) M_j^(1/2)||^2 vanishes, M_j = I without
        # member_metric (the shared projection then fits the members' mean K/V); g = 1 is the plain fit either way
        if group > 1 and member_metric:
            gradient = sum(
                xd.T @ r @ metrics[j] for j, r in zip(range(leader, leader + group), residuals, strict=True)
            )
            scale = (
                xd.abs().max()
                * max(y.abs().max() for y in members)
                * max(m.abs().max() for m in metrics.values())
            )
        else:
            gradient, scale = (
                sum(xd.T @ r for r in residuals),
                xd.abs().max() * max(y.abs().max() for y in members),
            )
        assert gradient.abs().max() < 1e-3 * scale
        if group > 1 and member_metric:  # and it differs from the mean-K/V fit: the members' metrics differ
            assert sum(xd.T @ r for r in residuals).abs().max() > 1e-2 * scale / metrics[leader].abs().max()
        fitted = _student_kv(model, x, leader)
        explained = 1 - sum((fitted - y).pow(2).sum() for y in members) / sum(y.pow(2).sum() for y in members)
        assert report[f"explained/{leader}"] == pytest.approx(float(explained), abs=1e-4)
    if group == 1:  # layer 3: better than the published copy of k/v_proj (exact only for layer l itself)
        assert ((_student_kv(model, x, 3) - targets[3]) ** 2).sum() < 0.5 * published


@torch.no_grad()
def test_attention_weighting_is_the_weighted_least_squares_solution():
    """Against a direct weighted solve, with the teacher's attention probabilities read from HF's own
    output_attentions (eager): per KV head, weights sum_q a_qt^2 averaged over the head's query heads."""
    batches = _batches(n_batches=2)
    model = convert(tiny_base("llama"), 2, 1)
    x, targets = _teacher_targets(model, batches)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        attentions = [model.swiftkv(False)(**b, output_attentions=True).attentions for b in batches]
    model.swiftkv(True).config._attn_implementation = "sdpa"
    report = fit_kv_projections(model, batches, ridge=0.0, weighting="attention")
    assert model.config._attn_implementation == "sdpa"
    heads, kv_heads, head_dim = 4, 2, 16
    for j in (2, 3):
        probs = torch.cat([a[j] for a in attentions]).double()  # (rows, heads, queries, keys)
        received = probs.pow(2).sum(-2).view(len(probs), kv_heads, heads // kv_heads, -1).mean(2)
        attn = model.model.layers[j].self_attn
        xd = x.double()
        for h in range(kv_heads):
            w = received[:, h].reshape(-1, 1)
            cols = slice(h * head_dim, (h + 1) * head_dim)
            y = torch.cat([targets[j][:, :32][:, cols], targets[j][:, 32:][:, cols]], 1).double()
            solution = torch.linalg.solve(xd.T @ (w * xd), xd.T @ (w * y))
            assert_close(
                attn.k_proj_swiftkv.weight[cols].double(), solution[:, :head_dim].T, atol=2e-4, rtol=1e-3
            )
            assert_close(
                attn.v_proj_swiftkv.weight[cols].double(), solution[:, head_dim:].T, atol=2e-4, rtol=1e-3
            )
    assert 0 < report["explained/3"] < 1


@torch.no_grad()
@pytest.mark.parametrize(("family", "group"), [("llama", 1), ("qwen2", 2)])
def test_the_fit_holds_its_normal_equations_and_no_attention_matrix(family, group):
    """What a fit holds is known before it runs (``statistics_bytes``: the size check of a run) and is exactly what
    it accumulates; under attention weighting each layer's ``heads x T x T`` probabilities are reduced to per-token
    weights as the layer ends (at 8B and 8k tokens, 16 layers' matrices would take 69 GB)."""
    model = convert(tiny_base(family), 2, group).swiftkv(False)
    batch = _batches(n_batches=1)[0]
    for weighting in ("uniform", "attention"):
        with KVLeastSquares(model, weighting=weighting) as fit:
            model(**batch)
            weights = [t for (_, kind), t in fit._outputs.items() if kind == "a"]
            assert len(weights) == (2 if weighting == "attention" else 0)
            assert all(
                t.shape == (batch["input_ids"].numel(), model.config.num_key_value_heads) for t in weights
            )
            fit.collect()
        held = sum(t.numel() * t.element_size() for sums in (fit.xx, fit.xy) for t in sums.values())
        assert held == fit.statistics_bytes(), weighting


@torch.no_grad()
def test_padding_is_left_out():
    """A left-padded batch fits exactly as its unpadded sequences do."""
    model_a, model_b = (convert(tiny_base("llama"), 2, 1) for _ in range(2))
    g = torch.Generator().manual_seed(3)
    long, short = torch.randint(1, 128, (1, 100), generator=g), torch.randint(1, 128, (1, 80), generator=g)
    padded = torch.cat([torch.cat([torch.full((1, 20), 7), short], 1), long])
    mask = torch.ones_like(padded)
    mask[0, :20] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    fit_kv_projections(model_a, [{"input_ids": padded, "attention_mask": mask, "position_ids": positions}])
    fit_kv_projections(model_b, [{"input_ids": short}, {"input_ids": long}])
    for j in (2, 3):
        a, b = model_a.model.layers[j].self_attn, model_b.model.layers[j].self_attn
        assert_close(a.k_proj_swiftkv.weight, b.k_proj_swiftkv.weight, atol=1e-4, rtol=1e-3)
        assert_close(a.v_proj_swiftkv.weight, b.v_proj_swiftkv.weight, atol=1e-4, rtol=1e-3)


def test_needs_a_teacher_forward():
    model = convert(tiny_base("llama"), 2, 1)
    with pytest.raises(RuntimeError, match="No tokens"):
        fit_kv_projections(model, [])


def test_a_serving_export_is_refused_and_left_without_hooks(tmp_path):
    """A serving export has no teacher K/V to fit to: refused, and no hook of the fit is left on the model (one
    would normalise layer l's input and keep it on every later forward)."""
    from transformers import AutoModelForCausalLM

    from swiftkv_core.convert import export_for_serving

    export_for_serving(convert(tiny_base("llama"), 2, 1), tmp_path / "serving")
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "serving")
    fit = KVLeastSquares(served)
    with pytest.raises(ValueError, match="no teacher k_proj/v_proj \\(a serving export\\)"):
        fit.__enter__()
    assert not any(module._forward_pre_hooks or module._forward_hooks for module in served.modules())


def _fit_in_process(rank: int, world: int, init: str, batches: list, out: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )  # a process left waiting fails the test instead of hanging it
    model = convert(tiny_base("llama"), 2)
    try:
        fit_kv_projections(model, batches[rank], ridge=1e-4, all_processes=True)
        torch.save({k: v for k, v in model.state_dict().items() if "_swiftkv" in k}, f"{out}.{rank}")
    except RuntimeError as error:
        torch.save(str(error), f"{out}.{rank}")
    torch.distributed.destroy_process_group()


@pytest.mark.distributed
def test_processes_fit_the_sum_of_their_batches(tmp_path):
    """``all_processes``: two processes (gloo), each with half the batches, get the one fit to all of them, which
    neither half alone gives; a process with no batch stops every process with the reason, none waits."""
    batches = _batches()
    out = str(tmp_path / "fit")
    torch.multiprocessing.spawn(
        _fit_in_process, (2, str(tmp_path / "init"), [batches[:2], batches[2:]], out), nprocs=2
    )
    model = convert(tiny_base("llama"), 2)
    fit_kv_projections(model, batches, ridge=1e-4)
    whole = {k: v.clone() for k, v in model.state_dict().items() if "_swiftkv" in k}
    for rank in (0, 1):
        assert_close(torch.load(f"{out}.{rank}"), whole, rtol=1e-5, atol=1e-6)
    fit_kv_projections(model, batches[:2], ridge=1e-4)
    assert not torch.allclose(model.state_dict()["model.layers.3.self_attn.k_proj_swiftkv.weight"],
                              whole["model.layers.3.self_attn.k_proj_swiftkv.weight"])  # fmt: skip
    torch.multiprocessing.spawn(_fit_in_process, (2, str(tmp_path / "init2"), [batches, []], out), nprocs=2)
    # outside a process group: said at once
    with pytest.raises(RuntimeError, match="no torch.distributed process group"):
        fit_kv_projections(model, batches, all_processes=True)
    assert [torch.load(f"{out}.{rank}") for rank in (0, 1)] == [
        "1 process(es) collected no tokens for the K/V fit: give each of them batches."
    ] * 2
