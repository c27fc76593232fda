"""AMP's equilibrium solver and refit (`methods/amp/equilibrium.py`) against float64 references: Gauss-Newton
products = JᵀJv of the exact Jacobian, CG = the direct solve of `(H + λ)δ = −λ1`, curvature scales = trace and top
eigenvalue of H; the refit keeps pruned entries at zero and lowers the attention error; a q/k weight that never
affects the attention pattern is pruned first."""

import copy

import torch
from testing_utils import tiny_model

from optimum_prune import AutoPruner, WandaConfig
from optimum_prune.methods.amp.config import AMPConfig
from optimum_prune.methods.amp.equilibrium import MaskObjective, curvature_scales, equilibrium_masks, refit_kept
from optimum_prune.methods.amp.functional import AttentionInputs, DataTerm, attention_probs, relative_attention_error

D = torch.float64


def _layer(seed=0, n=7, b=2, d=8, heads=2, kv=1, hd=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, d, generator=g, dtype=D)
    Wq = torch.randn(heads * hd, d, generator=g, dtype=D) * 0.7
    Wk = torch.randn(kv * hd, d, generator=g, dtype=D) * 0.7
    inp = AttentionInputs(xs=[x], rope=[None], num_heads=heads, num_kv_heads=kv, head_dim=hd, scaling=hd**-0.5,
                          block_size=4)  # fmt: skip
    return inp, Wq, Wk


def _objective(inp, Wq, Wk):
    return MaskObjective(DataTerm(inp, Wq, Wk, None, None, 256.0, True, True, False), Wq, Wk)


def _exact_gauss_newton(inp, Wq, Wk):
    """`JᵀJ / k` of the attention probabilities w.r.t. the stacked masks at M = 1 (autograd Jacobian, float64)."""
    nq = Wq.numel()

    def probs(m):
        ps = attention_probs(inp, 0, Wq * m[:nq].view_as(Wq), Wk * m[nq:].view_as(Wk))
        return torch.cat([p.reshape(-1) for p in ps])

    J = torch.autograd.functional.jacobian(probs, torch.ones(nq + Wk.numel(), dtype=D))
    return J.T @ J / inp.num_samples


def _flat(pair):
    return torch.cat([t.reshape(-1) for t in pair])


def test_gauss_newton_product_and_curvature_scales_match_the_exact_matrix():
    inp, Wq, Wk = _layer()
    obj = _objective(inp, Wq, Wk)
    H = _exact_gauss_newton(inp, Wq, Wk)
    g = torch.Generator().manual_seed(1)
    v = [torch.randn(Wq.shape, generator=g, dtype=D), torch.randn(Wk.shape, generator=g, dtype=D)]
    torch.testing.assert_close(_flat(obj.gauss_newton(v)), H @ _flat(v), rtol=1e-3, atol=1e-3 * float(H.abs().max()))
    mean, top, diag = curvature_scales(obj, probes=400, power_steps=60)
    assert abs(mean - float(H.trace()) / H.shape[0]) < 0.15 * float(H.trace()) / H.shape[0]
    assert abs(top - float(torch.linalg.eigvalsh(H)[-1])) < 0.02 * float(torch.linalg.eigvalsh(H)[-1])
    scale = float(H.diagonal().abs().max())
    torch.testing.assert_close(_flat(diag), H.diagonal().clamp(min=0), rtol=0, atol=0.25 * scale)


def test_cg_equilibrium_equals_the_direct_solve():
    """With as many CG steps as unknowns, the masks are the exact minimiser of the quadratic model of
    `D(M) + ½λ‖M‖²` at M = 1: `M = 1 − λ(H + λ)⁻¹1`."""
    inp, Wq, Wk = _layer(seed=2)
    obj = _objective(inp, Wq, Wk)
    H = _exact_gauss_newton(inp, Wq, Wk)
    lam = 0.05 * float(H.trace()) / H.shape[0]
    want = 1 - lam * torch.linalg.solve(H + lam * torch.eye(H.shape[0], dtype=D), torch.ones(H.shape[0], dtype=D))
    for diagonal in (None, curvature_scales(obj, probes=64, power_steps=0)[2]):  # plain and preconditioned CG
        M, info = equilibrium_masks(obj, lam, steps=H.shape[0], diagonal=diagonal, progress=False)
        torch.testing.assert_close(_flat(M), want, rtol=0, atol=2e-3)
        assert info["residuals"][-1] < 1e-2
    assert float(want.std()) > 0.05  # the entries differ: the test can tell a wrong solve from a uniform shrink


def test_refit_keeps_pruned_entries_at_zero_and_lowers_the_attention_error():
    inp, Wq, Wk = _layer(seed=3)
    obj = _objective(inp, Wq, Wk)
    keep = [(torch.rand(W.shape, generator=torch.Generator().manual_seed(i)) > 0.5) for i, W in enumerate((Wq, Wk))]
    _, top, _ = curvature_scales(obj, probes=0, power_steps=20)
    M, info = refit_kept(obj, keep, 1.5 / top, steps=60, progress=False)
    for m, k in zip(M, keep):
        assert (m[~k] == 0).all()
    assert info["loss_final"] < 0.7 * info["loss_initial"]
    assert obj.grad(M)[0] == info["loss_final"]


def test_a_qk_weight_that_never_affects_attention_is_pruned_first():
    """Planted: the keys of KV group 0 are zero, so the queries of its heads never change the attention pattern
    (every score is 0); those q rows get 4x larger weights, so Wanda's |W|·‖X‖ keeps most of them. AMP's
    equilibrium masks send them to ~0: ranked over the matrix, every one of them is pruned. Plain (unpreconditioned)
    CG leaves them near the others' masks and fails this, as does Wanda."""
    model = tiny_model("llama_gqa").double()
    attn = model.model.layers[0].self_attn
    cfg = model.config
    hd, group = attn.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    planted = slice(0, group * hd)  # q rows of the heads that read KV group 0
    with torch.no_grad():
        attn.k_proj.weight[:hd] = 0
        attn.q_proj.weight[planted] *= 4
    sparsity = (group * hd) / attn.q_proj.weight.shape[0] + 0.2
    ids = torch.randint(0, cfg.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    pruned = {}
    for name, config in {
        "amp": AMPConfig(sparsity=sparsity, targets=["q_proj"], per="matrix", refit_steps=0),
        "plain_cg": AMPConfig(sparsity=sparsity, targets=["q_proj"], per="matrix", refit_steps=0, precondition=False),
        "wanda": WandaConfig(sparsity=sparsity, targets=["q_proj"], per="matrix"),
    }.items():
        m = copy.deepcopy(model)
        AutoPruner(m).prune(config, calibration=ids)
        pruned[name] = float((m.model.layers[0].self_attn.q_proj.weight[planted] == 0).double().mean())
    assert pruned["amp"] == 1.0
    assert pruned["plain_cg"] < 0.9 and pruned["wanda"] < 0.5


def test_data_term_against_other_inputs_matches_a_float64_reference():
    """`DataTerm(target=...)`: the dense attention on other inputs (the dense model's) is the target; value and
    gradients equal autograd of `(1/k) Σ ½‖f̃(X, W∘M) − f(X_t, W)‖²`, on the by-hand and the autograd paths."""
    inp, Wq, Wk = _layer(seed=4)
    tgt = _layer(seed=5)[0]  # other inputs of the same shape
    g = torch.Generator().manual_seed(6)
    Mq, Mk = (1 + 0.3 * torch.randn(W.shape, generator=g, dtype=D) for W in (Wq, Wk))
    Wq_m, Wk_m = (Wq * Mq).requires_grad_(), (Wk * Mk).requires_grad_()
    f = attention_probs(tgt, 0, Wq, Wk)
    loss = sum(0.5 * (a - b).pow(2).sum() for a, b in zip(attention_probs(inp, 0, Wq_m, Wk_m), f)) / inp.num_samples
    loss.backward()
    for fast in (True, False):
        data = DataTerm(inp, Wq, Wk, None, None, 256.0, True, fast, False, target=tgt)
        value, gq, gk = data((Wq * Mq).detach(), (Wk * Mk).detach())
        assert abs(value - loss.item()) < 1e-10 * loss.item()
        torch.testing.assert_close(gq, Wq_m.grad, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(gk, Wk_m.grad, rtol=1e-8, atol=1e-10)
    assert DataTerm(inp, Wq, Wk, None, None, 256.0, True, True, False, target=inp)(Wq, Wk)[0] == 0.0
    assert relative_attention_error(inp, Wq, Wk, Wq, Wk) == 0.0
    assert relative_attention_error(inp, Wq, Wk, Wq, Wk, target=tgt) > 0.01  # the inputs' drift alone
