import math

import pytest
import torch

from optimum_prune.functional.hessian import largest_eigenvalue
from optimum_prune.functional.masks import is_valid_nm, num_pruned
from optimum_prune.functional.proximal import soft_threshold
from optimum_prune.methods.fista.functional import (
    fista_inner,
    fista_inner_spectral,
    fista_objective,
    fista_prune,
    lipschitz_constant,
    prox_is_negligible,
    reconstruction_error,
    round_to_pattern,
    shrink_refit,
    spectral_gram,
)


def _problem(m=5, n=12, p=40, seed=0, noise=0.3):
    """Dense input X, pruned-network input X* (a perturbed X), dense weight W and token-normalised Grams."""
    gen = torch.Generator().manual_seed(seed)
    X = (
        torch.randn(n, p, generator=gen, dtype=torch.float64)
        * torch.linspace(0.5, 2.0, n, dtype=torch.float64)[:, None]
    )
    Xs = X + noise * torch.randn(n, p, generator=gen, dtype=torch.float64)
    W = torch.randn(m, n, generator=gen, dtype=torch.float64)
    G, Gs, C = X @ X.T / p, Xs @ Xs.T / p, X @ Xs.T / p
    return X, Xs, W, G, Gs, C


def lasso_cd(Xs, Y, lam, sweeps=200):
    """Reference: cyclic coordinate descent on explicit data, per row: ½||w X* − y||² + lam ||w||_1."""
    m, n = Y.shape[0], Xs.shape[0]
    W = torch.zeros(m, n, dtype=torch.float64)
    col_sq = (Xs**2).sum(dim=1)
    for i in range(m):
        r = Y[i].clone()  # residual y − w X*
        for _ in range(sweeps):
            for j in range(n):
                rho = float(Xs[j] @ r) + float(W[i, j]) * float(col_sq[j])
                new = math.copysign(max(abs(rho) - lam, 0.0), rho) / float(col_sq[j])
                r -= (new - float(W[i, j])) * Xs[j]
                W[i, j] = new
    return W


def test_soft_threshold():
    x = torch.tensor([-3.0, -1.0, -0.5, 0.0, 0.4, 1.0, 2.5])
    expected = torch.tensor([-2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.5])
    assert torch.equal(soft_threshold(x, 1.0), expected)
    assert torch.equal(soft_threshold(x, 0.0), x)
    tau = torch.tensor([[0.5], [2.0]])
    out = soft_threshold(torch.stack([x, x]), tau)
    assert torch.equal(out[0], torch.sign(x) * (x.abs() - 0.5).clamp_min(0))
    assert torch.equal(out[1], torch.sign(x) * (x.abs() - 2.0).clamp_min(0))
    with pytest.raises(ValueError, match="tau >= 0"):
        soft_threshold(x, -0.1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gram_error_equals_explicit_error(dtype):
    X, Xs, W, G, Gs, C = _problem(m=7, n=20, p=60, seed=1)
    A = W * (torch.rand(W.shape, generator=torch.Generator().manual_seed(2)) > 0.5) + 0.05
    explicit = torch.linalg.norm(A @ Xs - W @ X).item() / math.sqrt(60)  # normalised Grams -> / sqrt(p)
    got = reconstruction_error(*(t.to(dtype) for t in (A, W, G, Gs, C)))
    assert got == pytest.approx(explicit, rel=1e-10 if dtype == torch.float64 else 1e-5)
    swapped = reconstruction_error(A, W, G, Gs, C.T)  # catches a transposed cross Gram
    assert abs(swapped - explicit) > 1e-3 * explicit
    assert reconstruction_error(W, W, G, G, G) == pytest.approx(0.0, abs=1e-6)


@pytest.fixture(scope="module")
def lasso_case():
    X, Xs, W, G, Gs, C = _problem(seed=3)
    lam = 0.3 * (W @ C).abs().max().item()  # fixed λ giving a mix of zeros and nonzeros
    W_ref = lasso_cd(Xs, W @ X, lam * X.shape[1])  # Grams are divided by p, so λ scales by p on explicit data
    return W, Gs, C, lam, W_ref


@pytest.mark.parametrize("momentum", ["standard", "paper", "none"])
def test_fista_inner_matches_coordinate_descent(lasso_case, momentum):
    W, Gs, C, lam, W_ref = lasso_case
    L = torch.linalg.eigvalsh(Gs).max().item()
    W_fista, iters = fista_inner(torch.zeros_like(W), W @ C, Gs, lam, L, K=5000, tol=1e-13, momentum=momentum)
    torch.testing.assert_close(W_fista, W_ref, rtol=1e-6, atol=1e-8)
    n_zero = int((W_ref == 0).sum())
    assert 0 < n_zero < W.numel()
    if momentum != "paper":  # the literal scheme oscillates and returns an extrapolated (not thresholded) point
        assert iters < 5000  # stopped through the tolerance
        assert torch.equal(W_fista == 0, W_ref == 0)


def _explicit_fista(W_init, W, X, Xs, lam, L, K, momentum):
    """Paper Eq. 5 written on explicit data (gradient (W* X* − W X) X*ᵀ / p), for pinning the iteration itself."""
    p = X.shape[1]

    def prox_grad(A):
        step = A - ((A @ Xs - W @ X) @ Xs.T / p) / L
        return torch.sign(step) * (step.abs() - lam / L).clamp_min(0)

    x_prev, y, t = W_init, W_init, 1.0
    for _ in range(K):
        x = prox_grad(y)
        t_next = (1 + math.sqrt(1 + 4 * t * t)) / 2
        if momentum == "standard":  # Beck–Teboulle
            y, x_prev = x + (t - 1) / t_next * (x - x_prev), x
        elif momentum == "paper":  # W_{k+1} = W_half + (t_k − 1)/t_{k+1} (W_half − W_k)
            y = x + (t - 1) / t_next * (x - y)
            x_prev = y
        else:
            y = x_prev = x
        t = t_next
    return x_prev


@pytest.mark.parametrize("momentum", ["standard", "paper", "none"])
def test_fista_inner_iterates_match_explicit_scheme(momentum):
    X, Xs, W, G, Gs, C = _problem(seed=12)
    W0 = round_to_pattern(W, 0.5)
    lam, L = 0.05, lipschitz_constant(Gs)
    for K in (1, 2, 7):
        got, iters = fista_inner(W0, W @ C, Gs, lam, L, K=K, tol=0.0, momentum=momentum)
        torch.testing.assert_close(got, _explicit_fista(W0, W, X, Xs, lam, L, K, momentum), rtol=1e-10, atol=1e-12)
        assert iters == K


def test_objective_decreases():
    X, Xs, W, G, Gs, C = _problem(seed=4)
    WC, L = W @ C, lipschitz_constant(Gs)
    lam = 0.1 * WC.abs().max().item()
    W0 = round_to_pattern(W, 0.5)
    objective = [fista_objective(W0, W, G, Gs, C, lam)]
    A = W0
    for _ in range(30):  # ISTA (no momentum) is monotone: check every step
        A, _ = fista_inner(A, WC, Gs, lam, L, K=1, tol=0.0, momentum="none")
        objective.append(fista_objective(A, W, G, Gs, C, lam))
    assert all(b <= a + 1e-12 for a, b in zip(objective, objective[1:]))
    assert objective[-1] < 0.9 * objective[0]
    best = fista_objective(fista_inner(W0, WC, Gs, lam, L, K=5000, tol=1e-14)[0], W, G, Gs, C, lam)
    for K in (1, 5, 20, 100):
        got = fista_objective(fista_inner(W0, WC, Gs, lam, L, K=K, tol=0.0)[0], W, G, Gs, C, lam)
        assert best - 1e-10 <= got < objective[0]
    assert got == pytest.approx(best, rel=1e-6)


def test_fista_inner_early_stop():
    _, _, W, _, Gs, C = _problem(seed=5)
    L = lipschitz_constant(Gs)
    assert fista_inner(W, W @ C, Gs, 1e-3, L, K=20, tol=1e3)[1] == 1
    assert fista_inner(W, W @ C, Gs, 1e-3, L, K=20, tol=0.0)[1] == 20
    with pytest.raises(ValueError, match="momentum"):
        fista_inner(W, W @ C, Gs, 1e-3, L, momentum="nesterov")


def test_lipschitz_constant_methods():
    _, _, _, _, Gs, _ = _problem(n=40, p=100, seed=6)
    exact = torch.linalg.eigvalsh(Gs).max().item()
    assert lipschitz_constant(Gs) == pytest.approx(exact, rel=1e-12)
    power = largest_eigenvalue(Gs, method="power", iters=500)
    assert exact <= power <= 1.011 * exact


@pytest.mark.parametrize("per", ["matrix", "row"])
def test_round_to_pattern_unstructured(per):
    W = torch.randn(9, 14, generator=torch.Generator().manual_seed(7))
    R = round_to_pattern(W, 0.45, per=per)
    kept = R != 0
    assert torch.equal(R[kept], W[kept])  # kept values are not refitted
    if per == "matrix":
        assert int((~kept).sum()) == num_pruned(W.numel(), 0.45)
    else:
        assert ((~kept).sum(dim=1) == num_pruned(14, 0.45)).all()
    assert W[kept].abs().min() >= W[~kept].abs().max() or per == "row"


def test_round_to_pattern_nm():
    W = torch.randn(6, 16, generator=torch.Generator().manual_seed(8))
    R = round_to_pattern(W, nm="2:4")
    assert is_valid_nm(R, 2, 4) and int((R != 0).sum()) == W.numel() // 2
    assert torch.equal(R, round_to_pattern(W, sparsity=0.9, nm=(2, 4)))
    with pytest.raises(ValueError, match="in_features=10"):
        round_to_pattern(W[:, :10], nm="2:4")


def _warm_start(W, X, sparsity=None, nm=None):
    """Wanda warm start: |W| * ||X_j|| per output row (or N:M)."""
    from optimum_prune.functional.masks import keep_mask

    scores = W.abs() * torch.linalg.norm(X, dim=1)[None, :]
    return W * keep_mask(scores, sparsity, nm, per="row")


@pytest.mark.parametrize("lambda_search", ["log", "paper"])
@pytest.mark.parametrize("momentum", ["standard", "paper"])
def test_fista_prune_unstructured(lambda_search, momentum):
    X, Xs, W, G, Gs, C = _problem(m=16, n=32, p=128, seed=9)
    W0 = _warm_start(W, X, sparsity=0.5)
    W_best, info = fista_prune(W, G, Gs, C, W0, sparsity=0.5, lambda_search=lambda_search, momentum=momentum, eps=1e-6)
    assert int((W_best == 0).sum()) >= num_pruned(W.numel(), 0.5)
    assert info["error_best"] == pytest.approx(reconstruction_error(W_best, W, G, Gs, C), rel=1e-9)
    assert info["error_init"] == pytest.approx(reconstruction_error(W0, W, G, Gs, C), rel=1e-9)
    assert info["error_best"] <= info["error_init"]
    assert len(info["lambdas"]) == len(info["errors_total"]) == info["outer_iterations"] >= 1
    assert info["lambdas"][0] == 1e-5
    lo, hi = info["lam_bracket"]
    assert lo == 0.0 and hi == (1e6 if lambda_search == "paper" else pytest.approx((W @ C).abs().max().item()))
    _check_bisection(info, lambda_search)


def _check_bisection(info, mode, xi=0.3):
    """Replays the λ updates from the recorded errors."""
    lo, hi = info["lam_bracket"]
    for step, lam in enumerate(info["lambdas"][:-1]):
        if info["errors_round"][step] / info["errors_total"][step] > xi:
            lo = lam
        else:
            hi = lam
        expected = (lo + hi) / 2 if mode == "paper" else math.sqrt(max(lo, 1e-12) * hi)
        assert info["lambdas"][step + 1] == pytest.approx(expected, rel=1e-12)


def _llm_like_problem(m=32, n=64, p=512, seed=10):
    """Correlated (low-rank + noise) activations with outlier channels, small weights, as in LLM layers."""
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 8, generator=gen) @ torch.randn(8, p, generator=gen) / 3 + 0.5 * torch.randn(
        n, p, generator=gen
    )
    X[[3, 17, 40]] *= 20.0
    Xs = X + 0.05 * X.std(dim=1, keepdim=True) * torch.randn(n, p, generator=gen)
    W = 0.02 * torch.randn(m, n, generator=gen)
    return X, Xs, W, X @ X.T / p, Xs @ Xs.T / p, X @ Xs.T / p


def test_fista_prune_beats_warm_start_and_hits_exact_sparsity():
    X, Xs, W, G, Gs, C = _llm_like_problem()
    W0 = _warm_start(W, X, sparsity=0.5)
    W_best, info = fista_prune(W, G, Gs, C, W0, sparsity=0.5)
    assert W_best.dtype == torch.float32
    assert info["error_best"] < 0.85 * info["error_init"]  # the convex refit clearly improves on Wanda
    assert int((W_best == 0).sum()) == num_pruned(W.numel(), 0.5)
    assert any(info["improved"]) and info["stop_reason"] in ("no_improvement", "converged")


def test_fista_prune_hands_every_rounded_iterate_to_on_iterate():
    """`on_iterate` sees the rounded warm start, then one rounded iterate per outer step (the errors in `info` are
    theirs), and the result is the best of them; following the iterates changes nothing."""
    X, Xs, W, G, Gs, C = _problem(m=8, n=32, p=128, seed=11)
    W0 = _warm_start(W, X, nm=(2, 4))
    seen = []
    W_best, info = fista_prune(W, G, Gs, C, W0, nm="2:4", on_iterate=lambda A: seen.append(A.clone()))
    plain, _ = fista_prune(W, G, Gs, C, W0, nm="2:4")
    assert torch.equal(W_best, plain) and len(seen) == 1 + info["outer_iterations"] > 1
    assert torch.equal(seen[0], round_to_pattern(W0, None, (2, 4)))
    errors = [reconstruction_error(A, W, G, Gs, C) for A in seen]
    assert errors[1:] == pytest.approx(info["errors_total"], rel=1e-9)
    assert torch.equal(seen[min(range(len(seen)), key=errors.__getitem__)], W_best)


def test_fista_prune_nm_and_stopping():
    X, Xs, W, G, Gs, C = _problem(m=8, n=32, p=128, seed=11)
    W0 = _warm_start(W, X, nm=(2, 4))
    W_best, info = fista_prune(W, G, Gs, C, W0, nm="2:4")
    assert is_valid_nm(W_best, 2, 4) and info["error_best"] <= info["error_init"]
    _, capped = fista_prune(W, G, Gs, C, W0, nm="2:4", max_outer=2, T=100, eps=0.0)
    assert capped["outer_iterations"] == 2 and capped["stop_reason"] == "max_outer"
    _, once = fista_prune(W, G, Gs, C, W, nm="2:4", T=1, eps=-1.0)  # dense warm start gets rounded first
    assert once["improved"][-1] is False and once["stop_reason"] == "no_improvement"
    assert sum(not ok for ok in once["improved"]) == 1
    with pytest.raises(ValueError, match="needs `sparsity`"):
        fista_prune(W, G, Gs, C, W0)
    with pytest.raises(ValueError, match="Gs must have shape"):
        fista_prune(W, G, Gs[:-1, :-1], C, W0, sparsity=0.5)


@pytest.mark.parametrize("momentum", ["standard", "paper", "none"])
def test_spectral_iterations_equal_direct_iterations_without_l1(momentum):
    X, Xs, W, G, Gs, C = _problem(m=6, n=24, p=80, seed=13)
    eig = spectral_gram(Gs)
    torch.testing.assert_close(eig.Q @ torch.diag(eig.d) @ eig.Q.T, Gs, rtol=1e-10, atol=1e-12)
    assert eig.L == pytest.approx(lipschitz_constant(Gs), rel=1e-12)
    W0 = round_to_pattern(W, 0.5)
    for K in (1, 3, 25):
        direct, it_d = fista_inner(W0, W @ C, Gs, 0.0, eig.L, K=K, tol=0.0, momentum=momentum)
        Z, it_s = fista_inner_spectral(W0 @ eig.Q, W @ C @ eig.Q, eig.d, eig.L, K=K, tol=0.0, momentum=momentum)
        torch.testing.assert_close(Z @ eig.Q.T, direct, rtol=1e-10, atol=1e-12)
        assert it_d == it_s == K
    # the early stop sees the same step norms (rotation invariant)
    _, it_d = fista_inner(W0, W @ C, Gs, 0.0, eig.L, K=500, tol=1e-7, momentum=momentum)
    _, it_s = fista_inner_spectral(W0 @ eig.Q, W @ C @ eig.Q, eig.d, eig.L, K=500, tol=1e-7, momentum=momentum)
    assert it_d == it_s


def test_prox_is_negligible_bound():
    assert prox_is_negligible(0.0, 1.0, 20, 1e-6, 10**6)
    assert prox_is_negligible(1e-12, 1.0, 20, 1e-6, 10**6)  # 400 * 1e-12 * 1000 = 4e-7
    assert not prox_is_negligible(1e-11, 1.0, 20, 1e-6, 10**6)  # 4e-6 > tol
    assert not prox_is_negligible(0.0, 1.0, 20, 0.0, 10**6)  # tol = 0: never
    # the bound holds: with λ at the limit, a whole call moves the iterate by less than tol
    X, Xs, W, G, Gs, C = _problem(m=6, n=24, p=80, seed=14)
    L, K, tol = lipschitz_constant(Gs), 20, 1e-6
    lam = tol * L / (K * K * math.sqrt(W.numel()))
    assert prox_is_negligible(lam, L, K, tol, W.numel())
    W0 = round_to_pattern(W, 0.5)
    with_l1, _ = fista_inner(W0, W @ C, Gs, lam, L, K=K, tol=0.0)
    without, _ = fista_inner(W0, W @ C, Gs, 0.0, L, K=K, tol=0.0)
    assert torch.linalg.vector_norm(with_l1 - without) <= tol


@pytest.mark.parametrize("pattern", [{"sparsity": 0.5}, {"nm": "2:4"}])
def test_fista_prune_spectral_matches_direct(pattern):
    X, Xs, W, G, Gs, C = (t.double() for t in _llm_like_problem(seed=15))
    W0 = _warm_start(W, X, sparsity=0.5) if "sparsity" in pattern else _warm_start(W, X, nm=(2, 4))
    fast, info_fast = fista_prune(W, G, Gs, C, W0, **pattern, max_outer=60)
    slow, info_slow = fista_prune(W, G, Gs, C, W0, **pattern, max_outer=60, spectral=False)
    assert sum(info_fast["spectral"]) > 0 and not any(info_slow["spectral"])
    assert info_fast["outer_iterations"] == info_slow["outer_iterations"]
    assert info_fast["improved"] == info_slow["improved"]
    # the two bases differ by at most FISTA's tolerance (1e-6 in W) per outer step
    for key in ("errors_total", "errors_round", "lambdas"):
        assert info_fast[key] == pytest.approx(info_slow[key], rel=1e-6, abs=1e-10)
    assert float(torch.linalg.vector_norm(fast - slow)) < 1e-5
    assert torch.equal(fast == 0, slow == 0)
    assert info_fast["error_best"] == pytest.approx(reconstruction_error(fast, W, G, Gs, C), rel=1e-9)


def _elementwise_spectral(Z0, B, d, L, K, tol, momentum):
    """The spectral iterations written out elementwise (the previous implementation): `Z -> Z ∘ (1 − d/L) + B/L`."""
    from optimum_prune.methods.fista.solver import _accelerated

    decay, shift = (1.0 - d / L).to(Z0.dtype), B / L
    return _accelerated(lambda y: torch.addcmul(shift, y, decay), Z0, K, tol, momentum)


@pytest.mark.parametrize("momentum", ["standard", "paper", "none"])
def test_closed_form_spectral_iterations_equal_the_elementwise_recurrence(momentum):
    X, Xs, W, G, Gs, C = _problem(m=7, n=32, p=20, seed=17)  # p < n: zero eigenvalues (decay 1)
    eig = spectral_gram(Gs)
    assert int((eig.d < 1e-12 * eig.L).sum()) > 0
    Z0, B = round_to_pattern(W, nm="2:4") @ eig.Q, W @ C @ eig.Q
    stopped_early = []
    for K, tol in ((1, 0.0), (4, 0.0), (40, 0.0), (3000, 1e-3), (3000, 1e-5)):
        fast, it_fast = fista_inner_spectral(Z0, B, eig.d, eig.L, K=K, tol=tol, momentum=momentum)
        slow, it_slow = _elementwise_spectral(Z0, B, eig.d, eig.L, K, tol, momentum)
        assert it_fast == it_slow
        torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)
        stopped_early.append(it_fast < K)
    assert any(stopped_early)


def test_ridge_pulls_towards_the_dense_weights():
    X, Xs, W, G, Gs, C = _problem(m=5, n=12, p=40, seed=18)
    n, p, ridge = X.shape[0], X.shape[1], 0.2
    delta = ridge * Gs.diagonal().mean().item()
    eye = torch.eye(n, dtype=torch.float64)
    Xa, Xsa = torch.cat([X, math.sqrt(delta * p) * eye], 1), torch.cat([Xs, math.sqrt(delta * p) * eye], 1)
    # the lasso with the ridge term (coordinate descent on the augmented explicit data) == FISTA on Grams + δI
    lam = 0.3 * (W @ C).abs().max().item()
    ref = lasso_cd(Xsa, W @ Xa, lam * p)
    Gs_r, C_r = Gs + delta * eye, C + delta * eye
    got, _ = fista_inner(torch.zeros_like(W), W @ C_r, Gs_r, lam, lipschitz_constant(Gs_r), K=5000, tol=1e-13)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-8)
    # fista_prune(ridge) == the paper's fista_prune on the augmented data, and its error includes the ridge term
    X, Xs, W = (t.double() for t in _llm_like_problem(seed=15)[:3])  # has spectral steps
    n, p, ridge = X.shape[0], X.shape[1], 1e-3
    G, Gs, C = X @ X.T / p, Xs @ Xs.T / p, X @ Xs.T / p
    delta = ridge * Gs.diagonal().mean().item()
    eye = torch.eye(n, dtype=torch.float64)
    Xa, Xsa = torch.cat([X, math.sqrt(delta * p) * eye], 1), torch.cat([Xs, math.sqrt(delta * p) * eye], 1)
    W0 = _warm_start(W, X, nm=(2, 4))
    a, info_a = fista_prune(W, G, Gs, C, W0, nm="2:4", ridge=ridge, max_outer=60)
    b, info_b = fista_prune(W, Xa @ Xa.T / p, Xsa @ Xsa.T / p, Xa @ Xsa.T / p, W0, nm="2:4", max_outer=60)
    # (equal up to FISTA's tolerance: the spectral steps use the eigendecomposition of Gs shifted by δ)
    assert float(torch.linalg.vector_norm(a - b)) < 1e-5 and torch.equal(a == 0, b == 0)
    assert info_a["errors_total"] == pytest.approx(info_b["errors_total"], rel=1e-9)
    assert info_a["ridge_delta"] == pytest.approx(delta) and sum(info_a["spectral"]) > 0
    explicit = torch.linalg.norm(a @ Xs - W @ X) ** 2 / p + delta * torch.linalg.norm(a - W) ** 2
    assert info_a["error_best"] == pytest.approx(math.sqrt(explicit), rel=1e-9)
    # a lazily computed (or precomputed) eigendecomposition of the undamped Gs is shifted by δ
    c, _ = fista_prune(W, G, Gs, C, W0, nm="2:4", ridge=ridge, max_outer=60, eig=lambda: spectral_gram(Gs))
    torch.testing.assert_close(c, a, rtol=1e-10, atol=1e-12)
    # closer to the dense weights on the kept entries than without the ridge
    plain, _ = fista_prune(W, G, Gs, C, W0, nm="2:4", max_outer=60)
    assert torch.linalg.norm((a - W)[a != 0]) < torch.linalg.norm((plain - W)[plain != 0])
    with pytest.raises(ValueError, match="ridge"):
        fista_prune(W, G, Gs, C, W0, nm="2:4", ridge=-1.0)


@pytest.mark.parametrize("ridge", [0.0, 1e-3])
def test_dense_outputs_replace_the_dense_grams(ridge):
    # G enters only as tr(W G Wᵀ) = ||W X||² / p and C only as W C = (W X) X*ᵀ / p: passing those (from the dense
    # outputs W X) instead gives the same run
    X, Xs, W = (t.double() for t in _llm_like_problem(seed=15)[:3])
    p = X.shape[1]
    G, Gs, C = X @ X.T / p, Xs @ Xs.T / p, X @ Xs.T / p
    W0 = _warm_start(W, X, nm=(2, 4))
    a, info_a = fista_prune(W, G, Gs, C, W0, nm="2:4", ridge=ridge, max_outer=30)
    assert info_a["outer_iterations"] > 3
    Y = W @ X  # (m, p) dense outputs
    energy, WC = float(Y.square().sum()) / p, Y @ Xs.T / p
    b, info_b = fista_prune(W, None, Gs, C, W0, nm="2:4", ridge=ridge, max_outer=30, dense_energy=energy)
    c, info_c = fista_prune(W, None, Gs, None, W0, nm="2:4", ridge=ridge, max_outer=30, dense_energy=energy, WC=WC)
    for got, info in ((b, info_b), (c, info_c)):
        torch.testing.assert_close(got, a, rtol=1e-10, atol=1e-12)
        assert info["errors_total"] == pytest.approx(info_a["errors_total"], rel=1e-9)
    with pytest.raises(ValueError, match="exactly one of `C` and `WC`"):
        fista_prune(W, G, Gs, C, W0, nm="2:4", WC=WC)
    with pytest.raises(ValueError, match="WC must have the shape of W"):
        fista_prune(W, G, Gs, None, W0, nm="2:4", WC=WC.T)
    _, info_wrong = fista_prune(W, None, Gs, C, W0, nm="2:4", max_outer=30, dense_energy=2 * energy)
    assert info_wrong["error_init"] > 1.1 * info_a["error_init"]  # the constant does enter the error
    for g, e in ((G, energy), (None, None)):
        with pytest.raises(ValueError, match="exactly one of `G` and `dense_energy`"):
            fista_prune(W, g, Gs, C, W0, nm="2:4", dense_energy=e)


def test_rounding_by_wanda_score():
    # Eq. 8 ranks |W*_ij|; with a scale it ranks |W*_ij| s_j (s_j = ||X*_j||: the output error of each entry alone)
    W = torch.tensor([[1.0, 0.5, -0.1, 0.2], [0.3, -2.0, 0.4, 0.1]])
    s = torch.tensor([0.01, 1.0, 1.0, 1.0])
    magnitude = round_to_pattern(W, nm="2:4")
    assert torch.equal(magnitude, torch.tensor([[1.0, 0.5, 0.0, 0.0], [0.0, -2.0, 0.4, 0.0]]))
    wanda = round_to_pattern(W, nm="2:4", scale=s)
    assert torch.equal(wanda, torch.tensor([[0.0, 0.5, 0.0, 0.2], [0.0, -2.0, 0.4, 0.0]]))
    # unstructured, per matrix: the 4 largest |w| s among 8
    keep = (W.abs() * s).flatten().argsort(descending=True)[:4]
    expected = torch.zeros(8).index_put_((keep,), W.flatten()[keep]).reshape(2, 4)
    assert torch.equal(round_to_pattern(W, sparsity=0.5, scale=s), expected)
    # inside fista_prune: every rounded iterate, so the result keeps the pattern and beats its rounded warm start
    X, Xs, Wd = (t.double() for t in _llm_like_problem(seed=15)[:3])
    p = X.shape[1]
    G, Gs, C = X @ X.T / p, Xs @ Xs.T / p, X @ Xs.T / p
    scale = Gs.diagonal().sqrt()
    W0 = _warm_start(Wd, X, nm=(2, 4))
    got, info = fista_prune(Wd, G, Gs, C, W0, nm="2:4", max_outer=30, rounding_scale=scale)
    plain, _ = fista_prune(Wd, G, Gs, C, W0, nm="2:4", max_outer=30)
    assert (got.reshape(-1, 4) != 0).sum(1).eq(2).all()
    assert info["error_best"] < info["error_init"] and not torch.equal(got != 0, plain != 0)


@pytest.mark.parametrize("strength", [0.0, 0.3, 1.0])
def test_shrink_refit_against_a_direct_float64_formula(strength):
    gen = torch.Generator().manual_seed(3)
    W = torch.randn(6, 8, generator=gen)
    W_fit = round_to_pattern(W + 0.5 * torch.randn(6, 8, generator=gen), nm="2:4")
    got = shrink_refit(W, W_fit, strength)
    expected = torch.zeros(6, 8, dtype=torch.float64)
    for i in range(6):
        for j in range(8):
            if W_fit[i, j] != 0:
                expected[i, j] = (1 - strength) * W[i, j].double() + strength * W_fit[i, j].double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(got != 0, W_fit != 0)  # the pattern is kept
    if strength == 1.0:
        assert torch.equal(got, W_fit)
    if strength == 0.0:
        assert torch.equal(got, W * (W_fit != 0))
