"""Numerical Pruning math against direct float64 references (docs/methods/numerical.md)."""

from types import SimpleNamespace

import pytest
import torch

from optimum_prune import FLAPConfig, NumericalConfig
from optimum_prune.functional.compensation import compensate, compensate_with_bias, obs_compensation
from optimum_prune.methods.numerical.functional import (
    numerical_scores,
    numerical_scores_newton,
    removal_losses,
    score_matrix,
)

# architectures whose o_proj / down_proj may or may not carry a bias (`ArchitectureSpec.output_bias`)
BIAS, NO_BIAS = SimpleNamespace(output_bias=True), SimpleNamespace(output_bias=False)


def _problem(d_out=6, D=10, N=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, D, generator=g, dtype=torch.float64)
    X = torch.randn(N, D, generator=g, dtype=torch.float64) @ torch.randn(D, D, generator=g, dtype=torch.float64)
    return W, X, X.T @ X / N


def _objective(z, W, X, lam_abs, r):
    """f(z) = ½ Σ_i ‖X W_i − X (z∘W_i)‖² + ½ λ (1ᵀz − r)², paper layout W_paper = Wᵀ."""
    Wp = W.T
    diff = X @ Wp - X @ (z[:, None] * Wp)
    return 0.5 * (diff**2).sum() + 0.5 * lam_abs * (z.sum() - r) ** 2


def test_closed_form_equals_newton_iterations():
    W, X, H = _problem()
    z_cf = numerical_scores(W, H, ratio=0.4, lambda_=3.0, damping=0)
    z_nt = numerical_scores_newton(W, H, ratio=0.4, lambda_=3.0, iters=50, damping=0)
    z_1 = numerical_scores_newton(W, H, ratio=0.4, lambda_=3.0, iters=1, damping=0)
    torch.testing.assert_close(z_cf, z_nt, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(z_cf, z_1, rtol=1e-8, atol=1e-10)  # quadratic: one Newton step suffices


def test_closed_form_is_the_minimiser_of_the_objective():
    W, X, H = _problem()
    N, D = X.shape
    A = score_matrix(W, H)
    lam = 2.0
    z = numerical_scores(W, H, ratio=0.3, lambda_=lam, damping=0)
    # scores use the Gram normalised by N, so the objective's λ is in the same units (× N for raw X).
    lam_abs = lam * A.diagonal().mean() * N
    r = 0.7 * D
    f0 = _objective(z, W, X, lam_abs, r)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        assert _objective(z + 1e-3 * torch.randn(D, generator=g, dtype=torch.float64), W, X, lam_abs, r) > f0


def test_exact_constraint_limit_sums_to_r_and_ranking_is_lambda_invariant():
    W, _, H = _problem()
    D = H.shape[0]
    z_inf = numerical_scores(W, H, ratio=0.3, lambda_=None, damping=0)
    assert z_inf.sum().item() == pytest.approx(0.7 * D, rel=1e-10)
    z_big = numerical_scores(W, H, ratio=0.3, lambda_=1e9, damping=0)
    torch.testing.assert_close(z_inf, z_big, rtol=1e-6, atol=1e-6)
    for lam in (0.1, 10.0):
        assert torch.equal(torch.argsort(numerical_scores(W, H, 0.3, lam, 0)), torch.argsort(z_inf))


def test_diagonal_case_ranks_by_wanda_structured_metric():
    g = torch.Generator().manual_seed(0)
    D = 12
    x_sq = torch.rand(D, generator=g, dtype=torch.float64) + 0.1
    H = torch.diag(x_sq)  # uncorrelated inputs
    # A = (WᵀW)∘H is diagonal when W's columns are orthogonal: an orthogonal matrix with scaled columns.
    Q = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0]
    W = Q * (torch.rand(D, generator=g, dtype=torch.float64) + 0.5)
    z = numerical_scores(W, H, 0.5, None, damping=0)
    metric = W.norm(dim=0) * x_sq.sqrt()  # ‖W_:,j‖·‖X_j‖
    assert torch.equal(torch.argsort(z), torch.argsort(metric))


def _shared_mask_reference(W, X, m, r, lam_abs=None):
    """Direct float64 minimiser of f over one mask per unit of m channels (z = P z_u), from X (not from A):
    min ½‖F z_u − y‖² s.t. m·1ᵀz_u = r (KKT), or + ½λ(m·1ᵀz_u − r)²; F stacks X·diag(W_i)·P over the outputs."""
    D = X.shape[1]
    P = torch.zeros(D, D // m, dtype=X.dtype)
    P[torch.arange(D), torch.arange(D) // m] = 1
    F = torch.cat([(X * W[i]) @ P for i in range(W.shape[0])])  # (N·d_out, n)
    y = torch.cat([X @ W[i] for i in range(W.shape[0])])  # (N·d_out,)
    c = torch.full((D // m,), float(m), dtype=X.dtype)
    if lam_abs is None:
        n = D // m
        K = torch.zeros(n + 1, n + 1, dtype=X.dtype)
        K[:n, :n], K[:n, n], K[n, :n] = F.T @ F, c, c
        return torch.linalg.solve(K, torch.cat([F.T @ y, torch.tensor([r], dtype=X.dtype)]))[:n]
    return torch.linalg.solve(F.T @ F + lam_abs * torch.outer(c, c), F.T @ y + lam_abs * r * c)


@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("lam", [None, 2.0])
def test_unit_scores_minimise_the_objective_with_one_mask_per_unit(m, lam):
    W, X, H = _problem()
    N, D = X.shape
    z = numerical_scores(W, H, ratio=0.4, lambda_=lam, damping=0, unit_size=m)
    lam_abs = None if lam is None else lam * score_matrix(W, H).diagonal().mean() * N  # H is X'X / N
    torch.testing.assert_close(z, _shared_mask_reference(W, X, m, 0.6 * D, lam_abs), rtol=1e-7, atol=1e-9)
    if lam is not None:
        z_nt = numerical_scores_newton(W, H, ratio=0.4, lambda_=lam, iters=3, damping=0, unit_size=m)
        torch.testing.assert_close(z_nt, z, rtol=1e-8, atol=1e-10)


def test_unit_scores_weigh_channels_by_their_sum_not_their_harmonic_mean():
    """(b): uncorrelated inputs, orthogonal columns; head 0 has three strong channels and one weak, head 1 four
    middling ones. The mean of the channel scores (≈ 1 − c/importance) sinks head 0 below head 1; the unit's own
    score ranks by the summed importance (30.01 vs 4)."""
    importance = torch.tensor([10.0, 10.0, 10.0, 0.01, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    Q = torch.linalg.qr(torch.randn(8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64))[0]
    W, H = Q, torch.diag(importance)  # A = (WᵀW)∘H = diag(importance)
    channel_mean = numerical_scores(W, H, 0.5, damping=0).view(2, 4).mean(1)
    unit = numerical_scores(W, H, 0.5, damping=0, unit_size=4)
    assert channel_mean[0] < channel_mean[1] and unit[0] > unit[1]
    torch.testing.assert_close(unit, 1 - 0.5 * 8 / (4 * (1 / 30.01 + 1 / 4)) / importance.view(2, 4).sum(1))


def test_unit_scores_of_a_dead_unit_are_minus_infinity():
    W, _, H = _problem()
    H[:2, :] = H[:, :2] = 0  # both channels of unit 0 are dead
    z = numerical_scores(W, H, 0.3, unit_size=2)
    assert z[0] == float("-inf") and torch.isfinite(z[1:]).all()


@pytest.mark.parametrize(("arch", "gqa_mode"), [("llama", "auto"), ("llama_gqa", "group"), ("llama_gqa", "query")])
def test_head_scores_are_the_units_scores_in_channel_units(arch, gqa_mode):
    """head_score="unit": every query head carries its unit's score (a KV group in group mode, itself in query
    mode), standardised with the mean / std of the module's channel scores; "channel_mean" is the paper's mean."""
    from testing_utils import tiny_model

    from optimum_prune.calibration.stats import GramStats
    from optimum_prune.methods.numerical import NumericalPruner
    from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view, weight_oi

    model = tiny_model(arch)
    spec = get_spec(model)
    view = layer_view(get_layers(model, spec)[0], 0, spec, model.config)
    stats = GramStats(view.num_heads * view.head_dim)
    stats.update(torch.randn(64, view.num_heads * view.head_dim, generator=torch.Generator().manual_seed(0)))
    W = weight_oi(view.o_proj).detach()
    z = numerical_scores(W, stats.gram, 0.3)
    per_unit = view.group_size if gqa_mode == "group" else 1
    zu = numerical_scores(W, stats.gram, 0.3, unit_size=per_unit * view.head_dim)
    cfg = NumericalConfig(pruning_ratio=0.3, gqa_mode=gqa_mode)
    head = NumericalPruner(cfg)._head_scores(view, stats)
    torch.testing.assert_close(head, ((zu - z.mean()) / z.std()).repeat_interleave(per_unit))
    paper_cfg = NumericalConfig.paper(pruning_ratio=0.3, gqa_mode=gqa_mode)
    paper = NumericalPruner(paper_cfg)._head_scores(view, stats)
    torch.testing.assert_close(paper, z.view(view.num_heads, view.head_dim).mean(1))


def test_dead_channels_are_pruned_first():
    W, _, H = _problem()
    H[3, :] = H[:, 3] = 0
    z = numerical_scores(W, H, 0.3)
    assert z[3] == float("-inf") and torch.isfinite(z[torch.arange(10) != 3]).all()


@pytest.mark.parametrize("keep", [[0, 2, 3, 5, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8]])
def test_compensation_equals_obs_form_and_least_squares(keep):
    W, X, H = _problem()
    keep_t = torch.tensor(keep)
    prune = torch.tensor([j for j in range(10) if j not in keep])
    W_new, residual = compensate(W, H, keep_t, damping=0)
    assert torch.all(W_new[:, prune] == 0)
    torch.testing.assert_close(W_new, obs_compensation(W, H, prune), rtol=1e-8, atol=1e-9)
    # least-squares refit of the dense output from the kept inputs
    sol = torch.linalg.lstsq(X[:, keep_t], X @ W.T).solution  # (k, d_out)
    torch.testing.assert_close(W_new[:, keep_t], sol.T, rtol=1e-8, atol=1e-9)
    # optimal loss L* = residual ‖X δW‖² (per token)
    direct = ((X @ W.T - X @ W_new.T) ** 2).sum() / X.shape[0]
    assert residual == pytest.approx(direct.item(), rel=1e-8)


@pytest.mark.parametrize("keep", [[0, 2, 3, 5, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8]])
def test_bias_compensation_equals_least_squares_with_intercept(keep):
    W, X, H = _problem()
    X = X + torch.linspace(-2.0, 3.0, X.shape[1], dtype=torch.float64)  # inputs with nonzero means
    H, mean = X.T @ X / X.shape[0], X.mean(0)
    keep_t = torch.tensor(keep)
    W_new, b, residual = compensate_with_bias(W, H, mean, keep_t, damping=0)
    assert torch.all(W_new[:, [j for j in range(10) if j not in keep]] == 0)
    design = torch.cat([X[:, keep_t], torch.ones(X.shape[0], 1, dtype=X.dtype)], dim=1)  # (N, k + 1)
    sol = torch.linalg.lstsq(design, X @ W.T).solution  # (k + 1, d_out)
    torch.testing.assert_close(W_new[:, keep_t], sol[:-1].T, rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(b, sol[-1], rtol=1e-8, atol=1e-9)
    direct = ((X @ W.T - X @ W_new.T - b) ** 2).sum() / X.shape[0]
    assert residual == pytest.approx(direct.item(), rel=1e-8)
    # an intercept can only help: never worse than the refit without one
    assert residual <= compensate(W, H, keep_t, damping=0)[1] + 1e-12


@pytest.mark.parametrize("strength", [0.0, 0.3, 1.0])
def test_compensation_strength_shrinks_the_refit_toward_the_kept_weights(strength):
    """`W + s·(W* − W)` on the kept inputs (zero elsewhere); with a bias, `b` restores the mean output of those
    weights, so s = 0 is FLAP's bias compensation exactly (the removed channels' mean contribution)."""
    from optimum_prune.functional.fluctuation import bias_compensation

    W, X, H = _problem()
    X = X + torch.linspace(-2.0, 3.0, X.shape[1], dtype=torch.float64)
    H, mean = X.T @ X / X.shape[0], X.mean(0)
    keep, prune = torch.tensor([0, 2, 3, 5, 8, 9]), torch.tensor([1, 4, 6, 7])
    cut = W.clone()
    cut[:, prune] = 0
    full, full_b, _ = compensate_with_bias(W, H, mean, keep, damping=0)
    W_s, b_s, residual = compensate_with_bias(W, H, mean, keep, damping=0, strength=strength)
    torch.testing.assert_close(W_s, cut + strength * (full - cut), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(b_s, (W - W_s) @ mean, rtol=1e-10, atol=1e-12)
    direct = ((X @ W.T - X @ W_s.T - b_s) ** 2).sum() / X.shape[0]
    assert residual == pytest.approx(direct.item(), rel=1e-8)
    if strength == 0:
        torch.testing.assert_close(b_s, bias_compensation(W, mean, prune), rtol=1e-10, atol=1e-12)
    plain, _ = compensate(W, H, keep, damping=0, strength=strength)
    torch.testing.assert_close(plain, cut + strength * (compensate(W, H, keep, damping=0)[0] - cut))
    for bad in (-0.1, 1.5, True):
        with pytest.raises(ValueError, match="compensation_strength"):
            NumericalConfig(compensation_strength=bad)


def test_bias_compensation_needs_compensation():
    with pytest.raises(ValueError, match="needs compensate=True"):
        NumericalConfig(compensate=False, compensation_bias=True)


def test_compensation_beats_plain_removal():
    W, X, H = _problem()
    keep = torch.tensor([0, 1, 2, 3, 4, 5])
    W_new, residual = compensate(W, H, keep, damping=0.01)
    W_cut = W.clone()
    W_cut[:, 6:] = 0
    plain = ((X @ (W - W_cut).T) ** 2).sum() / X.shape[0]
    assert residual < plain.item()


@pytest.mark.parametrize(("arch", "gqa"), [("llama", False), ("llama_gqa", True)])
def test_head_cost_is_alpha_in_mlp_channel_units(arch, gqa):
    """α = 4·D_h/3 for an MHA head; (2·n_rep + 2)·D_h/3 for a KV group, in MLP-channel units."""
    from testing_utils import tiny_model

    from optimum_prune.methods.numerical import NumericalPruner
    from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view

    model = tiny_model(arch)
    spec = get_spec(model)
    view = layer_view(get_layers(model, spec)[0], 0, spec, model.config)
    pruner = NumericalPruner(NumericalConfig())
    _, head_cost, members, _ = pruner._head_units(view, torch.zeros(view.num_heads))
    channel_cost = 3 * model.config.hidden_size  # gate row + up row + down column
    n_rep = view.group_size
    expected = (2 * n_rep + 2) * view.head_dim / 3 if gqa else 4 * view.head_dim / 3
    assert head_cost / channel_cost == pytest.approx(expected)
    assert len(members) == view.num_kv_heads and all(len(m) == n_rep for m in members)


@pytest.mark.parametrize(("bias", "strength"), [(False, 1.0), (True, 1.0), (True, 0.5)])
def test_sequential_compensation_equals_dense_refit_where_inputs_are_still_dense(bias, strength):
    """Layer 0 sees the same inputs in both modes, so its refit must be the same; later layers differ."""
    from testing_utils import calibration_ids, tiny_model

    from optimum_prune import prune_
    from optimum_prune.modeling.architectures import get_layers, get_spec, weight_oi

    ids = calibration_ids(8, 16)
    models = {}
    for mode in ("dense", "sequential"):
        models[mode] = tiny_model("opt")
        cfg = NumericalConfig(
            pruning_ratio=0.3, compensation_inputs=mode, compensation_bias=bias, compensation_strength=strength
        )
        prune_(models[mode], cfg, ids)
    spec = get_spec(models["dense"])
    first = [get_layers(m, spec)[0].get_submodule(spec.o_path) for m in models.values()]
    assert first[0].weight.shape == first[1].weight.shape and weight_oi(first[0]).shape[1] < 64  # heads removed
    torch.testing.assert_close(weight_oi(first[0]), weight_oi(first[1]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(first[0].bias, first[1].bias, rtol=1e-4, atol=1e-4)  # OPT has biases anyway
    last = [weight_oi(get_layers(m, spec)[2].get_submodule(spec.mlp_out_path)) for m in models.values()]
    assert not torch.allclose(last[0], last[1], atol=1e-3)


@pytest.mark.parametrize("compensated", [True, False])
def test_removal_losses_equal_the_direct_refit_residual(compensated):
    """L*(P) = min over the kept weights of the per-token loss (least squares), or the bare removal loss."""
    W, X, H = _problem()
    groups = torch.tensor([[0, 3], [1, 2], [7, 9]])
    losses = removal_losses(W, H, groups, damping=0, compensated=compensated)
    for P, loss in zip(groups.tolist(), losses.tolist()):
        K = [j for j in range(10) if j not in P]
        target = X @ W.T  # (N, d_out)
        if compensated:
            sol = torch.linalg.lstsq(X[:, K], target).solution  # (k, d_out)
            direct = ((target - X[:, K] @ sol) ** 2).sum() / X.shape[0]
        else:
            direct = ((X[:, P] @ W[:, P].T) ** 2).sum() / X.shape[0]
        assert loss == pytest.approx(direct.item(), rel=1e-8)
    single = removal_losses(W, H, torch.arange(10)[:, None], damping=0)
    Hinv = torch.linalg.inv(H)
    torch.testing.assert_close(single, (W**2).sum(0) / Hinv.diagonal(), rtol=1e-8, atol=1e-12)  # OBS saliency


def test_removal_losses_are_absolute():
    """Unlike the exact-constraint scores, the loss follows the module's scale: comparable across modules."""
    W, _, H = _problem()
    groups = torch.arange(10).view(5, 2)
    base = removal_losses(W, H, groups, damping=0.01)
    torch.testing.assert_close(removal_losses(3 * W, H, groups, damping=0.01), 9 * base)
    torch.testing.assert_close(removal_losses(W, 4 * H, groups, damping=0.01), 4 * base)
    z = numerical_scores(W, H, 0.3)
    torch.testing.assert_close(numerical_scores(3 * W, 4 * H, 0.3), z)  # scale-free: a per-module quota


def test_one_dead_channel_does_not_drag_its_head_out():
    from optimum_prune.methods.numerical.pruner import _head_means

    z = torch.tensor([[0.9, 0.8, float("-inf")], [0.5, 0.6, 0.4], [float("-inf")] * 3], dtype=torch.float64)
    heads = _head_means(z)
    assert heads[0] == pytest.approx(0.85) and heads[1] == pytest.approx(0.5) and heads[2] == float("-inf")


@pytest.mark.parametrize("arch", ["llama", "llama_gqa"])
def test_loss_ranking_scores_units_by_loss_per_parameter(arch):
    """`ranking="loss"`: a unit's score is removal_losses of its channels over its parameter cost."""
    from testing_utils import tiny_model

    from optimum_prune.calibration.stats import GramStats
    from optimum_prune.methods.numerical import NumericalPruner
    from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view, weight_oi
    from optimum_prune.modeling.shapes import head_costs, mlp_channel_cost

    model = tiny_model(arch)
    spec = get_spec(model)
    view = layer_view(get_layers(model, spec)[0], 0, spec, model.config)
    g = torch.Generator().manual_seed(0)
    stats = {"attn": GramStats(view.num_heads * view.head_dim), "mlp": GramStats(view.intermediate_size)}
    for s in stats.values():
        s.update(torch.randn(64, s.sum.shape[0], generator=g) + 0.3)
    pruner = NumericalPruner(NumericalConfig(ranking="loss", standardize_per_layer=False))
    head, chan = pruner.score_layer(view, stats)
    W_o, W_d = weight_oi(view.o_proj).detach(), weight_oi(view.mlp_out).detach()
    per_q_head, per_group = head_costs(view)
    d, gsz = view.head_dim, view.group_size
    # a unit is a KV group (one head in MHA): its channels go together, every head carries the group's score
    groups = torch.arange(view.num_heads * d).view(view.num_kv_heads, gsz * d)
    damp = pruner.config.compensation_damping
    expected = removal_losses(W_o, stats["attn"].gram, groups, damp).repeat_interleave(gsz) / per_group
    torch.testing.assert_close(head, expected)
    if gsz == 1:
        assert per_group == pytest.approx(2 * per_q_head)  # q, o plus k, v rows
    chan_expected = removal_losses(W_d, stats["mlp"].gram, torch.arange(view.intermediate_size)[:, None], damp)
    torch.testing.assert_close(chan, chan_expected / mlp_channel_cost(view))
    # standardised: a unit's loss per channel, in the units of the module's single-channel losses
    head_std, chan_std = NumericalPruner(NumericalConfig(ranking="loss")).score_layer(view, stats)
    single = removal_losses(W_o, stats["attn"].gram, torch.arange(view.num_heads * d)[:, None], damp)
    unit = removal_losses(W_o, stats["attn"].gram, groups, damp) / (gsz * d)
    torch.testing.assert_close(head_std, ((unit - single.mean()) / single.std()).repeat_interleave(gsz))
    torch.testing.assert_close(chan_std, (chan_expected - chan_expected.mean()) / chan_expected.std())


def test_loss_ranking_rejects_score_options():
    with pytest.raises(ValueError, match="ranking='loss'"):
        NumericalConfig(ranking="loss", solver="newton", lambda_=10.0)


def test_literal_alpha_is_the_unit_cost_in_mlp_channels():
    """(d): the literal α of a GQA group is its cost, (2·n_rep+2)·D_h/3 MLP channels, not 4·D_h/3."""
    from optimum_prune.functional.allocation import LayerUnits, allocate, literal_head_weight

    u = LayerUnits(torch.tensor([1.0, 1.0]), 170.0, 1, torch.linspace(0.5, 2.5, 100), 1.0, 99)
    assert literal_head_weight(u, 85.0) == 170.0
    no_mlp = LayerUnits(torch.tensor([1.0, 1.0]), 170.0, 1, None, 0.0, 0)
    assert literal_head_weight(no_mlp, 85.0) == 85.0
    # scores 1 × 170 sort after every channel (≤ 2.5): the unit-count threshold removes channels only
    heads, chans = allocate([u], 0.1, 440.0, mode="literal", head_weight=85.0)
    assert heads == [[]] and chans == [list(range(10))]


def test_paper_preset_is_the_papers_setting():
    cfg = NumericalConfig.paper(pruning_ratio=0.3, round_to=8)
    assert (cfg.pruning_ratio, cfg.round_to, cfg.ranking) == (0.3, 8, "cost_weighted")
    assert not cfg.standardize_per_layer and not cfg.compensation_bias and cfg.compensation_inputs == "dense"
    assert cfg.lambda_ is None and cfg.compensate and cfg.compensation_damping == 0.01
    assert cfg.head_score == "channel_mean"
    default = NumericalConfig()  # the measured default differs from the paper in allocation and damping
    assert default.resolved_standardize and default.compensation_damping == 0.1 and default.head_score == "unit"
    assert NumericalConfig.paper(literal=True).ranking == "literal"
    assert NumericalConfig.from_dict(cfg.to_dict()) == cfg


def test_fluctuation_metric_is_flaps_from_the_gram():
    """`scores="fluctuation"` computes FLAP's ‖W_:,j‖²·Var(x_j) from NP's Gram and mean (float64 reference)."""
    from optimum_prune.calibration.stats import GramStats
    from optimum_prune.functional.fluctuation import fluctuation_scores

    W, X, _ = _problem(D=12, N=300)
    X = X + torch.linspace(-2, 2, 12, dtype=torch.float64)  # channel means matter: Var, not E[x²]
    stats = GramStats(12, dtype=torch.float64)
    stats.update(X)
    var = X.var(0, unbiased=False)
    ref = var * (W * W).sum(0)
    ref = (ref - ref.mean()) / ref.std()
    mean = stats.mean.double()
    got = fluctuation_scores(W, mean, stats.gram.diagonal().double() - mean * mean)
    torch.testing.assert_close(got, ref)
    heads = fluctuation_scores(W, mean, var, square=True, head_dim=4)  # FLAP's attention: squared, head mean
    sq = (var * (W * W).sum(0)) ** 2
    torch.testing.assert_close(heads, ((sq - sq.mean()) / sq.std()).view(3, 4).mean(1))


@pytest.mark.parametrize("arch", ["llama", "llama_gqa"])
def test_fluctuation_scores_choose_flaps_units(arch):
    """Without compensation, NP with `scores="fluctuation"` removes exactly the heads and channels FLAP removes."""
    from testing_utils import calibration_ids, tiny_model

    from optimum_prune import FLAPConfig
    from optimum_prune.prune import _compute_plan

    ids = calibration_ids(8, 16)
    _, flap = _compute_plan(tiny_model(arch), FLAPConfig(pruning_ratio=0.3, round_to=1, bias_compensation=False), ids)
    np_cfg = NumericalConfig(pruning_ratio=0.3, round_to=1, scores="fluctuation", compensate=False)
    _, npf = _compute_plan(tiny_model(arch), np_cfg, ids)
    assert flap.layers and flap.summary() == npf.summary()
    for i, lp in flap.layers.items():
        assert lp.keep_heads == npf.layers[i].keep_heads and lp.keep_channels == npf.layers[i].keep_channels


def test_fluctuation_scores_take_the_cost_weighted_ranking():
    with pytest.raises(ValueError, match="scores='fluctuation'"):
        NumericalConfig(scores="fluctuation", ranking="loss")
    with pytest.raises(ValueError, match="scores"):
        NumericalConfig(scores="fluctation")


@pytest.mark.parametrize(
    "ratio, light",
    [(0.1, True), (0.2, True), (0.25, True), (0.2749, True), (0.275, False), (0.3, False), (0.5, False)],
)
def test_auto_rule_on_either_side_of_the_light_ratio(ratio, light):
    """The per-layer default (the switch where the selection-split grids of SmolLM2 and Gemma-3, pooled, put it):
    below 27.5% FLAP's metric with a bias refit at half strength, from 27.5% the numerical scores with the full refit
    and no bias. Literal values, so moving the switch or the strength without a new measurement fails here."""
    # "auto" unresolved: the per-layer rule until the pruner resolves it
    for allocation in ("auto", "global", "uniform"):
        config = NumericalConfig(pruning_ratio=ratio, allocation=allocation)
        expected = ("fluctuation", True, 0.5) if light else ("numerical", False, 1.0)
        assert (config.scores, config.resolved_scores, config.refit_bias, config.refit_strength) == ("auto", *expected)
        # where the architecture's graph reads no o_proj / down_proj bias (Qwen3, Gemma-3) the light rule refits none
        assert config.for_architecture(NO_BIAS).refit_bias is False
        assert config.for_architecture(BIAS).refit_bias is light
        assert NumericalConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("ratio, light", [(0.1, True), (0.2, True), (0.2499, True), (0.25, False), (0.3, False)])
def test_servable_auto_rule_on_either_side_of_its_light_ratio(ratio, light):
    """`allocation="servable"` switches at 25%, where SmolLM2's servable grid put it: below, FLAP's metric with the
    full refit (the format holds no bias), from 25% the numerical scores."""
    config = NumericalConfig(pruning_ratio=ratio, allocation="servable")
    expected = ("fluctuation" if light else "numerical", False, 1.0)
    assert (config.resolved_scores, config.refit_bias, config.refit_strength) == expected
    # the numerical scores rank raw at 25-35% (its re-screen: better at 30%); FLAP's metric stays standardised
    assert config.resolved_standardize is light


@pytest.mark.parametrize("ratio, standardized", [(0.3, False), (0.3499, False), (0.35, True), (0.4, True),
                                                  (0.4499, True), (0.45, False), (0.5, False)])  # fmt: skip
def test_servable_numerical_scores_standardised_only_on_their_band(ratio, standardized):
    """Under `allocation="servable"` the numerical scores rank raw except at 35% ≤ ratio < 45%, where the
    selection-split grid found raw scores worse (0.35, 0.4) before they won again (0.45)."""
    assert NumericalConfig(pruning_ratio=ratio, allocation="servable").resolved_standardize is standardized


@pytest.mark.parametrize("allocation", ["auto", "global", "uniform", "servable"])
@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.5])
def test_standardisation_is_off_only_for_the_servable_numerical_rule(allocation, ratio):
    """`standardize_per_layer=None` resolves to raw scores only under `allocation="servable"` with the numerical
    scores; everywhere else (Gemma-3's per-layer re-screen: a tie and a loss) it stays on; an explicit value wins."""
    config = NumericalConfig(pruning_ratio=ratio, allocation=allocation)
    assert config.standardize_per_layer is None
    assert config.resolved_standardize is not (allocation == "servable" and ratio in (0.3, 0.5))
    for explicit in (True, False):
        assert NumericalConfig(pruning_ratio=ratio, allocation=allocation,
                               standardize_per_layer=explicit).resolved_standardize is explicit  # fmt: skip
    assert NumericalConfig(pruning_ratio=ratio, allocation="servable", scores="fluctuation").resolved_standardize


def test_servable_default_at_50_percent_ranks_raw_scores():
    """The plan of the servable default at 50% is the plan of the explicit raw scores, and differs from the
    standardised one (so the setting reaches the ranking)."""
    from testing_utils import calibration_ids, tiny_model

    from optimum_prune.prune import _compute_plan

    ids = calibration_ids(8, 16)

    def plan(**kw):
        model = tiny_model("llama_gqa", intermediate_size=768, num_hidden_layers=4)  # room for blocks of 256
        p = _compute_plan(model, NumericalConfig(pruning_ratio=0.5, **kw), ids)[1]
        return [(lp.keep_heads, lp.keep_kv_heads, lp.keep_channels) for _, lp in sorted(p.layers.items())]

    auto = plan(allocation="servable")
    assert auto == plan(allocation="servable", standardize_per_layer=False)
    assert auto != plan(allocation="servable", standardize_per_layer=True)


def test_explicit_settings_win_over_the_auto_rule():
    """Every explicit setting wins over the automatic one; the paper preset is always numerical without a bias."""
    assert NumericalConfig(pruning_ratio=0.1, compensation_strength=1.0).refit_strength == 1.0
    assert NumericalConfig(pruning_ratio=0.5, compensation_strength=0.0).refit_strength == 0.0
    assert not NumericalConfig(pruning_ratio=0.1, compensation_bias=False).refit_bias
    servable = NumericalConfig(pruning_ratio=0.2, allocation="servable")  # no bias refit: the full refit
    assert (servable.resolved_scores, servable.refit_bias, servable.refit_strength) == ("fluctuation", False, 1.0)
    assert servable.for_architecture(BIAS).compensation_bias is False  # an architecture's bias slot adds none
    assert FLAPConfig(allocation="servable").for_architecture(BIAS).bias_compensation is False
    assert FLAPConfig().for_architecture(NO_BIAS).bias_compensation is False
    assert FLAPConfig().for_architecture(BIAS).bias_compensation is True
    assert NumericalConfig(pruning_ratio=0.1, compensate=False).refit_bias is False
    assert NumericalConfig(pruning_ratio=0.1, scores="numerical").resolved_scores == "numerical"
    assert NumericalConfig(pruning_ratio=0.5, scores="fluctuation").refit_bias
    assert NumericalConfig(pruning_ratio=0.1, ranking="loss").resolved_scores == "numerical"
    assert NumericalConfig(pruning_ratio=0.1, compensation_bias=True).for_architecture(NO_BIAS).refit_bias
    paper = NumericalConfig.paper(pruning_ratio=0.1)
    assert (paper.resolved_scores, paper.refit_bias, paper.refit_strength) == ("numerical", False, 1.0)


def test_auto_default_below_the_light_ratio_is_the_fluctuation_ranking_with_bias():
    from testing_utils import calibration_ids, tiny_model

    from optimum_prune.prune import _compute_plan

    ids = calibration_ids(8, 16)
    _, auto = _compute_plan(tiny_model("llama_gqa"), NumericalConfig(pruning_ratio=0.2, round_to=1), ids)
    explicit = NumericalConfig(pruning_ratio=0.2, round_to=1, scores="fluctuation", compensation_bias=True)
    _, ref = _compute_plan(tiny_model("llama_gqa"), explicit, ids)
    assert auto.summary() == ref.summary() and any(lp.biases for lp in auto.layers.values())
