"""The fast path of the AMP descent: the data loss `Σ ½‖f̃ − f‖²_F` of one attention module and its gradients with
respect to the (scaled) queries and the keys, without autograd on the n×n tensors.

- Layout: a KV group's query heads are interleaved per position, `(b, G, n·g, d_h)` (row `i·g + h` = position i,
  head h), so that a block of query positions is one contiguous slice and one matmul against the group's keys.
- Causality: the block of positions `[a, e)` only meets the keys it can see (`[0, e)`, or the sliding window);
  only the columns where some entry is masked are filled with `-inf`, with a mask built once.
- Backward in closed form (SPEC §C.2): `c = f̃ − f`, `p1 = c∘f̃` (`c∘f` for Algorithm 1's printed variant),
  `dS = p1 − rowsum(p1)·f̃`, `dq = dS·k`, `dk = dSᵀ·q`: five passes over each block instead of autograd's ten.
The dense probabilities come from the same kernel with the dense weights, so the step-0 loss is exactly zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionInputs, _block_keys

__all__ = ["CausalBlocks", "interleave_heads"]


def interleave_heads(q: torch.Tensor) -> torch.Tensor:
    """`(b, G, g, n, d_h)` queries (per KV group, per head) to the position-major `(b, G, n·g, d_h)` layout."""
    b, G, gs, n, hd = q.shape
    return q.permute(0, 1, 3, 2, 4).reshape(b, G, n * gs, hd)


@dataclass
class _Block:
    a: int  # query positions [a, e)
    e: int
    k0: int  # keys [k0, k1)
    k1: int
    c0: int  # block columns [c0, c1) hold the masked entries (`masked`, rows × (c1 − c0), True = masked)
    c1: int
    masked: torch.Tensor | None


class CausalBlocks:
    """The query blocks of one attention module on sequences of `n` tokens (the masks are built once).

    Args:
        inp (`AttentionInputs`): block size, causal flag and sliding window.
        n (`int`): sequence length.
        device: where the masks live.
    """

    def __init__(self, inp: AttentionInputs, n: int, device=None) -> None:
        self.gs = inp.group_size
        self.blocks: list[_Block] = []
        for a in range(0, n, inp.block_size):
            e, k0, k1 = _block_keys(inp, a, n)
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

    def _probs(self, qs: torch.Tensor, k: torch.Tensor, blk: _Block) -> torch.Tensor:
        s = qs[:, :, blk.a * self.gs : blk.e * self.gs] @ k[:, :, blk.k0 : blk.k1].transpose(-1, -2)
        if blk.masked is not None:
            s[..., blk.c0 : blk.c1].masked_fill_(blk.masked, float("-inf"))
        return torch.softmax(s, dim=-1)

    @torch.no_grad()
    def probs(self, qs: torch.Tensor, k: torch.Tensor) -> list[torch.Tensor]:
        """Per block, the probabilities `(b, G, rows·g, keys)` from scaled queries `qs` `(b, G, n·g, d_h)` and keys
        `k` `(b, G, n, d_h)` (the scaling already applied to the queries)."""
        return [self._probs(qs, k, blk) for blk in self.blocks]

    @torch.no_grad()
    def loss_and_grads(
        self, qs: torch.Tensor, k: torch.Tensor, dense: list[torch.Tensor], literal: bool = False
    ) -> tuple[float, torch.Tensor, torch.Tensor]:
        """`Σ ½‖f̃ − f‖²` over every block (f = `dense`, from `probs`) and its gradients w.r.t. `qs` and `k`.
        `literal` uses the dense f in `p1` (Algorithm 1, line 12) instead of f̃."""
        dk = torch.zeros_like(k)
        dqs, loss = [], 0.0
        for blk, f in zip(self.blocks, dense):
            ft = self._probs(qs, k, blk)
            c = torch.sub(ft, f)
            cv = c.view(-1)
            loss += 0.5 * float(torch.dot(cv, cv))
            p1 = c.mul_(f if literal else ft)
            dS = p1.addcmul_(ft, p1.sum(-1, keepdim=True), value=-1.0)
            del ft
            dqs.append(dS @ k[:, :, blk.k0 : blk.k1])
            dk[:, :, blk.k0 : blk.k1] += dS.transpose(-1, -2) @ qs[:, :, blk.a * self.gs : blk.e * self.gs]
        return loss, torch.cat(dqs, dim=2), dk
