"""**Experimental** SPP + RIA for unstructured / N:M LLM pruning (the paper's Table 5; our reconstruction,
since the paper's "Algorithm 2" and its LLM code were never published).

  1. One search (`search.train_masks`, the same Trainer loop and Bregman dynamics as structured SPP) with an
     elementwise mask on every targeted weight (`W ∘ M`, through `torch.nn.utils.parametrize`), on the LM loss of
     the calibration windows. A local reconstruction loss would have zero gradient at `M = 1` (it is minimal there),
     hence the task loss, and hence one global search rather than one per layer.
  2. RIA's layer-by-layer pass (pruned outputs feed the next layer): each targeted matrix keeps its highest scores,
     per matrix (or per row / N:M group), with the score `SPPRIAConfig.combine` chooses.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize
from transformers.pytorch_utils import Conv1D

from ...calibration.stats import SquaredNormStats
from ...functional.masks import keep_mask
from ...functional.scores import ria_scores
from ...modeling.architectures import ArchitectureSpec, LayerView, Target, get_layers, weight_oi
from ..unstructured import SequentialPruner
from .config import SPPRIAConfig
from .functional import removal_order
from .masks import MaskSet
from .pruner import check_pair_support
from .search import train_masks
from .search_data import search_dataset

__all__ = ["SPPRIAPruner", "path_scores"]


class _Masked(nn.Module):
    """Parametrization `W ↦ W ∘ M` (M in the weight's own layout, also for GPT-2's Conv1D)."""

    def __init__(self, mask: nn.Parameter) -> None:
        super().__init__()
        self.mask = mask

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.mask.to(weight.dtype)


@contextlib.contextmanager
def _parametrized(modules: dict[tuple[int, str], nn.Module], masks: MaskSet):
    """Within the block every module computes with `W ∘ M`; the original weights are restored after."""
    done = []
    try:
        for key, module in modules.items():
            parametrize.register_parametrization(module, "weight", _Masked(masks.get(*key)), unsafe=True)
            done.append(module)
        yield
    finally:
        for module in done:
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)


def path_scores(stats: dict[str, torch.Tensor], statistic: str, tie_break: str) -> torch.Tensor:
    """The path's order as a score in [0, 1] (1 = most important), same shape as the statistics."""
    flat = {k: stats[k].reshape(-1) for k in ("entry", "record", "z", "gamma")}
    order = removal_order(flat["entry"], flat["record"], flat["z"], flat["gamma"], statistic, tie_break)
    score = torch.empty(order.numel(), dtype=torch.float64)
    score[order] = torch.linspace(0, 1, order.numel(), dtype=torch.float64)
    return score.view(stats["entry"].shape)


class SPPRIAPruner(SequentialPruner):
    """SPP + RIA (experimental; see the module docstring).

    Lifecycle: `begin` runs the elementwise search over every targeted projection (the model is unchanged); then,
    per layer: running ‖x_j‖² of the pruned network's inputs → the chosen score → keep mask → zeroed weight.
    """

    config_cls = SPPRIAConfig
    config: SPPRIAConfig

    def __init__(self, config: SPPRIAConfig) -> None:
        super().__init__(config)
        self._data: Any = None
        self._source: Any = None
        self.path_stats: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        self.search_info: dict[str, Any] = {}

    def attach_calibration(self, data: Any, description: dict | None = None, source: Any = None) -> None:
        self._data, self._source = data, source

    def make_stats(self, dim: int):
        return SquaredNormStats(dim)

    def validate(self, model: nn.Module, spec: ArchitectureSpec) -> None:
        super().validate(model, spec)
        check_pair_support(model, spec, prune_attention=False)

    def begin(self, model: nn.Module, spec: ArchitectureSpec) -> None:
        super().begin(model, spec)
        if self._data is None:
            raise ValueError("SPP + RIA searches on calibration data: pass `calibration=CalibrationConfig(...)`.")
        modules = {}
        for i, layer in enumerate(get_layers(model, spec)):
            for path in sorted({t.path for t in self.targets}):
                modules[(i, path)] = layer.get_submodule(path)
        masks = MaskSet({key: tuple(m.weight.shape) for key, m in modules.items()})
        data = search_dataset(
            model,
            self._data,
            self._source,
            "SPP + RIA's search",
            self.config.labels_for(spec.modality),
            self.config.seed,
            self.config.search_seq_len,
        )
        out = train_masks(model, self.config, data, masks, _parametrized(modules, masks))
        entered = sum(int((s["entry"] >= 0).sum()) for s in out["stats"].values())
        total = sum(s["entry"].numel() for s in out["stats"].values())
        self.search_info = {"steps": out["steps"], "search_s": out["seconds"], "entered": entered / max(total, 1)}
        needed = ("mask",) if self.config.combine == "masked" else ("entry", "record", "z", "gamma")
        self.path_stats = {key: {k: st[k] for k in needed} for key, st in out["stats"].items()}

    def prune_target(self, view: LayerView, target: Target, W: torch.Tensor, stats: Any) -> torch.Tensor:
        cfg = self.config
        module = view.module(target.path)
        path = {
            k: v.T if isinstance(module, Conv1D) else v for k, v in self.path_stats[(view.index, target.path)].items()
        }
        rows = target.rows(weight_oi(module).shape[0])
        path = {k: v[rows].to(W.device) for k, v in path.items()}  # (out, in) of this target
        sumsq = stats.sumsq.to(W.device)
        if cfg.combine == "masked":
            scores = ria_scores(W * path["mask"].to(W.dtype), sumsq, a=cfg.a)
        else:
            scores = ria_scores(W, sumsq, a=cfg.a)
            order = path_scores(path, cfg.statistic, cfg.tie_break).to(scores)
            if cfg.combine == "scaled":
                scores = scores * order
            else:  # "support": the units the path holds at the matching density first, RIA inside each part
                scores = scores / scores.max().clamp_min(1e-30) + (order >= cfg.sparsity).to(scores)
        return W * keep_mask(scores, cfg.sparsity, cfg.nm, per=cfg.per)

    def pass_info(self) -> dict:
        return {"search": self.search_info}
