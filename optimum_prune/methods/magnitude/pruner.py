"""Structured magnitude pruner (data-free)."""

from __future__ import annotations

import torch

from ...functional.masks import keep_mask
from ...modeling.architectures import LayerView, weight_oi
from ..structured import StructuredPruner
from ..unstructured import SequentialPruner
from .config import MagnitudeConfig

__all__ = ["MagnitudePruner"]


def _rows_sq(module, n_units: int, offset_units: int = 0, total_units: int | None = None) -> torch.Tensor:
    """Sum of squares of each unit's rows; a unit is a block of consecutive output rows."""
    W = weight_oi(module).detach().double()
    total_units = total_units or n_units
    per = W.shape[0] // total_units
    W = W[offset_units * per : (offset_units + n_units) * per]
    return (W * W).sum(1).view(n_units, per).sum(1)  # (n_units,)


class MagnitudePruner(StructuredPruner, SequentialPruner):
    """Structured L2-magnitude baseline.

    Lifecycle:
      - score_layer: mean squared weight of each head's q/k/v rows + o columns (KV heads counted with every query
        head that reads them) and of each channel's gate/up rows + down column;
      - allocation and removal as for every structured method; no compensation.
    """

    config_cls = MagnitudeConfig
    requires_calibration = False
    config: MagnitudeConfig

    def score_layer(self, view: LayerView, stats):
        spec, h, kv, d = view.spec, view.num_heads, view.num_kv_heads, view.head_dim
        o = weight_oi(view.o_proj).detach().double()
        head_sq = (o * o).sum(0).view(h, d).sum(1)  # (H,)
        if spec.fused_qkv:
            qkv = view.module(spec.qkv_paths[0])
            head_sq = head_sq + sum(_rows_sq(qkv, h, i * h, 3 * h) for i in range(3))
            numel = d * (weight_oi(qkv).shape[1] * 3 + o.shape[0])
        else:
            q, k, v = (view.module(p) for p in spec.qkv_paths)
            kv_sq = (_rows_sq(k, kv) + _rows_sq(v, kv)).repeat_interleave(view.group_size)  # (H,)
            head_sq = head_sq + _rows_sq(q, h) + kv_sq
            numel = d * (weight_oi(q).shape[1] * 3 + o.shape[0])
        head = head_sq / numel
        down = weight_oi(view.mlp_out).detach().double()
        chan_sq = (down * down).sum(0)  # (I,)
        for p in spec.mlp_in_paths:
            w = weight_oi(view.module(p)).detach().double()
            chan_sq = chan_sq + (w * w).sum(1)
        numel = down.shape[0] + sum(weight_oi(view.module(p)).shape[1] for p in spec.mlp_in_paths)
        return head, chan_sq / numel

    # ------------------------------------------------------------------------------ unstructured / N:M mode
    @property
    def structured(self) -> bool:
        return self.config.pattern == "structured"

    def validate(self, model, spec) -> None:
        if self.structured:
            return super().validate(model, spec)
        SequentialPruner.validate(self, model, spec)

    @property
    def pass_kind(self) -> str:
        return "structured" if self.structured else "layerwise"

    def make_stats(self, dim: int):
        return None

    def prune_weight(self, W: torch.Tensor, stats, path: str) -> torch.Tensor:
        cfg = self.config
        return W * keep_mask(W.abs(), cfg.sparsity, cfg.nm, per=cfg.per)
