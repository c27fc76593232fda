"""AMP math (Liang et al., "Beyond Linear Approximations: A Novel Pruning Approach for Attention Matrix",
arXiv 2410.11261; SPEC §C): masks on W_Q / W_K optimised by gradient descent so that the pruned softmax attention
matrix matches the dense one.

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
Speed: see `blocked.py` (SmolLM2-135M, 8 × 512 tokens: ~0.12 s per step per layer on 2 idle cores).
"""

from __future__ import annotations

import math
import time

import torch
from tqdm.auto import tqdm

from .attention import AttentionInputs, attention_mask, attention_probs, project_qk
from .blocked import causal_blocks, interleave_heads
from .closed_form import fused_amp_masks, fused_mask_gradient, separate_mask_gradients, softmax_causal

__all__ = [
    "AttentionInputs",
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
    data_term = _DataTerm(inp, Wq, Wk, bq, bk, max_chunk_mb, cache_dense, fused_backward, gradient == "algorithm1")
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


class _DataTerm:
    """`(1/k) Σ_j ½‖f̃_j − f_j‖²` of masked q/k weights and its gradients w.r.t. them, summed over the chunks of
    `_plan_chunks` (a plain sum over samples: what a data-parallel run would all-reduce).

    The fast path (`CausalBlocks.loss_and_grads`: closed-form softmax backward) gives the gradient w.r.t. the
    queries and keys; autograd takes it back through RoPE, q/k norms, biases and the projections. The reference
    path (`fast=False`, and with logit soft-capping) is autograd through the same forward."""

    def __init__(self, inp, Wq, Wk, bq, bk, max_chunk_mb, cache_dense, fast, literal):
        self.inp, self.bq, self.bk, self.literal = inp, bq, bk, literal
        self.fast = fast and inp.softcap is None
        self.dense_w = (Wq, Wk)
        self.units = _plan_chunks(inp, max_chunk_mb)
        if self.fast:  # one sequence at a time: its q/k, tiles and gradients stay in cache
            self.units = [(c, slice(i, i + 1), g) for c, s, g in self.units for i in range(*s.indices(len(inp.xs[c])))]
        self.cache: dict[int, list[torch.Tensor]] | None = {} if cache_dense else None

    def _qk(self, u, Wq, Wk):
        c, s, g = self.units[u]
        q, k = project_qk(self.inp, c, Wq, Wk, self.bq, self.bk, s, g)
        return interleave_heads(q) * self.inp.scaling, k, causal_blocks(self.inp, q.shape[3], q.device)

    def dense(self, u: int) -> list[torch.Tensor]:
        if self.cache is not None and u in self.cache:
            return self.cache[u]
        with torch.no_grad():
            qs, k, blocks = self._qk(u, *self.dense_w)
            f = blocks.probs(qs, k)
        if self.cache is not None:
            self.cache[u] = f
        return f

    def __call__(self, Wq_m, Wk_m, update_q=True, update_k=True):
        inv_k = 1.0 / self.inp.num_samples
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
