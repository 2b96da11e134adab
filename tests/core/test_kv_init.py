"""The least-squares K/V initialisation (swiftkv_core.kv_init) against direct computations."""

import pytest
import torch
from torch.testing import assert_close

from swiftkv_core.convert import convert
from swiftkv_core.kv_init import fit_kv_projections
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
@pytest.mark.parametrize("group", [1, 2])
def test_fit_is_the_least_squares_solution_and_report_is_exact(group):
    batches = _batches()
    model = convert(tiny_base("llama"), 2, group)
    x, targets = _teacher_targets(model, batches)
    published = ((_student_kv(model, x, 3) - targets[3]) ** 2).sum() if group == 1 else None
    report = fit_kv_projections(model, batches, ridge=0.0)
    for leader in range(2, 4, group):
        members = [targets[j] for j in range(leader, leader + group)]
        target = torch.stack(members).mean(0)  # the least-squares target of a shared projection
        residual = _student_kv(model, x, leader) - target
        # optimality: the residual is orthogonal to every input direction (normal equations)
        assert (x.T.double() @ residual.double()).abs().max() < 1e-3 * x.abs().max() * target.abs().max()
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
