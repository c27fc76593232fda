"""Cutting a `SolutionPath` at a pruning ratio: a global threshold on the entry statistic, per pool.

Units are ordered least important first (`functional.removal_order`: latest entry, then smallest `Z`); the walk
removes them until the removed parameters reach the target (`functional.select_removed`), per pool:
  - `"separate"` (the authors' code): attention units (QK + VO, all layers) and MLP channels (all layers) each lose
    the same fraction of their parameters, so that the total is `pruning_ratio` of the attention + MLP parameters;
  - `"per_kind"`: q/k units, v/o units and MLP channels (all layers) each lose that fraction;
  - `"cost_weighted"`: one pool of every unit.
`allocation="uniform"` takes that fraction in every layer and kind instead. Guards keep at least `head_dim_multiple`
q/k and v/o dimensions and `min_mlp_channels_per_layer` channels per layer; then every layer's kept counts are
rounded (q/k and v/o widths to `head_dim_multiple`, MLP widths to `round_to`) along the same order.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ...functional.allocation import round_kept_channels
from ...modeling.architectures import ArchitectureSpec, get_layers, layer_view
from ...modeling.shapes import attention_mlp_params
from .functional import removal_order, select_removed
from .masks import unit_costs
from .path import SolutionPath, SolutionPathError

__all__ = ["extract_keep", "POOLS"]

logger = logging.getLogger(__name__)

POOLS = {
    "separate": {"attention": ("qk", "vo"), "mlp": ("mlp",)},
    "per_kind": {"qk": ("qk",), "vo": ("vo",), "mlp": ("mlp",)},
    "cost_weighted": {"all": ("qk", "vo", "mlp")},
}


def _min_units(kind: str, config, rotary: bool, n: int) -> int:
    """Units a layer keeps at least (guards)."""
    if kind == "mlp":
        return min(n, config.min_mlp_channels_per_layer)
    per_unit = 2 if (kind == "qk" and rotary) else 1
    return min(n, max(1, config.head_dim_multiple // per_unit))


def extract_keep(
    path: SolutionPath, model: nn.Module, spec: ArchitectureSpec, config
) -> tuple[dict[int, dict[str, list[int]]], dict[str, Any]]:
    """The units every layer keeps at `config.pruning_ratio`, as indices into the layer's current units.

    Returns:
        `(keep, info)`: `keep[layer][kind]` lists the kept unit indices of every (layer, kind) that loses any (`qk`
        units are rotary pairs on rotary models); `info` has the per-pool targets, achieved fractions and the lowest
        ratio the path covers.

    Raises:
        `SolutionPathError` for a ratio the path does not reach (more units than ever entered would have to stay,
        unless `config.extrapolate`, which defaults to allowing it on a `"coupled"` path) or the guards forbid.
    """
    views = {i: layer_view(layer, i, spec, model.config) for i, layer in enumerate(get_layers(model, spec))}
    wanted = ({"qk", "vo"} if config.prune_attention else set()) | ({"mlp"} if config.prune_mlp else set())
    keys = [(i, k) for (i, k) in sorted(path.stats, key=lambda x: (x[0], "qk vo mlp".index(x[1])))
            if k in wanted and i not in config.skip_layers]  # fmt: skip
    rotary = bool(path.meta.get("rotary"))
    costs = {i: unit_costs(views[i]) for i in {i for i, _ in keys}}
    total = attention_mlp_params(model, spec)
    pools = {name: [key for key in keys if key[1] in kinds] for name, kinds in POOLS[config.pools].items()}
    pools = {name: ks for name, ks in pools.items() if ks}
    pool_cost = {
        name: sum(costs[i][k] * path.stats[(i, k)]["entry"].numel() for i, k in ks) for name, ks in pools.items()
    }
    frac = config.pruning_ratio * total / max(sum(pool_cost.values()), 1.0)
    if frac >= 1:
        raise SolutionPathError(
            f"pruning_ratio={config.pruning_ratio} would remove more than every prunable unit ({frac:.2f} of them); "
            "lower the ratio or prune both attention and MLP."
        )
    extrapolate = config.extrapolate
    if extrapolate is None:  # "auto": the coupled dynamics rank the units that never entered by Z, ∫ M dt
        extrapolate = path.meta.get("search", {}).get("faithful_to") == "coupled"
    keep: dict[int, dict[str, list[int]]] = {}
    info: dict[str, Any] = {"pools": {}, "covers_ratios_from": 0.0}
    for name, ks in pools.items():
        stat = {s: torch.cat([path.stats[key][s] for key in ks]) for s in ("entry", "record", "z", "gamma")}
        sizes = [path.stats[key]["entry"].numel() for key in ks]
        unit_cost = torch.cat([torch.full((n,), costs[i][k], dtype=torch.float64) for (i, k), n in zip(ks, sizes)])
        groups = torch.cat([torch.full((n,), g, dtype=torch.long) for g, n in enumerate(sizes)])
        caps = [n - _min_units(k, config, rotary, n) for (_, k), n in zip(ks, sizes)]
        order = removal_order(
            stat["entry"], stat["record"], stat["z"], stat["gamma"], config.statistic, config.tie_break
        )
        target = frac * pool_cost[name]
        if config.allocation == "uniform":
            removed = torch.zeros(unit_cost.numel(), dtype=torch.bool)
            for g, n in enumerate(sizes):
                mine = order[groups[order] == g][: min(round(frac * n), caps[g])]
                removed[mine] = True
        else:
            removed = select_removed(order, unit_cost, groups, caps, target)
        never = stat["entry"] < 0
        never_cost = float(unit_cost[never].sum())
        covers = never_cost / pool_cost[name] * sum(pool_cost.values()) / total
        info["covers_ratios_from"] = max(info["covers_ratios_from"], covers)
        at_cap = torch.bincount(groups[removed], minlength=len(sizes)) >= torch.tensor(caps)  # guards keep the rest
        kept_never = float(unit_cost[never & ~removed & ~at_cap[groups]].sum())
        if kept_never > float(unit_cost.max()) and not extrapolate:
            raise SolutionPathError(
                f"pruning_ratio={config.pruning_ratio} is below what this solution path covers: its {name} units that "
                f"entered the path make only {1 - never_cost / pool_cost[name]:.3f} of that pool, so it gives ratios "
                f">= {covers:.3f}. Search longer (`steps`), raise `lr` or lower `lambda_`; or pass extrapolate=True "
                "to keep units that never entered, ranked by their Z."
            )
        done = float(unit_cost[removed].sum())
        if target - done > max(float(unit_cost.max()), 1e-3 * total) and config.allocation != "uniform":
            reachable = sum(c * costs[i][k] for (i, k), c in zip(ks, caps))
            raise SolutionPathError(
                f"pruning_ratio={config.pruning_ratio} cannot be reached: the guards (head_dim_multiple, "
                f"min_mlp_channels_per_layer, skipped layers) let the {name} units lose at most "
                f"{reachable / pool_cost[name]:.3f} of their parameters. Lower the ratio or relax the guards."
            )
        position = torch.empty(order.numel(), dtype=torch.float64)
        position[order] = torch.arange(order.numel(), dtype=torch.float64)  # lower = removed first
        start = 0
        for g, ((i, k), n) in enumerate(zip(ks, sizes)):
            local = removed[start : start + n]
            multiple = 1 if k == "mlp" else max(1, config.head_dim_multiple // (2 if (k == "qk" and rotary) else 1))
            drop = round_kept_channels(
                position[start : start + n], local.nonzero()[:, 0].tolist(),
                config.round_to if k == "mlp" else multiple, caps[g],
            )  # fmt: skip
            if drop:
                dropped = set(drop)
                keep.setdefault(i, {})[k] = [u for u in range(n) if u not in dropped]
            start += n
        info["pools"][name] = {"target_fraction": frac, "selected_fraction": done / pool_cost[name]}
    return keep, info
