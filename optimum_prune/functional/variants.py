"""The layer-wise error of a sublayer's variants (the shapes a serving format holds), each after its closed-form
refit, from calibration statistics.

- MLP width `w`: the `w` best-ranked channels kept, `down_proj` refitted on them (`compensate`): the loss left is
  Thm. 3's `tr(W_P ((H + γI)⁻¹)_PP)⁻¹ W_Pᵀ)` of the removed set `P` (`removal_losses`), `0` for the full width and
  `tr(W H Wᵀ)` (the sublayer's output energy) for `no_op`.
- Attention with fewer KV heads: the key / value weights of the KV heads that will be one are averaged
  (`merge_kv_weights`), and `o_proj` is refitted from the merged attention's context `z` to the dense output
  `W x` (`refit_loss`, the ridge around the current weights that the sequential refit applies); `no_op`: the
  output energy.

Every loss is per token, in the units of the sublayer's output (the residual stream), so losses of one layer add;
across layers a method scales them (e.g. by the residual stream's energy at the layer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .compensation import damped_cholesky_solve

__all__ = ["adjacent_merges", "merge_kv_weights", "output_energy", "refit_loss", "width_losses"]


def adjacent_merges(num_kv_heads: int, new_kv_heads: int) -> list[list[int]]:
    """KV heads `[0..k)`, `[k..2k)`, ... merged into `new_kv_heads` (which must divide `num_kv_heads`): the grouping
    that keeps every query head in place."""
    if new_kv_heads < 1 or num_kv_heads % new_kv_heads:
        raise ValueError(f"{new_kv_heads} KV heads cannot be merged from {num_kv_heads} in groups of one size.")
    size = num_kv_heads // new_kv_heads
    return [list(range(j * size, (j + 1) * size)) for j in range(new_kv_heads)]


def merge_kv_weights(W: torch.Tensor, merge_kv: Sequence[Sequence[int]], head_dim: int) -> torch.Tensor:
    """A `k_proj` / `v_proj` weight `(num_kv_heads·head_dim, hidden)` whose rows of every member of an entry of
    `merge_kv` hold the mean of the members' rows (the full-size form `LayerPlan.merge_kv` takes)."""
    heads = W.view(-1, head_dim, W.shape[-1]).clone()
    for group in merge_kv:
        idx = torch.as_tensor(list(group), dtype=torch.long, device=W.device)
        heads[idx] = heads.index_select(0, idx).mean(0, keepdim=True)
    return heads.view_as(W)


def output_energy(W: torch.Tensor, H: torch.Tensor) -> float:
    """`E‖W x‖² = tr(W H Wᵀ)` for the input Gram `H` (normalised by the token count)."""
    Wd = W.double()
    return float(torch.einsum("oi,ij,oj->", Wd, H.to(Wd), Wd))


def refit_loss(
    W: torch.Tensor, H_x: torch.Tensor, C: torch.Tensor, H_z: torch.Tensor, damping: float, strength: float = 1.0
) -> float:
    """`E‖W x − W' z‖²` per token for the refit `W' = W + s·Δ`, `Δ = (W C − W H_z)(H_z + γI)⁻¹`: the weight `W` of a
    projection refitted from inputs `z` to the outputs it had on `x`, as the sequential refit does on all input
    columns (`γ = damping · mean(diag H_z)`; `s = strength`).

    Args:
        W (`torch.Tensor` of shape `(d_out, D)`): the dense weight.
        H_x (`torch.Tensor` of shape `(D, D)`): `E[x xᵀ]`.
        C (`torch.Tensor` of shape `(D, D)`): `E[x zᵀ]`.
        H_z (`torch.Tensor` of shape `(D, D)`): `E[z zᵀ]`.
        damping (`float`): relative ridge of the refit.
        strength (`float`): the fraction of the change applied.
    """
    Wd = W.double()
    H_x, C, H_z = (t.to(Wd) for t in (H_x, C, H_z))
    delta = damped_cholesky_solve(H_z, (Wd @ C - Wd @ H_z).T, damping).T
    Wn = Wd + strength * delta
    loss = (Wd @ H_x * Wd).sum() - 2 * (Wd @ C * Wn).sum() + (Wn @ H_z * Wn).sum()
    return max(float(loss), 0.0)


def width_losses(
    W: torch.Tensor, H: torch.Tensor, order: torch.Tensor, widths: Sequence[int], damping: float
) -> dict[int, float]:
    """The per-token output loss of keeping each of `widths` input channels of `W` (`(d_out, D)`, input Gram `H`):
    the `D − w` first channels of `order` (removed first) removed, the rest refitted (Thm. 3's optimum on
    `H + γI`); `w = D` loses nothing, `w = 0` loses the output energy."""
    Wd, Hd = W.double(), H.double().to(W.device)
    D = Wd.shape[1]
    out: dict[int, float] = {}
    inverse = None
    for w in widths:
        if w >= D:
            out[w] = 0.0
            continue
        if w <= 0:
            out[w] = output_energy(Wd, Hd)
            continue
        if inverse is None:
            inverse = damped_cholesky_solve(Hd, torch.eye(D, dtype=Hd.dtype, device=Hd.device), damping)
        P = order[: D - w].to(Wd.device)
        M = inverse[P][:, P]
        M = 0.5 * (M + M.T)
        Wp = Wd[:, P]  # (d_out, p)
        out[w] = max(float((Wp.T * torch.linalg.solve(M, Wp.T)).sum()), 0.0)
    return out
