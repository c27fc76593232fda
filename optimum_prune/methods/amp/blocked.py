"""Attention probabilities blocked over query positions, and the fast path of the AMP descent: the data loss
`Σ ½‖f̃ − f‖²_F` of one attention module and its gradients with respect to the (scaled) queries and the keys,
without autograd on the n×n tensors.

- Layout: a KV group's query heads are interleaved per position, `(b, G, n·g, d_h)` (row `i·g + h` = position i,
  head h), so that a block of query positions is one contiguous slice and one matmul against the group's keys.
- Causality: the block of positions `[a, e)` only meets the keys it can see (`[0, e)`, or the sliding window);
  only the columns where some entry is masked get `-inf` (a 0 / -inf tile, built once per sequence length, added).
- Tiles: the logits are one matmul per (query block, sequence, KV group); the fast path goes through those tiles one
  at a time in three preallocated buffers (`rows·g × keys` floats, 0.8 MB at SmolLM2's g = 3, 128 rows, 512 keys)
  that stay in cache, and writes its matmuls into their destinations (`out=`, `addmm_`).
- Backward in closed form (the paper's Theorem D.5), in place on each tile: `c = f̃ − f`, `p1 = c∘f̃` (`c∘f` for
  Algorithm 1's printed variant), `dS = p1 − rowsum(p1)·f̃`, `dq = dS·k`, `dk += dSᵀ·q`.
The logits are the same per-tile products in the reference path (`probs`, which `attention.attention_probs` uses
and autograd differentiates) and in the fast path, so both round alike, the dense probabilities come from the same
code and the step-0 loss is exactly zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .attention import AttentionInputs

__all__ = ["CausalBlocks", "causal_blocks", "interleave_heads"]


def interleave_heads(q: torch.Tensor) -> torch.Tensor:
    """`(b, G, g, n, d_h)` queries (per KV group, per head) to the position-major `(b, G, n·g, d_h)` layout."""
    b, G, gs, n, hd = q.shape
    return q.permute(0, 1, 3, 2, 4).reshape(b, G, n * gs, hd)


def block_keys(inp: AttentionInputs, a: int, n: int) -> tuple[int, int, int]:
    """Query positions `[a, e)` of a block and the keys `[k0, k1)` it can see."""
    e = min(n, a + inp.block_size)
    k1 = e if inp.causal else n
    k0 = max(0, a - inp.sliding_window + 1) if inp.sliding_window is not None else 0
    return e, k0, k1


def causal_blocks(inp: AttentionInputs, n: int, device=None) -> CausalBlocks:
    """The `CausalBlocks` of `inp` for sequences of `n` tokens (built once, cached on `inp`)."""
    key = (n, inp.block_size, str(device))
    if key not in inp.blocks_cache:
        inp.blocks_cache[key] = CausalBlocks(inp, n, device)
    return inp.blocks_cache[key]


@dataclass
class _Block:
    a: int  # query positions [a, e)
    e: int
    k0: int  # keys [k0, k1)
    k1: int
    c0: int  # block columns [c0, c1) hold the masked entries (`masked`, rows × (c1 − c0), True = masked)
    c1: int
    masked: torch.Tensor | None
    bias: dict = field(default_factory=dict)  # per dtype: `masked` as 0 / -inf, added to the logits


class CausalBlocks:
    """The query blocks of one attention module on sequences of `n` tokens.

    Args:
        inp (`AttentionInputs`): block size, group size, causal flag, sliding window and logit soft-capping.
        n (`int`): sequence length.
        device: where the masks live.
    """

    def __init__(self, inp: AttentionInputs, n: int, device=None) -> None:
        self.gs, self.softcap = inp.group_size, inp.softcap
        self.blocks: list[_Block] = []
        for a in range(0, n, inp.block_size):
            e, k0, k1 = block_keys(inp, a, n)
            i = torch.arange(a, e, device=device).unsqueeze(1)
            j = torch.arange(k0, k1, device=device).unsqueeze(0)
            bad = torch.zeros(e - a, k1 - k0, dtype=torch.bool, device=device)
            if inp.causal:
                bad |= j > i
            if inp.sliding_window is not None:
                bad |= (i - j) >= inp.sliding_window
            cols = bad.any(0).nonzero().flatten()
            if cols.numel():
                c0, c1 = int(cols[0]), int(cols[-1]) + 1
                masked = bad[:, c0:c1].repeat_interleave(self.gs, dim=0)
            else:
                c0 = c1 = 0
                masked = None
            self.blocks.append(_Block(a, e, k0, k1, c0, c1, masked))

    def logits(self, qs: torch.Tensor, k: torch.Tensor, blk: _Block) -> torch.Tensor:
        """Scaled, masked (and soft-capped) logits `(b, G, rows·g, keys)` of block `blk`, one matmul per sequence and
        KV group: the very products `loss_and_grads` computes, so both paths round alike."""
        b, G = qs.shape[:2]
        r0, r1, k0, k1 = blk.a * self.gs, blk.e * self.gs, blk.k0, blk.k1
        if torch.is_grad_enabled() and (qs.requires_grad or k.requires_grad):
            s = torch.stack([torch.stack([qs[i, g, r0:r1] @ k[i, g, k0:k1].T for g in range(G)]) for i in range(b)])
        else:
            s = qs.new_empty(b, G, r1 - r0, k1 - k0)
            for i in range(b):
                for g in range(G):
                    torch.mm(qs[i, g, r0:r1], k[i, g, k0:k1].T, out=s[i, g])
        if self.softcap is not None:
            s = torch.tanh(s / self.softcap) * self.softcap
        return self.mask_(s, blk)

    @staticmethod
    def mask_(s: torch.Tensor, blk: _Block) -> torch.Tensor:
        """`-inf` on the masked entries of the logits `s` of block `blk`, in place: adding a 0 / -inf tile (the same
        as filling on finite logits, and ~3x faster than `masked_fill_` on a column slice)."""
        if blk.masked is not None:
            bias = blk.bias.get(s.dtype)
            if bias is None:
                bias = blk.bias[s.dtype] = s.new_zeros(blk.masked.shape).masked_fill_(blk.masked, float("-inf"))
            s[..., blk.c0 : blk.c1].add_(bias)
        return s

    def probs(
        self, qs: torch.Tensor, k: torch.Tensor, dense_for_backward: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """Per block, the probabilities `(b, G, rows·g, keys)` from scaled queries `qs` `(b, G, n·g, d_h)` and keys
        `k` `(b, G, n, d_h)` (the module's scaling already applied to the queries); differentiable. With
        `dense_for_backward`, the softmax backward uses the dense probabilities in `p1` (Algorithm 1, line 12)."""
        out = []
        for t, blk in enumerate(self.blocks):
            s = self.logits(qs, k, blk)
            out.append(
                torch.softmax(s, -1) if dense_for_backward is None else _Alg1Softmax.apply(s, dense_for_backward[t])
            )
        return out

    @torch.no_grad()
    def loss_and_grads(
        self, qs: torch.Tensor, k: torch.Tensor, dense: list[torch.Tensor], literal: bool = False
    ) -> tuple[float, torch.Tensor, torch.Tensor]:
        """`Σ ½‖f̃ − f‖²` over every block (f = `dense`, from `probs`) and its gradients w.r.t. `qs` and `k`
        (no soft-capping). `literal` uses the dense f in `p1` (Algorithm 1, line 12) instead of f̃.

        One tile (query block × one sequence × one KV group, `rows·g × keys` floats: 0.8 MB at g = 3, 128 rows,
        512 keys) at a time, in three preallocated buffers that stay in cache; the matmuls write into their
        destination (`out=`, `addmm_`), the softmax backward is done in place."""
        b, G = qs.shape[:2]
        gs = self.gs
        dk = torch.zeros_like(k)
        dqs = torch.empty_like(qs)
        size = max((blk.e - blk.a) * gs * (blk.k1 - blk.k0) for blk in self.blocks)
        bufs = [qs.new_empty(size) for _ in range(3)]
        tiles = []  # per block: rows, keys, the three buffers viewed as rows × keys, dense probabilities per (i, g)
        for blk, f in zip(self.blocks, dense):
            rows, keys = slice(blk.a * gs, blk.e * gs), slice(blk.k0, blk.k1)
            shape = ((blk.e - blk.a) * gs, blk.k1 - blk.k0)
            tiles.append((blk, rows, keys, *(t[: shape[0] * shape[1]].view(shape) for t in bufs), f.flatten(0, 1)))
        loss = 0.0
        for j in range(b * G):  # one sequence and KV group at a time: its q, k, dq, dk stay in cache
            i, g = divmod(j, G)
            q_j, k_j, dq_j, dk_j = qs[i, g], k[i, g], dqs[i, g], dk[i, g]
            for blk, rows, keys, s, ft, c, f in tiles:
                q_t, k_t, f_t = q_j[rows], k_j[keys], f[j]
                torch.mm(q_t, k_t.T, out=s)
                self.mask_(s, blk)
                torch.ops.aten._softmax.out(s, -1, False, out=ft)
                torch.sub(ft, f_t, out=c)
                cv = c.view(-1)
                loss += float(torch.dot(cv, cv))
                p1 = c.mul_(f_t if literal else ft)
                dS = p1.addcmul_(ft, p1.sum(-1, keepdim=True), value=-1.0)
                torch.mm(dS, k_t, out=dq_j[rows])
                dk_j[keys].addmm_(dS.T, q_t)
        return 0.5 * loss, dqs, dk

    def assemble(self, blocks: list[torch.Tensor], n: int) -> torch.Tensor:
        """The full `(b, G, g, n, n)` probabilities (per KV group, per head) from `probs`' blocks."""
        b, G = blocks[0].shape[:2]
        out = blocks[0].new_zeros(b, G, self.gs, n, n)
        for blk, p in zip(self.blocks, blocks):
            rows = p.view(b, G, blk.e - blk.a, self.gs, -1).transpose(2, 3)
            out[:, :, :, blk.a : blk.e, blk.k0 : blk.k1] = rows
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
