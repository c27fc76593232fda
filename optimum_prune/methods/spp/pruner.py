"""SPP pruner: orchestration only (dynamics in `functional.py`, search loop in `search.py`, what it trains on in
`search_data.py`, the path and its cut in `path.py` / `extract.py`, shapes in `modeling.surgery` /
`modeling.pair_attention`)."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import nn

from ...calibration.images import require_classifier
from ...calibration.stats import GramStats
from ...functional.compensation import compensate, compensate_with_bias
from ...functional.fluctuation import fluctuation_scores
from ...functional.gram_scores import numerical_scores
from ...modeling.access import plus_bias
from ...modeling.architectures import ArchitectureSpec, get_layers, layer_view, weight_oi
from ...modeling.surgery import dim_rows
from ...plan import LayerPlan, PruningPlan
from ..base import BasePruner
from .config import NP_ORDER_FLUCTUATION_BELOW, SPPConfig
from .extract import extract_keep
from .masks import folded_weights
from .path import SolutionPath
from .search import run_search
from .search_data import search_dataset

__all__ = ["SPPPruner", "check_pair_support"]


def pair_support_error(model: nn.Module, spec: ArchitectureSpec) -> str | None:
    """Why SPP cannot prune the attention head dimensions of `model`, or `None` when it can."""
    if spec.pair_attention is None:
        return (
            f"SPP cannot prune the QK / VO pairs of {model.config.model_type} models yet (no per-layer head-dimension "
            "attention for this architecture); use prune_attention=False to prune the MLP channels only."
        )
    if spec.rotary and getattr(model.config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        return "SPP ties rotary pairs over the whole head; partial rotary embeddings are not supported."
    return None


def check_pair_support(model: nn.Module, spec: ArchitectureSpec, prune_attention: bool, search: bool = True) -> None:
    """Refuse, before anything changes, a model whose attention head dimensions cannot be pruned (where
    `prune_attention` asks for them), or (`search`) an image model without a classification head (the search trains
    on its cross-entropy)."""
    if search and spec.modality == "image":
        require_classifier(model, "SPP's search")
    error = pair_support_error(model, spec) if prune_attention else None
    if error:
        raise ValueError(error)


def np_channel_keep(W: torch.Tensor, stats: GramStats, width: int, ratio: float) -> torch.Tensor:
    """The `width` input channels of `W` (o_proj / down_proj layout) that Numerical Pruning's scores keep: FLAP's
    fluctuation metric below `NP_ORDER_FLUCTUATION_BELOW`, the numerical scores from it (as `NumericalConfig`'s
    servable default ranks, every head kept), from the Gram and mean in `stats`. Sorted indices."""
    if ratio < NP_ORDER_FLUCTUATION_BELOW:
        scores = fluctuation_scores(W.detach().cpu(), *stats.moments(), standardized=False)
    else:
        scores = numerical_scores(W.detach(), stats.gram.to(W.device), ratio)
    order = torch.sort(scores.double().cpu(), stable=True).indices  # lowest (removed) first
    return order[order.numel() - width :].sort().values


class SPPPruner(BasePruner):
    """Solution Path Pruning (https://arxiv.org/abs/2501.03289).

    Lifecycle:
      - validate: the architecture has the pairs; a given `solution_path` loads and belongs to this model / config;
      - decide_model (the pipeline's whole-model pass kind): search (unless a path is given: `run_search`, a Trainer
        loop on the masks), then cut the path at `pruning_ratio` (`extract_keep`) into per-layer kept q/k, v/o
        dimensions and MLP channels;
      - with `compensate`, the pipeline's dense refit pass: `refit_block_stats` / `refit_layer` refit o_proj /
        down_proj of each block on the Grams of its kept inputs.
    The path of the last search or load is `self.solution_path`.
    """

    config_cls = SPPConfig
    structured = True
    pass_kind = "whole_model"
    config: SPPConfig
    low_memory_refusal = (
        "SPP reads every block's weights at once (its search trains through the whole model; cutting a saved "
        "path checks the weights and folds masks into them), so it does not run on a model loaded with "
        "low_memory=True. Load the model in memory, or use a layer-wise method (NumericalConfig, FLAPConfig)."
    )

    def __init__(self, config: SPPConfig) -> None:
        super().__init__(config)
        self.solution_path: SolutionPath | None = None
        self._data: Any = None
        self._source: Any = None
        self._calibration: dict | None = None
        self.given = config  # as passed: `resolve` gives `self.config`, its per-modality defaults resolved
        self.search_attention = bool(config.prune_attention)  # (`validate`: per architecture)

    @property
    def requires_calibration(self) -> bool:
        return self.config.solution_path is None or self.config.compensate

    def attach_calibration(self, data: Any, description: dict | None = None, source: Any = None) -> None:
        self._data, self._calibration, self._source = data, description, source

    def resolve_config(self, model: nn.Module, spec: ArchitectureSpec) -> SPPConfig:
        """The per-modality defaults, as it runs."""
        return self.given.for_architecture(spec, pair_support_error(model, spec) is None)

    def validate(self, model: nn.Module, spec: ArchitectureSpec) -> None:
        super().validate(model, spec)
        cfg = self.given
        n = len(get_layers(model, spec))
        bad = [i for i in cfg.skip_layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"skip_layers {bad} out of range: the model has {n} layers (0..{n - 1}).")
        check_pair_support(model, spec, cfg.prune_attention is True, search=cfg.solution_path is None)
        self.search_attention = cfg.searches_attention(pair_support_error(model, spec) is None)
        cfg = self.config
        if cfg.solution_path is not None:
            path = SolutionPath.from_pretrained(cfg.solution_path)
            path.check_config(cfg)
            path.check_model(model, spec)
            self.solution_path = path

    def search(self, model: nn.Module, spec: ArchitectureSpec) -> SolutionPath:
        """Run the search on the attached calibration data (the model is unchanged)."""
        if self._data is None:
            raise ValueError("The SPP search needs calibration data: pass `calibration=CalibrationConfig(...)`.")
        labels = self.config.labels_for(spec.modality)
        t0, c0 = time.perf_counter(), time.process_time()
        data = search_dataset(model, self._data, self._source, labels=labels, seed=self.config.seed,
                              seq_len=self.config.search_seq_len)  # fmt: skip
        targets = {"targets_seconds": time.perf_counter() - t0, "targets_cpu_seconds": time.process_time() - c0}
        self.solution_path = run_search(model, spec, self.config, data, self._calibration, self.search_attention)
        self.solution_path.meta.update(targets)  # the windows and their labels, before the loop
        return self.solution_path

    def decide_model(self, model: nn.Module, spec: ArchitectureSpec) -> PruningPlan:
        """Search (unless a path is given) and cut the path at `pruning_ratio`: the plan, before the refit."""
        cfg, self._modality = self.config, spec.modality
        t0 = time.perf_counter()
        if self.solution_path is None:
            self.search(model, spec)
        t1 = time.perf_counter()
        keep, info = extract_keep(self.solution_path, model, spec, cfg)
        plan = PruningPlan(
            info={**info, "solution_path": self.solution_path.summary(), "search_s": t1 - t0,
                  "extract_s": time.perf_counter() - t1, "searched": cfg.solution_path is None},
        )  # fmt: skip
        layers = get_layers(model, spec)
        folded = {i for i, _ in self.solution_path.stats} if cfg.fold_masks else set()
        for i in sorted(set(keep) | folded):
            per = keep.get(i, {})
            view = layer_view(layers[i], i, spec, model.config)
            lp = LayerPlan(keep_vo=per.get("vo"), keep_channels=per.get("mlp"))
            if i in folded:
                masks = {k: st["mask"] for (j, k), st in self.solution_path.stats.items() if j == i}
                lp.weights, lp.biases = folded_weights(view, masks)
            if "qk" in per:
                sel = per["qk"]
                half = view.qk_head_dim // 2
                lp.keep_qk = sel + [j + half for j in sel] if spec.rotary else list(sel)
                if cfg.attention_scale == "reduced":
                    lp.scaling = float(view.attn.scaling) * math.sqrt(view.qk_head_dim / len(lp.keep_qk))
            plan.layers[i] = lp
        plan.info["extract_s"] = time.perf_counter() - t1
        plan.artifacts["solution_path"] = self.solution_path
        return plan

    # ------------------------------------------------------------------------ hooks of the dense refit pass
    @property
    def refits(self) -> bool:
        return self.config.compensate

    def _refit_targets(self, view, plan: LayerPlan | None) -> dict[str, tuple[str, torch.Tensor]]:
        """`{name: (projection path, kept input columns)}` of one block: o_proj on its kept v/o dimensions, the
        MLP's output projection on its kept channels."""
        targets = {}
        if plan is not None and plan.keep_vo is not None:
            targets["attn"] = (view.spec.o_path, dim_rows(view.num_heads, view.vo_head_dim, plan.keep_vo))
        if plan is not None and plan.keep_channels is not None:
            targets["mlp"] = (view.spec.mlp_out_path, torch.as_tensor(plan.keep_channels, dtype=torch.long))
        return targets

    def refit_block_stats(self, view, plan: LayerPlan | None) -> dict[str, tuple[nn.Module, GramStats]]:
        """The Grams of the dense inputs of the projections `_refit_targets` names."""
        return {
            name: (view.module(path), GramStats(weight_oi(view.module(path)).shape[1]))
            for name, (path, _) in self._refit_targets(view, plan).items()
        }

    def refit_layer(self, view, stats: dict[str, GramStats], plan: LayerPlan | None) -> dict:
        """Refit o_proj (its kept v/o inputs) and down_proj / fc2 (its kept channels) of one block by Numerical
        Pruning's closed-form least squares (`functional.compensation.compensate`, or `compensate_with_bias` with
        `compensation_bias`) on the Grams of the dense model's inputs, the change applied at
        `compensation_strength`; returns the residuals."""
        cfg, spec, i, residuals = self.config, view.spec, view.index, {}
        targets = self._refit_targets(view, plan)
        if "mlp" in targets and cfg.channel_order == "np":  # the path's width, NP's channels
            path, width = targets["mlp"][0], len(plan.keep_channels)
            cols = np_channel_keep(weight_oi(view.module(path)), stats["mlp"], width, cfg.pruning_ratio)
            targets["mlp"] = (path, cols)
            plan.keep_channels = cols.tolist()
        for name, (path, cols) in targets.items():
            mod = view.module(path)
            W = weight_oi(mod).detach()
            H, cols = stats[name].gram.to(W.device), cols.to(W.device)
            damping, strength = cfg.compensation_damping, cfg.refit_strength(spec.modality)
            if cfg.compensation_bias:
                plan.weights[path], b, residuals[f"{i}.{name}"] = compensate_with_bias(
                    W, H, stats[name].mean, cols, damping, strength
                )
                plan.biases[path] = plus_bias(b, mod)
            else:
                plan.weights[path], residuals[f"{i}.{name}"] = compensate(W, H, cols, damping, strength)
        return residuals

    def refit_done(self, plan: PruningPlan, residuals: dict, seconds: float) -> None:
        plan.info["compensation_residuals"] = residuals
        plan.info["compensation_strength"] = self.config.refit_strength(self._modality)
        plan.info["compensate_s"] = seconds
