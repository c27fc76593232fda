"""AMP math (Liang et al., "Beyond Linear Approximations: A Novel Pruning Approach for Attention Matrix",
arXiv 2410.11261; SPEC §C): masks on W_Q / W_K optimised by gradient descent so that the pruned softmax attention
matrix matches the dense one.

`attention_probs` recomputes one attention module's probabilities from its q/k weights with the module's own
pieces: q/k biases, per-head q/k norms (Qwen 3, Gemma 3), the module's `apply_rotary_pos_emb` applied *after*
masking, GQA groups (without materialising repeated keys), the module's `scaling`, logit soft-capping, the causal
mask and the sliding window. Everything runs in float32 (or float64 for float64 inputs).

Memory of `amp_masks` (float32, k calibration sequences of n tokens, H query heads):
  - dense probabilities cached for the whole run: 4·k·H·n² bytes (SmolLM2-135M, k=8, n=512: 75 MB per layer;
    `cache_dense=False` recomputes them per step instead);
  - one chunk of samples × KV groups, holding ~4 n²-sized tensors per head for backward, kept under `max_chunk_mb`
    (the chunk shrinks to one KV group of one sample when needed); gradients are accumulated over chunks;
  - the masks, their momentum and the masked weights: 4 copies of W_Q and W_K.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

__all__ = [
    "AttentionInputs",
    "assemble",
    "attention_probs",
    "attention_mask",
    "amp_masks",
    "binarize",
    "relative_attention_error",
    "fused_amp_masks",
    "fused_mask_gradient",
    "separate_mask_gradients",
    "softmax_causal",
]


@dataclass
class AttentionInputs:
    """What one attention module sees on the calibration set, and how it computes its scores.

    Args:
        xs (`list[torch.Tensor]`): per chunk, the attention input of shape `(batch, n, d)` (after the input norm).
        rope (`list[tuple[torch.Tensor, torch.Tensor] | None]`): per chunk, the `(cos, sin)` the module received.
        num_heads / num_kv_heads / head_dim (`int`): geometry.
        scaling (`float`): factor applied to `q·k` (1/√d_h for most models).
        sliding_window (`int | None`): keys further back than this are masked (Gemma 3 local layers).
        softcap (`float | None`): logit soft-capping `cap·tanh(s/cap)`.
        q_norm / k_norm (`nn.Module | None`): per-head norms applied before RoPE.
        apply_rope (`Callable | None`): the module's `apply_rotary_pos_emb(q, k, cos, sin)`.
        causal (`bool`): causal mask.
        block_size (`int`): query positions per block; blocks skip the keys the causal mask hides (~40% less work
            at n = 512, same values).
    """

    xs: list[torch.Tensor]
    rope: list
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None
    softcap: float | None = None
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    apply_rope: Callable | None = None
    causal: bool = True
    block_size: int = 128

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def num_samples(self) -> int:
        return sum(x.shape[0] for x in self.xs)

    @classmethod
    def from_module(cls, attn: nn.Module, xs, rope, num_heads: int, num_kv_heads: int, head_dim: int):
        """Read the scoring details from a transformers attention module (raises when it has no `scaling`)."""
        if not hasattr(attn, "scaling"):
            raise ValueError(
                f"{type(attn).__name__} has no `scaling` attribute: AMP cannot reproduce its attention scores. "
                "Supported: the attention modules of the architectures in `supported_model_types()`."
            )
        apply = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
        if any(r is not None for r in rope) and apply is None:
            raise ValueError(f"{type(attn).__name__} receives rotary embeddings but its module has no RoPE function.")
        return cls(
            xs=xs,
            rope=rope,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scaling=float(attn.scaling),
            sliding_window=getattr(attn, "sliding_window", None),
            softcap=getattr(attn, "attn_logit_softcapping", None),
            q_norm=getattr(attn, "q_norm", None),
            k_norm=getattr(attn, "k_norm", None),
            apply_rope=apply,
            causal=getattr(attn, "is_causal", True),
        )


def attention_mask(n: int, causal: bool = True, sliding_window: int | None = None, device=None) -> torch.Tensor:
    """Boolean `(n, n)` mask, True where query i may attend to key j (causal: j <= i; window: i - j < window)."""
    i = torch.arange(n, device=device).unsqueeze(1)
    j = torch.arange(n, device=device).unsqueeze(0)
    allowed = torch.ones(n, n, dtype=torch.bool, device=device)
    if causal:
        allowed &= j <= i
    if sliding_window is not None:
        allowed &= (i - j) < sliding_window
    return allowed


def attention_probs(
    inp: AttentionInputs,
    chunk: int,
    Wq: torch.Tensor,
    Wk: torch.Tensor,
    bq: torch.Tensor | None = None,
    bk: torch.Tensor | None = None,
    samples: slice = slice(None),
    groups: slice | None = None,
    dense_for_backward: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probabilities of chunk `chunk` for the KV groups `groups` (default all).

    Args:
        Wq (`torch.Tensor` of shape `(H·d_h, d)`), Wk (`(H_kv·d_h, d)`): the (masked) q/k weights, `(out, in)`.
        bq, bk: their biases (never masked).
        samples (`slice`): sequences of the chunk to use.
        groups (`slice | None`): KV groups to compute (their query heads come along).
        dense_for_backward (`torch.Tensor | None`): the dense probabilities; when given, the softmax backward uses
            them in `p1 = c∘f` (Algorithm 1's printed gradient) instead of the exact `c∘f̃`.

    Returns:
        `list[torch.Tensor]`: per block of `inp.block_size` query positions, the probabilities of shape
        `(b, G, g, rows, keys)` per KV group `G` and query head in the group `g`, over the keys the block can see
        (causal: keys up to its last row; sliding window: from its first row's window start). Entries outside
        are exactly zero in the full matrix, so skipping them changes no value (`assemble` rebuilds the matrix).
    """
    q, k = project_qk(inp, chunk, Wq, Wk, bq, bk, samples, groups)
    return [
        _softmax_block(inp, q, k, a, dense_for_backward[t] if dense_for_backward is not None else None)
        for t, a in enumerate(range(0, q.shape[3], inp.block_size))
    ]


def project_qk(inp, chunk, Wq, Wk, bq=None, bk=None, samples=slice(None), groups=None):
    """Per-head queries `(b, G, g, n, d_h)` and keys `(b, G, n, d_h)` after biases, q/k norms and RoPE."""
    x = inp.xs[chunk][samples]
    dtype = torch.float64 if Wq.dtype == torch.float64 else torch.float32
    x = x.to(dtype)
    b, n, _ = x.shape
    hd, gs = inp.head_dim, inp.group_size
    g0, g1 = (0, inp.num_kv_heads) if groups is None else (groups.start, groups.stop)
    q_rows = slice(g0 * gs * hd, g1 * gs * hd)
    k_rows = slice(g0 * hd, g1 * hd)
    q = x @ Wq[q_rows].T  # (b, n, Gq·hd)
    k = x @ Wk[k_rows].T  # (b, n, G·hd)
    if bq is not None:
        q = q + bq[q_rows].to(dtype)
    if bk is not None:
        k = k + bk[k_rows].to(dtype)
    q = q.view(b, n, -1, hd).transpose(1, 2)  # (b, Gq, n, hd)
    k = k.view(b, n, -1, hd).transpose(1, 2)  # (b, G, n, hd)
    if inp.q_norm is not None:
        q = inp.q_norm(q).to(dtype)
    if inp.k_norm is not None:
        k = inp.k_norm(k).to(dtype)
    rope = inp.rope[chunk]
    if rope is not None:
        cos, sin = (t[samples].to(dtype) if t.shape[0] > 1 else t.to(dtype) for t in rope)
        q, k = inp.apply_rope(q, k, cos, sin)
    G = g1 - g0
    return q.view(b, G, gs, n, hd), k


def _block_keys(inp: AttentionInputs, a: int, n: int) -> tuple[int, int, int]:
    """Query rows `[a, e)` of a block and the keys `[k0, k1)` it can see."""
    e = min(n, a + inp.block_size)
    k1 = e if inp.causal else n
    k0 = max(0, a - inp.sliding_window + 1) if inp.sliding_window is not None else 0
    return e, k0, k1


def _logits_block(inp: AttentionInputs, q: torch.Tensor, k: torch.Tensor, a: int) -> torch.Tensor:
    b, G, gs, n, hd = q.shape
    e, k0, k1 = _block_keys(inp, a, n)
    qb = q[:, :, :, a:e].reshape(b, G, gs * (e - a), hd)  # a group's query heads stacked: one matmul per KV head
    s = (qb @ k[:, :, k0:k1].transpose(-1, -2)).view(b, G, gs, e - a, k1 - k0) * inp.scaling
    if inp.softcap is not None:
        s = torch.tanh(s / inp.softcap) * inp.softcap
    i = torch.arange(a, e, device=s.device).unsqueeze(1)
    j = torch.arange(k0, k1, device=s.device).unsqueeze(0)
    allowed = torch.ones(e - a, k1 - k0, dtype=torch.bool, device=s.device)
    if inp.causal:
        allowed &= j <= i
    if inp.sliding_window is not None:
        allowed &= (i - j) < inp.sliding_window
    return s.masked_fill(~allowed, float("-inf"))


def _softmax_block(inp, q, k, a, dense_for_backward=None) -> torch.Tensor:
    s = _logits_block(inp, q, k, a)
    if dense_for_backward is not None:
        return _Alg1Softmax.apply(s, dense_for_backward)
    return torch.softmax(s, dim=-1)


def _fused_block_backward(inp, q, k, dense_blocks, scale, literal) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Data loss `scale·Σ½‖f̃ − f‖²` of all query blocks and its gradients w.r.t. `q` and `k`, without autograd on
    the n×n tensors: `dS = p1 − rowsum(p1)·f̃` with `p1 = c∘f̃` (or `c∘f`, Algorithm 1), `dq = dS·k`, `dk = dSᵀ·q`.
    Same values as autograd through the softmax, with about half the passes over the n×n tensors."""
    b, G, gs, n, hd = q.shape
    dq, dk = torch.zeros_like(q), torch.zeros_like(k)
    loss = 0.0
    for t, a in enumerate(range(0, n, inp.block_size)):
        e, k0, k1 = _block_keys(inp, a, n)
        with torch.no_grad():
            ft = torch.softmax(_logits_block(inp, q, k, a), dim=-1)
            f = dense_blocks[t]
            c = ft.sub(f)
            loss += 0.5 * float(torch.dot(c.view(-1), c.view(-1)))
            p1 = c.mul_(f if literal else ft)
            dS = p1.addcmul_(ft, p1.sum(-1, keepdim=True), value=-1.0)  # (b, G, g, rows, keys)
            dS = dS.view(b, G, gs * (e - a), k1 - k0)
            qb = q[:, :, :, a:e].reshape(b, G, gs * (e - a), hd)
            g_scale = scale * inp.scaling
            dq[:, :, :, a:e] += (dS @ k[:, :, k0:k1]).view(b, G, gs, e - a, hd) * g_scale
            dk[:, :, k0:k1] += (dS.transpose(-1, -2) @ qb) * g_scale
    return loss * scale, dq, dk


def assemble(
    blocks: list[torch.Tensor], n: int, causal: bool = True, sliding_window: int | None = None, block_size: int = 128
) -> torch.Tensor:
    """The full `(b, G, g, n, n)` probabilities from the query blocks of `attention_probs` (zeros elsewhere)."""
    b, G, gs = blocks[0].shape[:3]
    out = blocks[0].new_zeros(b, G, gs, n, n)
    for t, blk in enumerate(blocks):
        a = t * block_size
        e = a + blk.shape[3]
        k1 = e if causal else n
        k0 = max(0, a - sliding_window + 1) if sliding_window is not None else 0
        out[:, :, :, a:e, k0:k1] = blk
    return out


class _Alg1Softmax(torch.autograd.Function):
    """Softmax whose backward uses the *dense* probabilities in `p1 = c∘f` (the literal Algorithm 1, line 12)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits, dim=-1)
        ctx.save_for_backward(probs, dense)
        return probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        probs, dense = ctx.saved_tensors
        p1 = grad * dense
        return p1 - p1.sum(-1, keepdim=True) * probs, None


def _plan_chunks(inp: AttentionInputs, max_chunk_mb: float) -> list[tuple[int, slice, slice]]:
    """(chunk, samples, KV groups) units whose attention tensors fit in `max_chunk_mb`."""
    units = []
    for c, x in enumerate(inp.xs):
        b, n = x.shape[0], x.shape[1]
        per_head = 4 * 4 * n * n  # ~4 float32 n×n tensors per head kept for backward
        per_group = per_head * inp.group_size
        budget = max_chunk_mb * 2**20
        groups_per = max(1, min(inp.num_kv_heads, int(budget // per_group)))
        samples_per = max(1, int(budget // (per_group * inp.num_kv_heads))) if groups_per == inp.num_kv_heads else 1
        for s0 in range(0, b, samples_per):
            for g0 in range(0, inp.num_kv_heads, groups_per):
                units.append(
                    (c, slice(s0, min(b, s0 + samples_per)), slice(g0, min(inp.num_kv_heads, g0 + groups_per)))
                )
    return units


def amp_masks(
    inp: AttentionInputs,
    Wq: torch.Tensor,
    Wk: torch.Tensor,
    bq: torch.Tensor | None = None,
    bk: torch.Tensor | None = None,
    *,
    lambda_: float = 0.05,
    lr: float = 0.005,
    steps: int = 100,
    momentum: float = 0.9,
    regularizer: str = "unscaled",
    gradient: str = "exact",
    update_q: bool = True,
    update_k: bool = True,
    max_chunk_mb: float = 256.0,
    cache_dense: bool = True,
    fused_backward: bool = True,
    progress: bool = True,
    desc: str = "amp: steps",
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Gradient descent with heavy-ball momentum on the masks `M_Q`, `M_K` (initialised to ones) of

        L(M_Q, M_K) = (1/k) Σ_j ½‖f̃_j − f_j‖²_F  +  ½λ(‖M_Q‖² + ‖M_K‖²)

    where `f_j` / `f̃_j` are the dense / masked attention probabilities of sequence j (all heads), `k` the number
    of sequences. Update: `v ← βv + ∇L`, `M ← M − η v`.

    Args:
        inp (`AttentionInputs`): calibration inputs and the module's scoring details.
        Wq, Wk (`torch.Tensor`, `(out, in)`): dense weights; bq, bk: biases.
        lambda_, lr, steps, momentum: λ, η, T, β.
        regularizer (`str`): `"unscaled"` (SPEC §C.7.4 resolution: data term averaged over samples, λM added
            as is) or `"divided_by_k"` (Algorithm 1 literally: `(η/k)(Σ_j … + λM)`).
        gradient (`str`): `"exact"` (autograd, `p1 = c∘f̃`, Theorem D.5) or `"algorithm1"` (`p1 = c∘f` with the dense
            f, as printed in Algorithm 1, line 12).
        update_q / update_k (`bool`): optimise that mask (the other stays at ones).
        max_chunk_mb (`float`): memory bound of one forward/backward chunk (see the module docstring).
        cache_dense (`bool`): keep the dense probabilities for the whole run (else recompute them each step).
        fused_backward (`bool`): compute the softmax / loss gradient by its closed form on each query block instead
            of autograd (same iterates up to rounding, fewer passes over the n×n tensors); autograd is used anyway
            with logit soft-capping.

    Returns:
        `(M_Q, M_K, info)`: real-valued float64 masks and `{"loss_initial", "loss_final", "steps", "seconds", "losses"}`.

    Raises:
        `FloatingPointError` when the loss becomes NaN/Inf (the caller decides what to leave unchanged).
    """
    if steps < 1 or lr <= 0:
        raise ValueError(f"steps must be >= 1 and lr > 0, got steps={steps}, lr={lr}.")
    dtype = torch.float64 if Wq.dtype == torch.float64 else torch.float32
    Wq, Wk = Wq.detach().to(dtype), Wk.detach().to(dtype)
    bq = None if bq is None else bq.detach().to(dtype)
    bk = None if bk is None else bk.detach().to(dtype)
    # The masks (and momenta) live in float64: after the uniform shrink by the regulariser, the data term moves the
    # entries apart by ~1e-7 relative per step, below float32 resolution near 1, so float32 masks would tie and be
    # ranked by index. The forward and backward still run in float32 on `W∘M`.
    Mq, Mk = torch.ones_like(Wq, dtype=torch.float64), torch.ones_like(Wk, dtype=torch.float64)
    Vq, Vk = torch.zeros_like(Mq), torch.zeros_like(Mk)
    k = inp.num_samples
    reg = lambda_ if regularizer == "unscaled" else lambda_ / k
    units = _plan_chunks(inp, max_chunk_mb)
    dense_cache: dict[int, torch.Tensor] = {}

    def dense(u: int) -> torch.Tensor:
        if u in dense_cache:
            return dense_cache[u]
        c, s, g = units[u]
        with torch.no_grad():
            f = attention_probs(inp, c, Wq, Wk, bq, bk, s, g)
        if cache_dense:
            dense_cache[u] = f
        return f

    t0 = time.perf_counter()
    norms = [p for m in (inp.q_norm, inp.k_norm) if m is not None for p in m.parameters()]
    flags = [p.requires_grad for p in norms]
    try:
        for p in norms:  # the model's own norm weights take no gradient
            p.requires_grad_(False)
        with torch.enable_grad():
            losses = _descend(
                inp,
                units,
                dense,
                Wq,
                Wk,
                bq,
                bk,
                Mq,
                Mk,
                Vq,
                Vk,
                k,
                reg,
                lambda_,
                lr,
                momentum,
                gradient,
                update_q,
                update_k,
                steps,
                progress,
                desc,
                fused_backward,
            )
    finally:
        for p, f in zip(norms, flags):
            p.requires_grad_(f)
    info = {
        "loss_initial": losses[0],
        "loss_final": losses[-1],
        "steps": steps,
        "seconds": time.perf_counter() - t0,
        "losses": losses,
    }
    return Mq, Mk, info


def _descend(
    inp,
    units,
    dense,
    Wq,
    Wk,
    bq,
    bk,
    Mq,
    Mk,
    Vq,
    Vk,
    k,
    reg,
    lambda_,
    lr,
    momentum,
    gradient,
    update_q,
    update_k,
    steps,
    progress,
    desc,
    fused_backward=True,
) -> list[float]:
    """The descent loop of `amp_masks` (updates `Mq`, `Mk` and the momenta in place); returns the losses."""
    losses: list[float] = []
    bar = tqdm(range(steps), desc=desc, leave=False, **({} if progress else {"disable": True}))
    for _ in bar:
        Wq_m = (Wq * Mq).to(Wq.dtype).requires_grad_(update_q)
        Wk_m = (Wk * Mk).to(Wk.dtype).requires_grad_(update_k)
        data = 0.0
        for u, (c, s, g) in enumerate(units):
            f = dense(u)
            if fused_backward and inp.softcap is None:
                q, kk = project_qk(inp, c, Wq_m, Wk_m, bq, bk, s, g)
                loss, dq, dk = _fused_block_backward(
                    inp, q.detach(), kk.detach(), f, 1.0 / k, gradient == "algorithm1"
                )
                pairs = [(t, d) for t, d in ((q, dq), (kk, dk)) if t.requires_grad]
                torch.autograd.backward([t for t, _ in pairs], [d for _, d in pairs])
                data += loss
                continue
            probs = attention_probs(inp, c, Wq_m, Wk_m, bq, bk, s, g, f if gradient == "algorithm1" else None)
            loss = sum(0.5 * (pb - fb).pow(2).sum() for pb, fb in zip(probs, f)) / k
            loss.backward()
            data += float(loss.detach())
        total = data + 0.5 * lambda_ * float(Mq.pow(2).sum() + Mk.pow(2).sum())
        losses.append(total)
        if not math.isfinite(total):
            raise FloatingPointError(f"AMP loss became {total} at step {len(losses)}.")
        with torch.no_grad():
            if update_q:
                Vq.mul_(momentum).add_(Wq_m.grad.double() * Wq + reg * Mq)
                Mq.sub_(lr * Vq)
            if update_k:
                Vk.mul_(momentum).add_(Wk_m.grad.double() * Wk + reg * Mk)
                Mk.sub_(lr * Vk)
        bar.set_postfix(loss=f"{total:.4g}")
    return losses


def binarize(
    mask: torch.Tensor,
    weight: torch.Tensor,
    sparsity: float,
    nm: tuple[int, int] | None = None,
    score: str = "mask",
    per: str = "matrix",
) -> torch.Tensor:
    """Keep mask from a real-valued AMP mask: the lowest-ranked `sparsity` fraction is pruned.

    Args:
        score (`str`): `"mask"` ranks by the mask value itself (paper), `"masked_weight"` by `|M∘W|`.
        per (`str`): unstructured ranking per `"matrix"` (paper) or per `"row"`; N:M always per group of M inputs.
    """
    from ...functional.masks import keep_mask

    scores = mask if score == "mask" else (mask * weight.to(mask.dtype)).abs()
    return keep_mask(scores, sparsity, nm, per=per)


@torch.no_grad()
def relative_attention_error(
    inp: AttentionInputs,
    Wq: torch.Tensor,
    Wk: torch.Tensor,
    Wq_new: torch.Tensor,
    Wk_new: torch.Tensor,
    bq: torch.Tensor | None = None,
    bk: torch.Tensor | None = None,
    max_chunk_mb: float = 256.0,
) -> float:
    """`Σ_j ‖f̃_j − f_j‖²_F / Σ_j ‖f_j‖²_F` over every sequence and head, in float32 (float64 for float64 input)."""
    dtype = torch.float64 if Wq.dtype == torch.float64 else torch.float32
    Wq, Wk, Wq_new, Wk_new = (w.detach().to(dtype) for w in (Wq, Wk, Wq_new, Wk_new))
    num = den = 0.0
    for c, s, g in _plan_chunks(inp, max_chunk_mb):
        f = attention_probs(inp, c, Wq, Wk, bq, bk, s, g)
        ft = attention_probs(inp, c, Wq_new, Wk_new, bq, bk, s, g)
        num += sum(float((a - b).pow(2).sum()) for a, b in zip(ft, f))
        den += sum(float(b.pow(2).sum()) for b in f)
    return num / max(den, 1e-300)


# ------------------------------------------------------------------- the paper's closed forms (SPEC §C.2), for tests
def softmax_causal(S: torch.Tensor) -> torch.Tensor:
    """Row softmax of `S` over the causal (lower-triangular) entries; `diag((exp(S)∘M_c)1)⁻¹(exp(S)∘M_c)`."""
    n = S.shape[-1]
    return torch.softmax(S.masked_fill(~attention_mask(n, device=S.device), float("-inf")), dim=-1)


def _p(S: torch.Tensor, f: torch.Tensor, dense_in_p1: bool = False) -> torch.Tensor:
    ft = softmax_causal(S)
    c = ft - f
    p1 = c * (f if dense_in_p1 else ft)
    return p1 - p1.sum(-1, keepdim=True) * ft


def fused_mask_gradient(
    M: torch.Tensor, W: torch.Tensor, Xs: Sequence[torch.Tensor], lambda_: float, dense_in_p1: bool = False
) -> torch.Tensor:
    """∇_M of `Σ_j ½‖softmax_c(X_j(M∘W)X_jᵀ) − softmax_c(X_jWX_jᵀ)‖² + ½λ‖M‖²` in the paper's closed form:
    `W ∘ Σ_j X_jᵀ p_j X_j + λM` (Theorem 5.3 / D.5; `dense_in_p1` gives Algorithm 1's printed variant)."""
    g = torch.zeros_like(M)
    for X in Xs:
        f = softmax_causal(X @ W @ X.T)
        g += X.T @ _p(X @ (M * W) @ X.T, f, dense_in_p1) @ X
    return W * g + lambda_ * M


def fused_amp_masks(
    W: torch.Tensor,
    Xs: Sequence[torch.Tensor],
    *,
    lambda_: float,
    lr: float,
    steps: int = 100,
    momentum: float = 0.9,
    regularizer: str = "unscaled",
) -> torch.Tensor:
    """The paper's fused-W form (Algorithm 1; the theory and synthetic experiments): a single mask on
    `W = W_Q W_Kᵀ` (`d × d`, right-multiplied, no scaling, causal), heavy-ball descent from ones with the closed-form
    gradient averaged over the `k` samples; `regularizer="divided_by_k"` divides λM by k as printed."""
    k = len(Xs)
    reg = lambda_ if regularizer == "unscaled" else lambda_ / k
    M, V = torch.ones_like(W), torch.zeros_like(W)
    for _ in range(steps):
        V = momentum * V + fused_mask_gradient(M, W, Xs, 0.0) / k + reg * M
        M = M - lr * V
        if not torch.isfinite(M).all():
            raise FloatingPointError("the fused AMP descent diverged; lower lr.")
    return M


def separate_mask_gradients(
    MQ: torch.Tensor, MK: torch.Tensor, WQ: torch.Tensor, WK: torch.Tensor, Xs: Sequence[torch.Tensor], lambda_: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form gradients of the separate-mask loss (paper convention: `W_Q, W_K` are `d × d'`, right-multiplied):
    `∇M_Q = W_Q ∘ Σ Xᵀ p X (M_K∘W_K) + λM_Q`, `∇M_K = W_K ∘ Σ Xᵀ pᵀ X (M_Q∘W_Q) + λM_K`."""
    gq, gk = torch.zeros_like(MQ), torch.zeros_like(MK)
    Qm, Km = MQ * WQ, MK * WK
    for X in Xs:
        f = softmax_causal(X @ WQ @ WK.T @ X.T)
        p = _p(X @ Qm @ Km.T @ X.T, f)
        gq += X.T @ p @ X @ Km
        gk += X.T @ p.T @ X @ Qm
    return WQ * gq + lambda_ * MQ, WK * gk + lambda_ * MK
