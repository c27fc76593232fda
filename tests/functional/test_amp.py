"""AMP math against float64 references: the paper's closed-form gradients (Theorem D.5) = autograd = finite
differences; the library's attention = the real attention module of every architecture; one descent step = the
closed form; the synthetic experiment of §C.3."""

import pytest
import torch
from testing_utils import ARCHS, VISION_ARCHS, model_inputs, tiny_model

from optimum_prune.functional.masks import keep_mask
from optimum_prune.functional.scores import wanda_scores
from optimum_prune.functional.sparsegpt import sparsegpt_prune
from optimum_prune.methods.amp.blocked import causal_blocks
from optimum_prune.methods.amp.config import AMPConfig
from optimum_prune.methods.amp.functional import (
    AttentionInputs,
    DataTerm,
    amp_masks,
    attention_probs,
    binarize,
    fused_amp_masks,
    fused_mask_gradient,
    rope_adjoint_is_negated_sin,
    separate_mask_gradients,
    softmax_causal,
)
from optimum_prune.methods.amp.pruner import AMPPruner
from optimum_prune.modeling.access import qk_weights
from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view

D = torch.float64


def _data(d=6, n=5, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    Xs = [torch.randn(n, d, generator=g, dtype=D) for _ in range(k)]
    return g, Xs


def _loss_fused(M, W, Xs, lam):
    out = 0.5 * lam * M.pow(2).sum()
    for X in Xs:
        out = out + 0.5 * (softmax_causal(X @ (M * W) @ X.T) - softmax_causal(X @ W @ X.T)).pow(2).sum()
    return out


def _loss_separate(MQ, MK, WQ, WK, Xs, lam):
    out = 0.5 * lam * (MQ.pow(2).sum() + MK.pow(2).sum())
    for X in Xs:
        f = softmax_causal(X @ WQ @ WK.T @ X.T)
        out = out + 0.5 * (softmax_causal(X @ (MQ * WQ) @ (MK * WK).T @ X.T) - f).pow(2).sum()
    return out


def _fd(fn, M, eps=1e-6):
    G = torch.zeros_like(M)
    for idx in torch.cartesian_prod(*(torch.arange(s) for s in M.shape)):
        idx = tuple(idx.tolist())
        P, N = M.clone(), M.clone()
        P[idx] += eps
        N[idx] -= eps
        G[idx] = (fn(P) - fn(N)) / (2 * eps)
    return G


def test_fused_gradient_closed_form_equals_autograd_and_finite_differences():
    g, Xs = _data()
    W = torch.randn(6, 6, generator=g, dtype=D)
    M = (1 + 0.3 * torch.randn(6, 6, generator=g, dtype=D)).requires_grad_()
    lam = 0.1
    (auto,) = torch.autograd.grad(_loss_fused(M, W, Xs, lam), M)
    closed = fused_mask_gradient(M.detach(), W, Xs, lam)
    fd = _fd(lambda m: float(_loss_fused(m, W, Xs, lam)), M.detach())
    torch.testing.assert_close(closed, auto, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(fd, auto, rtol=1e-5, atol=1e-7)
    # Algorithm 1's printed gradient (p1 = c∘f, dense f) is not the gradient (docs/methods/amp.md)
    literal = fused_mask_gradient(M.detach(), W, Xs, lam, dense_in_p1=True)
    assert not torch.allclose(literal, auto, rtol=1e-3, atol=1e-6)


def test_separate_mask_gradients_equal_autograd_and_finite_differences():
    g, Xs = _data(d=6, n=5)
    WQ, WK = torch.randn(6, 4, generator=g, dtype=D), torch.randn(6, 4, generator=g, dtype=D)  # d x d' (paper)
    MQ = (1 + 0.3 * torch.randn(6, 4, generator=g, dtype=D)).requires_grad_()
    MK = (1 + 0.3 * torch.randn(6, 4, generator=g, dtype=D)).requires_grad_()
    lam = 0.05
    aq, ak = torch.autograd.grad(_loss_separate(MQ, MK, WQ, WK, Xs, lam), (MQ, MK))
    cq, ck = separate_mask_gradients(MQ.detach(), MK.detach(), WQ, WK, Xs, lam)
    torch.testing.assert_close(cq, aq, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(ck, ak, rtol=1e-9, atol=1e-11)
    fq = _fd(lambda m: float(_loss_separate(m, MK.detach(), WQ, WK, Xs, lam)), MQ.detach())
    fk = _fd(lambda m: float(_loss_separate(MQ.detach(), m, WQ, WK, Xs, lam)), MK.detach())
    torch.testing.assert_close(fq, aq, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(fk, ak, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("gradient", ["exact", "algorithm1"])
@pytest.mark.parametrize("regularizer", ["unscaled", "divided_by_k"])
def test_descent_step_is_the_closed_form_update(gradient, regularizer):
    """`amp_masks` on a one-head, unscaled, RoPE-free attention (the paper's setting) takes exactly the step
    `M ← M − η(∇)` of the separate-mask closed form (momentum 0), for both readings of §C.7.1 and §C.7.4."""
    g, Xs = _data(d=6, n=7, k=4)
    WQ, WK = torch.randn(6, 6, generator=g, dtype=D), torch.randn(6, 6, generator=g, dtype=D)  # paper layout
    inp = AttentionInputs(xs=[torch.stack(Xs)], rope=[None], num_heads=1, num_kv_heads=1, head_dim=6, scaling=1.0,
                          block_size=3)  # fmt: skip
    lam, lr, k = 0.05, 0.3, len(Xs)
    Mq, Mk, _ = amp_masks(inp, WQ.T, WK.T, lambda_=lam, lr=lr, steps=2, momentum=0.0, gradient=gradient,
                          regularizer=regularizer, progress=False)  # fmt: skip
    MQ, MK = torch.ones(6, 6, dtype=D), torch.ones(6, 6, dtype=D)
    reg = lam if regularizer == "unscaled" else lam / k
    for _ in range(2):
        if gradient == "exact":
            gq, gk = separate_mask_gradients(MQ, MK, WQ, WK, Xs, 0.0)
        else:  # p1 = c∘f with the dense f, through autograd of the printed expression
            gq, gk = _alg1_grads(MQ, MK, WQ, WK, Xs)
        MQ, MK = MQ - lr * (gq / k + reg * MQ), MK - lr * (gk / k + reg * MK)
    torch.testing.assert_close(Mq.T, MQ, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(Mk.T, MK, rtol=1e-10, atol=1e-12)


def _alg1_grads(MQ, MK, WQ, WK, Xs):
    gq, gk = torch.zeros_like(MQ), torch.zeros_like(MK)
    Qm, Km = MQ * WQ, MK * WK
    for X in Xs:
        f = softmax_causal(X @ WQ @ WK.T @ X.T)
        ft = softmax_causal(X @ Qm @ Km.T @ X.T)
        p1 = (ft - f) * f
        p = p1 - p1.sum(-1, keepdim=True) * ft
        gq += X.T @ p @ X @ Km
        gk += X.T @ p.T @ X @ Qm
    return WQ * gq, WK * gk


@pytest.mark.parametrize("arch", ARCHS + VISION_ARCHS)
def test_attention_probs_equal_the_real_attention_module(arch):
    """GQA, RoPE after the projections, q/k norms and biases, scaling, causal mask and sliding window (Gemma 3),
    GPT-2's fused c_attn slices, non-causal vision attention (ViT, Dinov2: 17 tokens): the recomputed probabilities
    equal the module's own eager attention weights."""
    model = tiny_model(arch)
    spec = get_spec(model)
    inputs = model_inputs(arch, 2, 16)
    n = 17 if "pixel_values" in inputs else 16  # 16 patches + CLS
    attns = model(**inputs, output_attentions=True).attentions
    pruner = AMPPruner(AMPConfig())
    for i, layer in enumerate(get_layers(model, spec)):
        view = layer_view(layer, i, spec, model.config)
        seen = []

        def hook(_m, args, kwargs, seen=seen):
            pe = kwargs.get("position_embeddings")
            seen.append(((args[0] if args else kwargs["hidden_states"]).detach(), pe))

        h = view.attn.register_forward_pre_hook(hook, with_kwargs=True)
        model(**inputs)
        h.remove()
        inp = AttentionInputs.from_module(view.attn, [seen[0][0]], [seen[0][1]], view.num_heads, view.num_kv_heads,
                                          view.head_dim)  # fmt: skip
        inp.block_size = 5  # several query blocks, one of them ragged
        Wq, bq, Wk, bk = qk_weights(view)
        assert inp.causal == (n == 16)
        p = causal_blocks(inp, n).assemble(attention_probs(inp, 0, Wq, Wk, bq, bk), n)
        torch.testing.assert_close(p.reshape(2, view.num_heads, n, n), attns[i], rtol=1e-5, atol=1e-6)
    assert pruner.config.targets == ("q_proj", "k_proj")


def test_soft_capping_and_sliding_window_match_a_direct_computation():
    """`attention_probs` with logit soft-capping and a sliding window (Gemma 2/3 style) equals the direct formula
    `softmax(cap·tanh(s·q·kᵀ/cap) + mask)`; the descent takes the autograd path there."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 8, generator=g, dtype=D)
    Wq, Wk = torch.randn(8, 8, generator=g, dtype=D), torch.randn(4, 8, generator=g, dtype=D)
    inp = AttentionInputs(xs=[x], rope=[None], num_heads=2, num_kv_heads=1, head_dim=4, scaling=0.5, softcap=3.0,
                          sliding_window=4, block_size=4)  # fmt: skip
    got = causal_blocks(inp, 9).assemble(attention_probs(inp, 0, Wq, Wk), 9)[:, 0]  # (b, heads, n, n)
    q, k = (x @ Wq.T).view(2, 9, 2, 4).transpose(1, 2), (x @ Wk.T).unsqueeze(1)
    s = 3.0 * torch.tanh(0.5 * q @ k.transpose(-1, -2) / 3.0)
    i, j = torch.arange(9).unsqueeze(1), torch.arange(9).unsqueeze(0)
    want = torch.softmax(s.masked_fill(~((j <= i) & (i - j < 4)), float("-inf")), -1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    Mq, _, _ = amp_masks(inp, Wq, Wk, steps=3, lr=1.0, progress=False)
    assert torch.isfinite(Mq).all() and Mq.std() > 1e-4  # the data term moved the masks apart (not a uniform shrink)


def _synthetic(d=64, n=128, k=16, seed=0):
    """The paper's §6.1 setting: rank-4 W_Q, W_K (top-4 SVD of N(0,1) d×d matrices), W = W_Q W_Kᵀ, k Gaussian X
    (n × d). X is scaled by 1/√d so that the logits are O(1) (unscaled, the softmax of X W Xᵀ is one-hot and every
    method's error is ~1; `benchmarks/amp_synthetic.py` measures the other scales)."""
    g = torch.Generator().manual_seed(seed)

    def rank4():
        U, S, Vh = torch.linalg.svd(torch.randn(d, d, generator=g, dtype=D))
        return U[:, :4] @ torch.diag(S[:4]) @ Vh[:4]

    WQ, WK = rank4(), rank4()
    Xs = [torch.randn(n, d, generator=g, dtype=D) / d**0.5 for _ in range(k)]
    return WQ, WK, Xs


def _rel(W, W_new, Xs):
    num = den = 0.0
    for X in Xs:
        f = softmax_causal(X @ W @ X.T)
        num += float((softmax_causal(X @ W_new @ X.T) - f).pow(2).sum())
        den += float(f.pow(2).sum())
    return num / den


def _linear_baselines(W, Xs, rho):
    """Wanda and SparseGPT on `X ↦ X W` as a linear layer (PyTorch layout: weight `Wᵀ`, input X)."""
    X = torch.cat(Xs)
    wanda = W.T * keep_mask(wanda_scores(W.T, X.pow(2).sum(0)), rho, None, per="row")
    sgpt = sparsegpt_prune(W.T.contiguous(), X.T @ X / X.shape[0], rho)[0]
    return wanda.T, sgpt.T


def test_synthetic_experiment_amp_descends_and_ranks_by_mask_value():
    """The fused-form descent (paper settings of §C.3: λ_ctrl = 0.04, η = 0.1/λ_ctrl, 100 steps, momentum 0.9)
    lowers the attention loss of its soft mask below that of a uniform shrink, and its binarisation keeps
    exactly the largest mask values."""
    WQ, WK, Xs = _synthetic(k=4)
    W = WQ @ WK.T
    M = fused_amp_masks(W, Xs, lambda_=0.04, lr=2.5, steps=100)
    keep = binarize(M, W, 0.5)
    assert keep.sum() == W.numel() // 2 and M[keep].min() >= M[~keep].max()
    uniform = torch.full_like(M, float(M.mean()))
    assert _rel(W, M * W, Xs) < _rel(W, uniform * W, Xs)


def test_synthetic_experiment_amp_beats_wanda_and_sparsegpt():
    """The paper's §6.1 / Figure 2 (d = 64, n = 128, k = 16, rank-4 W, ρ = 0.5) as the paper runs it: Algorithm 1
    literally (`M ← M − (η/k)(Σ_j W∘X_jᵀp_jX_j + λM)`, λ = 0.04, η = 0.1/λ, 100 steps, momentum 0.9), binarised by
    mask value, on the fused W; Wanda and SparseGPT prune W_Q and W_K separately (paper §6.1, "we do not prune the
    fused weight matrix W directly"). AMP's relative attention error is below both (measured 0.046 vs 0.164 / 0.127).
    It does not carry over to the separate-mask form that real models need, nor beat SparseGPT applied to W itself
    (0.035): see benchmarks/results/amp_synthetic.md."""
    WQ, WK, Xs = _synthetic()
    W = WQ @ WK.T
    M = fused_amp_masks(W, Xs, lambda_=0.04, lr=2.5, steps=100, regularizer="divided_by_k")
    amp = _rel(W, W * binarize(M, W, 0.5), Xs)
    (wq, sq), (wk, sk) = _linear_baselines(WQ, Xs, 0.5), _linear_baselines(WK, Xs, 0.5)
    wanda, sgpt = _rel(W, wq @ wk.T, Xs), _rel(W, sq @ sk.T, Xs)
    assert amp < wanda and amp < sgpt, (amp, wanda, sgpt)


@pytest.mark.parametrize("arch", ARCHS + VISION_ARCHS)
def test_fused_backward_gives_the_autograd_iterates(arch):
    """The closed-form softmax/loss backward over causal query blocks (the fast path) and plain autograd give the
    same masks after several steps, for both gradient readings (float64)."""
    model = tiny_model(arch).double()
    spec = get_spec(model)
    view = layer_view(get_layers(model, spec)[1], 1, spec, model.config)
    xs, rope = [], []

    def hook(_m, args, kwargs):
        xs.append((args[0] if args else kwargs["hidden_states"]).detach())
        rope.append(kwargs.get("position_embeddings"))

    h = view.attn.register_forward_pre_hook(hook, with_kwargs=True)
    model(
        **{
            k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in model_inputs(arch, 3, 16).items()
        }
    )
    h.remove()
    inp = AttentionInputs.from_module(view.attn, xs, rope, view.num_heads, view.num_kv_heads, view.head_dim)
    inp.block_size = 6
    Wq, bq, Wk, bk = qk_weights(view)
    for gradient in ("exact", "algorithm1"):
        fast, slow = (
            amp_masks(inp, Wq, Wk, bq, bk, steps=3, lr=50.0, gradient=gradient, fused_backward=fb, progress=False)
            for fb in (True, False)
        )
        assert (fast[0] - 1).abs().max() > 0.1  # the masks moved
        torch.testing.assert_close(fast[0], slow[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(fast[1], slow[1], rtol=1e-10, atol=1e-10)


def test_rope_adjoint_probe_decides_the_backward_by_hand():
    """The fast path takes the gradient back through RoPE by hand (RoPE by −sin) only where that is RoPE's adjoint:
    the rotate-half RoPE with equal cos/sin halves, not one whose sin halves differ (there the hand-made backward
    would be wrong); either way the iterates are autograd's."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    n, hd = 12, 8
    angles = torch.arange(n, dtype=D)[:, None] * torch.rand(hd // 2, generator=g, dtype=D)
    emb = torch.cat([angles, angles], -1)[None]
    xs = [torch.randn(2, n, 16, generator=g, dtype=D)]
    Wq, Wk = torch.randn(16, 16, generator=g, dtype=D), torch.randn(8, 16, generator=g, dtype=D)
    for rope, by_hand in (
        ((emb.cos(), emb.sin()), True),
        ((emb.cos(), torch.rand(1, n, hd, generator=g, dtype=D)), False),
    ):
        inp = AttentionInputs(xs=xs, rope=[rope], num_heads=2, num_kv_heads=1, head_dim=hd, scaling=hd**-0.5,
                              apply_rope=apply_rotary_pos_emb, block_size=5)  # fmt: skip
        assert rope_adjoint_is_negated_sin(inp) is by_hand
        fast, slow = (
            amp_masks(inp, Wq, Wk, steps=3, lr=50.0, momentum=0.5, fused_backward=fb, progress=False)
            for fb in (True, False)
        )
        assert (fast[0] - 1).abs().max() > 0.1
        torch.testing.assert_close(fast[0], slow[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(fast[1], slow[1], rtol=1e-10, atol=1e-10)
        if not by_hand:  # forcing the hand-made backward here gives another gradient
            terms = [DataTerm(inp, Wq, Wk, None, None, 256.0, True, fb, False) for fb in (True, False)]
            terms[0].by_hand = True
            (_, gq, _), (_, ref, _) = (t(Wq * 1.1, Wk * 0.9) for t in terms)
            assert not torch.allclose(gq, ref, rtol=1e-3)
