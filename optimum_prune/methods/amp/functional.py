"""AMP math (Liang et al., "Beyond Linear Approximations: A Novel Pruning Approach for Attention Matrix",
arXiv 2410.11261; docs/methods/amp.md): masks on W_Q / W_K optimised by gradient descent so that the pruned softmax
attention matrix matches the dense one.

`attention_probs` recomputes one attention module's probabilities from its q/k weights with the module's own
pieces: q/k biases, per-head q/k norms (Qwen 3, Gemma 3), the module's `apply_rotary_pos_emb` applied *after*
masking, GQA groups (without materialising repeated keys), the module's `scaling`, logit soft-capping, the causal
mask and the sliding window. Everything runs in float32 (or float64 for float64 inputs).

Memory of `amp_masks` (float32, k calibration sequences of n tokens, H query heads, query blocks of B positions):
  - dense probabilities cached for the whole run, causal blocks only: 4·k·H·n·(n + B)/2 bytes (SmolLM2-135M,
    k=8, n=512, B=128: 47 MB per layer; `cache_dense=False` recomputes them per step instead);
  - the autograd reference path: one chunk of samples × KV groups at a time, kept under `max_chunk_mb` (the chunk
    shrinks to one KV group of one sample when needed), every block of the chunk; the fast path: one sequence (of
    those chunks) at a time, its queries, keys and their gradients plus three tiles of B·g × n floats; gradients
    are accumulated over chunks;
  - the masks, their momentum and the masked weights: 4 copies of W_Q and W_K.
Speed: see `blocked.py` (and the timings on the AMP page of the documentation, docs/methods/amp.md).
"""

from __future__ import annotations

import math
import time

import torch
from tqdm.auto import tqdm

from ...functional.masks import keep_mask
from .attention import AttentionInputs, attention_mask, attention_probs, project_qk, qk_rows, rope_of
from .blocked import causal_blocks, interleave_heads
from .closed_form import fused_amp_masks, fused_mask_gradient, separate_mask_gradients, softmax_causal

__all__ = [
    "AttentionInputs",
    "DataTerm",
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
        regularizer (`str`): `"unscaled"` (our reading: data term averaged over samples, λM added
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
    data_term = DataTerm(inp, Wq, Wk, bq, bk, max_chunk_mb, cache_dense, fused_backward, gradient == "algorithm1")
    reg = lambda_ if regularizer == "unscaled" else lambda_ / inp.num_samples
    t0 = time.perf_counter()
    norms = [p for m in (inp.q_norm, inp.k_norm) if m is not None for p in m.parameters()]
    flags = [p.requires_grad for p in norms]
    losses: list[float] = []
    try:
        for p in norms:  # the model's own norm weights take no gradient
            p.requires_grad_(False)
        Vq, Vk = torch.zeros_like(Mq), torch.zeros_like(Mk)
        bar = tqdm(range(steps), desc=desc, leave=False, **({} if progress else {"disable": True}))
        for _ in bar:
            data, gq, gk = data_term((Wq * Mq).to(dtype), (Wk * Mk).to(dtype), update_q, update_k)
            total = data + 0.5 * lambda_ * float(Mq.pow(2).sum() + Mk.pow(2).sum())
            losses.append(total)
            if not math.isfinite(total):
                raise FloatingPointError(f"AMP loss became {total} at step {len(losses)}.")
            if update_q:  # ∇_M = W ∘ ∇_{W∘M} + λM; heavy ball
                Vq.mul_(momentum).add_(gq.double() * Wq + reg * Mq)
                Mq.sub_(lr * Vq)
            if update_k:
                Vk.mul_(momentum).add_(gk.double() * Wk + reg * Mk)
                Mk.sub_(lr * Vk)
            bar.set_postfix(loss=f"{total:.4g}")
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


class DataTerm:
    """`(1/k) Σ_j ½‖f̃_j − f_j‖²` of masked q/k weights and its gradients w.r.t. them, summed over the chunks of
    `_plan_chunks` (a plain sum over samples: what a data-parallel run would all-reduce).

    The target `f_j` is the dense weights' attention on the same inputs, or, with `target` (an `AttentionInputs` of
    the same chunks and sequences), on those other inputs: e.g. the dense model's own, so that the masked weights on
    a pruned model's inputs are fitted to the dense model's attention.

    The fast path (`CausalBlocks.loss_and_grads`: closed-form softmax backward) gives the gradient w.r.t. the
    queries and keys, one sequence at a time. Without q/k norms and with a RoPE whose adjoint is RoPE by `−sin`
    (`rope_adjoint_is_negated_sin`: the rotate-half RoPE of Llama-like models), it is taken back to the weights
    by hand (the adjoint rotation, then one matmul per projection); otherwise autograd takes it back through RoPE,
    the q/k norms and the projections. The reference path (`fast=False`, and with logit soft-capping) is autograd
    through the same forward."""

    def __init__(self, inp, Wq, Wk, bq, bk, max_chunk_mb, cache_dense, fast, literal, target=None):
        self.inp, self.bq, self.bk, self.literal = inp, bq, bk, literal
        self.target = inp if target is None else target
        self.fast = fast and inp.softcap is None
        self.dense_w = (Wq, Wk)
        self.units = _plan_chunks(inp, max_chunk_mb)
        if self.fast:  # one sequence at a time: its q/k, tiles and gradients stay in cache
            self.units = [(c, slice(i, i + 1), g) for c, s, g in self.units for i in range(*s.indices(len(inp.xs[c])))]
        self.cache: dict[int, list[torch.Tensor]] | None = {} if cache_dense else None
        self.by_hand = self.fast and inp.q_norm is None and inp.k_norm is None and rope_adjoint_is_negated_sin(inp)

    def _qk(self, u, Wq, Wk, inp=None):
        c, s, g = self.units[u]
        inp = self.inp if inp is None else inp
        q, k = project_qk(inp, c, Wq, Wk, self.bq, self.bk, s, g)
        return interleave_heads(q) * inp.scaling, k, causal_blocks(inp, q.shape[3], q.device)

    def dense(self, u: int) -> list[torch.Tensor]:
        if self.cache is not None and u in self.cache:
            return self.cache[u]
        with torch.no_grad():
            qs, k, blocks = self._qk(u, *self.dense_w, self.target)
            f = blocks.probs(qs, k)
        if self.cache is not None:
            self.cache[u] = f
        return f

    @torch.no_grad()
    def _by_hand(self, u, Wq_m, Wk_m, gq, gk, inv_k) -> float:
        """The fast path's loss of unit `u`; adds its gradients w.r.t. the masked weights to `gq` / `gk` (or None)."""
        inp, (c, s, groups) = self.inp, self.units[u]
        q, k = project_qk(inp, c, Wq_m, Wk_m, self.bq, self.bk, s, groups)
        b, G, gs, n, hd = q.shape
        blocks = causal_blocks(inp, n, q.device)
        loss, dqs, dk = blocks.loss_and_grads(interleave_heads(q) * inp.scaling, k, self.dense(u), self.literal)
        # back through the interleaving and the scaling (and the 1/k of the data term), then RoPE (its adjoint)
        dq = dqs.view(b, G, n, gs, hd).transpose(2, 3).reshape(b, G * gs, n, hd).mul_(inp.scaling * inv_k)
        dk.mul_(inv_k)
        rope = rope_of(inp, c, s, q.dtype)
        if rope is not None:
            dq, dk = inp.apply_rope(dq, dk, rope[0], -rope[1])
        x = inp.xs[c][s].to(q.dtype).reshape(b * n, -1)
        q_rows, k_rows = qk_rows(inp, groups)
        for grad, rows, d in ((gq, q_rows, dq), (gk, k_rows, dk)):
            if grad is not None:  # dW = dᵀ x over the tokens, `(heads·hd, in)`
                grad[rows].addmm_(d.transpose(1, 2).reshape(b * n, -1).T, x)
        return loss * inv_k

    def __call__(self, Wq_m, Wk_m, update_q=True, update_k=True):
        inv_k = 1.0 / self.inp.num_samples
        if self.by_hand:
            gq = torch.zeros_like(Wq_m) if update_q else None
            gk = torch.zeros_like(Wk_m) if update_k else None
            data = sum(self._by_hand(u, Wq_m, Wk_m, gq, gk, inv_k) for u in range(len(self.units)))
            return data, gq, gk
        Wq_m, Wk_m = Wq_m.requires_grad_(update_q), Wk_m.requires_grad_(update_k)
        data = 0.0
        with torch.enable_grad():
            for u in range(len(self.units)):
                f = self.dense(u)
                qs, k, blocks = self._qk(u, Wq_m, Wk_m)
                if self.fast:
                    loss, dqs, dk = blocks.loss_and_grads(qs.detach(), k.detach(), f, self.literal)
                    pairs = [(t, d.mul_(inv_k)) for t, d in ((qs, dqs), (k, dk)) if t.requires_grad]
                    torch.autograd.backward([t for t, _ in pairs], [d for _, d in pairs])
                    data += loss * inv_k
                else:
                    probs = blocks.probs(qs, k, f if self.literal else None)
                    loss = sum(0.5 * (pb - fb).pow(2).sum() for pb, fb in zip(probs, f)) * inv_k
                    loss.backward()
                    data += float(loss.detach())
        return data, Wq_m.grad, Wk_m.grad


def rope_adjoint_is_negated_sin(inp: AttentionInputs) -> bool:
    """Whether the module's `apply_rope(·, cos, −sin)` is the adjoint (transpose) of `apply_rope(·, cos, sin)` for
    every chunk's cos/sin, as for the rotate-half RoPE whose cos/sin halves are equal (Llama, Mistral, Qwen 2, ...).
    RoPE is linear in q and k, so one random probe `⟨A u, v⟩ = ⟨u, Aᵀv⟩` in float64 decides it (with probability 1);
    without RoPE the answer is trivially yes."""
    if inp.apply_rope is None:
        return all(r is None for r in inp.rope)
    gen = torch.Generator().manual_seed(0)
    for rope in inp.rope:
        if rope is None:
            continue
        cos, sin = (t.detach().to("cpu", torch.float64) for t in rope)
        shape = (cos.shape[0], 2, cos.shape[-2], cos.shape[-1])  # (b, heads, n, hd)
        uq, uk, vq, vk = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))
        try:
            aq, ak = inp.apply_rope(uq, uk, cos, sin)
            tq, tk = inp.apply_rope(vq, vk, cos, -sin)
        except (TypeError, ValueError, RuntimeError):  # an unusual signature or layout: autograd differentiates it
            return False
        lhs, rhs = float((aq * vq).sum() + (ak * vk).sum()), float((uq * tq).sum() + (uk * tk).sum())
        if abs(lhs - rhs) > 1e-9 * (uq.norm() * vq.norm() + uk.norm() * vk.norm()):
            return False
    return True


def binarize(
    mask: torch.Tensor,
    weight: torch.Tensor,
    sparsity: float,
    nm: tuple[int, int] | None = None,
    score: str = "mask",
    per: str = "matrix",
    input_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keep mask from a real-valued AMP mask: the lowest-ranked `sparsity` fraction is pruned.

    Args:
        score (`str`): `"mask"` ranks by the mask value itself (paper), `"masked_weight"` by `|M∘W|`,
            `"masked_weight_input"` by `|M∘W|·‖X_j‖` (needs `input_norm`, the per-input-feature norm ‖X_j‖).
        per (`str`): unstructured ranking per `"matrix"` (paper) or per `"row"`; N:M always per group of M inputs.
    """
    if score == "mask":
        scores = mask
    else:
        scores = (mask * weight.to(mask.dtype)).abs()
        if score == "masked_weight_input":
            if input_norm is None:
                raise ValueError("score='masked_weight_input' needs `input_norm` (‖X_j‖ per input feature).")
            scores = scores * input_norm.to(scores)
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
    target: AttentionInputs | None = None,
) -> float:
    """`Σ_j ‖f̃_j − f_j‖²_F / Σ_j ‖f_j‖²_F` over every sequence and head, in float32 (float64 for float64 input);
    `f` from the dense weights on `target`'s inputs when given (same chunks and sequences), else on `inp`'s."""
    dtype = torch.float64 if Wq.dtype == torch.float64 else torch.float32
    Wq, Wk, Wq_new, Wk_new = (w.detach().to(dtype) for w in (Wq, Wk, Wq_new, Wk_new))
    num = den = 0.0
    for c, s, g in _plan_chunks(inp, max_chunk_mb):
        f = attention_probs(inp if target is None else target, c, Wq, Wk, bq, bk, s, g)
        ft = attention_probs(inp, c, Wq_new, Wk_new, bq, bk, s, g)
        num += sum(float((a - b).pow(2).sum()) for a, b in zip(ft, f))
        den += sum(float(b.pow(2).sum()) for b in f)
    return num / max(den, 1e-300)
