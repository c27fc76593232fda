"""The serving-shape search: hooks of the pipeline's variant pass kind (`pipeline.passes.variants`).

- score: NP's statistics and channel scores of every block (`block_stats`, `score_block`), and per attention
  variant with fewer KV heads the zeroed form of its merge (`attention_variants`), whose `o_proj` inputs the pass
  pairs with the dense ones; `variant_losses` turns them into each variant's layer-wise loss after its refit
  (`functional.variants`);
- decide: `decide_variants` builds every layer's options (attention × MLP variants the readers load), their costs
  under the target (`costs`) and chooses one per layer (`functional.assembly`): one `LayerPlan` per block;
  `candidate_assemblies` builds the other assemblies of `ServingConfig.candidates`, which the pass refits and
  measures beside the solve;
- refit: NP's sequential refit (`refit_targets` adds the merged attention's `o_proj`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...evaluation.cost_model import NO_OP, CostTable, layer_row_of
from ...functional.allocation import channel_block_path
from ...functional.assembly import choose_options
from ...functional.variants import adjacent_merges, merge_kv_weights, output_energy, refit_loss, width_losses
from ...modeling.architectures import (
    ArchitectureSpec,
    LayerView,
    base_model_type,
    get_layers,
    get_spec,
    layer_view,
    weight_oi,
)
from ...modeling.decilm import FFN_MULTIPLE, QKV_BIASES
from ...modeling.shapes import attention_mlp_params
from ...modeling.surgery import head_rows
from ...plan import LayerPlan
from .pruner import NumericalPruner
from .serving_config import ServingConfig

__all__ = ["ServingPruner", "channel_order", "layer_options"]

logger = logging.getLogger(__name__)


def channel_order(scores: torch.Tensor) -> torch.Tensor:
    """MLP channels in the order they go (lowest score first; ties by index)."""
    return torch.sort(scores.detach().double().cpu(), stable=True).indices


def _kv_counts(view: LayerView) -> list[int]:
    """The KV-head counts a layer can be merged to: divisors of its own count (largest first)."""
    return [k for k in range(view.num_kv_heads, 0, -1) if view.num_kv_heads % k == 0]


def _mergeable(view: LayerView) -> bool:
    """Whether the layer's KV heads may be merged: not where k/v have biases (Qwen2's; a merge averages weights)."""
    return all(getattr(view.module(p), "bias", None) is None for p in view.spec.qkv_paths[1:])


def layer_options(
    view: LayerView, cfg: ServingConfig, kv: int | None = None, last: bool = False
) -> list[tuple[int | str, int | str]]:
    """The `(attention, mlp)` variants layer `view` may take (`kv`: the one KV-head count every layer with attention
    shares under `reader="all"`; `None`: any; `last`: whether `view` is the model's last layer, which keeps a
    sublayer where llama.cpp reads the model: it aborts on a last layer with neither)."""
    if view.index in cfg.skip_layers:  # (none where the shared count is another: that count is not possible)
        return [(view.num_kv_heads, view.intermediate_size)] if kv in (None, view.num_kv_heads) else []
    attention: list[int | str] = _kv_counts(view) if cfg.kv_merge and _mergeable(view) else [view.num_kv_heads]
    if kv is not None:
        attention = [a for a in attention if a == kv]
    if cfg.remove_sublayers and view.index > 0:
        attention.append(NO_OP)
    full = view.intermediate_size
    widths: list[int | str] = sorted({full, *range(FFN_MULTIPLE, full, FFN_MULTIPLE)}, reverse=True)
    options = []
    for a in attention:
        for m in [*widths, NO_OP]:
            if m == NO_OP and (a != NO_OP or not cfg.remove_sublayers):
                continue  # llama.cpp skips a whole layer whose MLP is absent
            if m == NO_OP and last and cfg.reader != "vllm":
                continue
            options.append((a, m))
    return options


def _scaled(losses: dict[int, dict], scale: float) -> dict[int, dict]:
    """`losses` with every layer's attention-removal loss multiplied by `scale`."""
    return {i: {**by, "attention": {v: x * scale if v == NO_OP else x for v, x in by["attention"].items()}}
            for i, by in losses.items()}  # fmt: skip


def _mean_width(chosen: list[dict]) -> float:
    """The mean MLP width of an assembly (no MLP: 0)."""
    widths = [0 if c["mlp"] == NO_OP else int(c["mlp"]) for c in chosen]
    return sum(widths) / max(len(widths), 1)


class ServingPruner(NumericalPruner):
    """See the module docstring and `ServingConfig`."""

    config_cls = ServingConfig
    config: ServingConfig
    pass_kind = "variants"
    low_memory_refusal = (
        "ServingConfig scores every variant of every sublayer on the model in memory; load the model without "
        "low_memory=True (or prune with NumericalConfig, which streams)."
    )

    # ------------------------------------------------------------------------------------------------ checks
    def validate(self, model: nn.Module, spec: ArchitectureSpec) -> None:
        super().validate(model, spec)
        cfg = self.config
        if not (cfg.prune_attention and cfg.prune_mlp):
            raise ValueError("ServingConfig chooses attention and MLP variants together: keep prune_attention and "
                             "prune_mlp True (skip_layers leaves whole layers as they are).")  # fmt: skip
        if spec.fused_qkv:
            raise ValueError("ServingConfig merges KV heads, which needs separate q/k/v projections.")
        base = base_model_type(model.config.model_type)
        if base in QKV_BIASES and cfg.reader != "vllm":
            raise ValueError(
                f"ServingConfig(reader={cfg.reader!r}) on a {base} model: its DeciLM folder carries q/k/v biases, "
                "which TensorRT-LLM drops without an error and llama.cpp's converter cannot take (it fails on the "
                "vocabulary); vLLM, SGLang and MLX load it. Pass reader='vllm'. Nothing was changed."
            )
        if cfg.target == "speed":
            self._check_table(model, cfg.load_cost_table())
        views = [layer_view(layer, i, spec, model.config) for i, layer in enumerate(get_layers(model, spec))]
        self._last_layer = len(views) - 1
        options = [self._options(v) for v in views]
        cheapest = sum(min(self.costs(v, a, m) for a, m in opts) for v, opts in zip(views, options))
        budget = self.budget(model, views)
        if cheapest > budget:
            reach = ""
            if cfg.target == "speed":
                fixed = self._table().fixed_s
                dense = sum(self.costs(v, v.num_kv_heads, v.intermediate_size) for v in views)
                reach = f" The most this table predicts is {(fixed + dense) / (fixed + cheapest):.3f}x."
            raise ValueError(
                f"ServingConfig's {cfg.target} target cannot be met: even the smallest assembly the variants allow "
                f"costs {cheapest:.4g} against a budget of {budget:.4g} ({self._units()}). Relax the target, allow "
                "more variants (kv_merge, remove_sublayers, fewer skip_layers) or, for speed, check the cost table's "
                f"workload.{reach} Nothing was changed."
            )

    def _check_table(self, model: nn.Module, table: CostTable) -> None:
        cfg, config = self.config, model.config
        if table.workload != cfg.parsed_workload:
            raise ValueError(
                f"The cost table was measured at {table.workload.name}, the config's workload is {cfg.workload}: "
                "measure a table at the config's workload (optimum-prune cost-model --workload ...)."
            )
        info = table.info
        hidden = info.get("hidden_size")
        if hidden is not None and hidden != config.hidden_size:
            raise ValueError(
                f"The cost table is for a decoder of hidden size {hidden}, this model's is {config.hidden_size}: "
                "measure one for this model (optimum-prune cost-model MODEL ...)."
            )

    def attach_calibration(self, data, description: dict | None = None, source=None) -> None:
        self._calibration = data  # the end-to-end probes run on its first sequences

    def probe_ids(self) -> torch.Tensor | None:
        """The calibration sequences the end-to-end probes run on (`error_scale="end_to_end"`), else `None`."""
        data = getattr(self, "_calibration", None)
        if self.config.error_scale != "end_to_end" or not isinstance(data, torch.Tensor):
            return None
        rows = max(1, min(len(data), -(-self.config.probe_tokens // data.shape[1])))
        return data[:rows]

    def probe_plans(self, view: LayerView) -> dict[str, LayerPlan]:
        """`{"attention" | "mlp": the zeroed-form plan removing that sublayer}`: what the end-to-end probes run."""
        if self.probe_ids() is None or view.index in self.config.skip_layers:
            return {}
        return {"attention": LayerPlan(keep_heads=[]), "mlp": LayerPlan(keep_channels=[])}

    # ------------------------------------------------------------------------------------------- variants
    def _options(self, view: LayerView, kv: int | None = None) -> list[tuple[Any, Any]]:
        return layer_options(view, self.config, kv, last=view.index == getattr(self, "_last_layer", None))

    def attention_variants(self, view: LayerView) -> dict[int, LayerPlan]:
        """`{KV-head count: the zeroed-form plan of that merge}` for every count below the layer's own."""
        if not self.config.kv_merge or view.index in self.config.skip_layers or not _mergeable(view):
            return {}
        return {k: self.merge_plan(view, k) for k in _kv_counts(view) if k < view.num_kv_heads}

    def merge_plan(self, view: LayerView, kv: int) -> LayerPlan:
        """The plan merging the layer's KV heads into `kv` (adjacent heads together: no query head moves)."""
        groups = adjacent_merges(view.num_kv_heads, kv)
        k_path, v_path = view.spec.qkv_paths[1:]
        weights = {
            p: merge_kv_weights(weight_oi(view.module(p)).detach(), groups, view.head_dim) for p in (k_path, v_path)
        }
        return LayerPlan(merge_kv=groups, weights=weights)

    def variant_losses(
        self,
        view: LayerView,
        acc: dict,
        channel_scores: torch.Tensor,
        merged: dict[int, Any],
        energy: float,
        probes: dict[str, float] | None = None,
    ) -> dict[str, dict]:
        """`{"attention": {variant: loss}, "mlp": {variant: loss}}` of one block (see the module docstring): `acc`
        NP's fed statistics, `channel_scores` NP's MLP channel scores (lower: removed first), `merged[kv]` the
        paired statistics of the `o_proj` inputs under each merge, `energy` the residual stream's `E‖h‖²` leaving
        the block, `probes` the whole model's KL divergence with each sublayer of `probe_plans` removed."""
        cfg = self.config
        out = self._layer_losses(view, acc, channel_scores, merged)
        if cfg.error_scale == "end_to_end" and probes:
            for kind in ("attention", "mlp"):
                removed = out[kind][NO_OP]
                factor = probes[kind] / removed if removed > 0 else 0.0
                out[kind] = {v: loss * factor for v, loss in out[kind].items()}
        elif cfg.error_scale == "residual":
            out = {kind: {v: loss / max(energy, 1e-30) for v, loss in d.items()} for kind, d in out.items()}
        return out

    def _layer_losses(self, view: LayerView, acc: dict, channel_scores: torch.Tensor, merged: dict[int, Any]):
        """Every variant's layer-wise loss per token after its refit, in the units of the sublayer's output."""
        damp, s = self.config.compensation_damping, self.config.refit_strength
        W_o = weight_oi(view.o_proj).detach()
        H_x = acc["attn"].gram
        attention: dict[Any, float] = {view.num_kv_heads: 0.0, NO_OP: output_energy(W_o, H_x)}
        for kv, st in merged.items():
            attention[kv] = refit_loss(W_o, H_x, st.cross.gram, st.pruned.gram, damp, s)
        W_d = weight_oi(view.mlp_out).detach()
        widths = sorted({m for _, m in self._options(view) if m != NO_OP})
        mlp: dict[Any, float] = dict(width_losses(W_d, acc["mlp"].gram, channel_order(channel_scores), widths, damp))
        mlp[NO_OP] = output_energy(W_d, acc["mlp"].gram)
        return {"attention": attention, "mlp": mlp}

    # ---------------------------------------------------------------------------------------------- costs
    def _units(self) -> str:
        return {"speed": "seconds per step", "memory": "bytes", "params": "parameters"}[self.config.target]

    def costs(self, view: LayerView, attention, mlp) -> float:
        """The cost of layer `view` with these variants under the target (seconds, bytes or parameters)."""
        cfg = self.config
        if cfg.target == "speed":
            table = self._table()
            return table.per_layer_s + table.attention_s(attention) + table.mlp_s(mlp)
        d, h, hd = weight_oi(view.o_proj).shape[0], view.num_heads, view.head_dim
        attn = 0 if attention == NO_OP else 2 * d * h * hd + 2 * d * int(attention) * hd
        ffn = 0 if mlp == NO_OP else 3 * d * int(mlp)
        if cfg.target == "params":
            return float(attn + ffn)
        w = cfg.parsed_workload
        cache = 0 if attention == NO_OP else 2 * int(attention) * hd * w.batch * w.context
        return float((attn + ffn + cache) * cfg.memory_dtype_bytes)

    def _table(self) -> CostTable:
        if getattr(self, "_cost_table", None) is None:
            self._cost_table = self.config.load_cost_table()
        return self._cost_table

    def budget(self, model: nn.Module, views: list[LayerView]) -> float:
        """The summed layer cost the target allows."""
        cfg = self.config
        dense = sum(self.costs(v, v.num_kv_heads, v.intermediate_size) for v in views)
        if cfg.target == "params":
            return (1 - cfg.pruning_ratio) * dense
        if cfg.target == "speed":
            total = self._table().fixed_s + dense
            return total / cfg.speedup - self._table().fixed_s
        outside = sum(p.numel() for p in model.parameters()) - attention_mlp_params(model, get_spec(model))
        return cfg.memory_gb * 1e9 - outside * cfg.memory_dtype_bytes

    # --------------------------------------------------------------------------------------------- decide
    def decide_variants(
        self,
        model: nn.Module,
        views: list[LayerView],
        scores: dict[int, tuple],
        losses: dict[int, dict],
        info: dict,
        measure: Callable[[dict], dict] | None = None,
    ) -> dict[int, LayerPlan]:
        """`{block index: LayerPlan}`: one variant per layer under the target (see the module docstring), from each
        block's `(head scores, channel scores)` and `variant_losses`. With `joint_probe_rounds` and `measure` (the
        pass's whole-model probe), each assembly's attention removals are measured together and repriced
        (`_joint_rounds`)."""
        rounds = self.config.joint_probe_rounds if measure is not None else 0
        decided = self._solve(model, views, scores, losses, info)
        return self._joint_rounds(model, views, scores, losses, info, decided, measure, rounds) if rounds else decided

    def _joint_rounds(self, model, views, scores, losses, info, decided, measure, rounds) -> dict[int, LayerPlan]:
        """Re-price the attention removals by the assembly's measured cost, `rounds` times; keep the best estimate.

        Each sublayer's removal was priced by removing it alone, and removing many together may cost the model more
        than the sum (or less). Per assembly, the whole model's KL divergence on the probe sequences is measured
        with every attention the assembly removes removed at once (a removal has no refit, so its zeroed form is
        the removed model; the MLP widths and KV merges keep their losses after their refits, as predicted). The
        assembly's estimated loss is that KL plus the predicted losses of its other variants; the next solve
        multiplies every layer's attention-removal loss by the measured KL over the predicted sum, a calibration at
        the last assembly. Rounds stop early when an assembly repeats or removes no attention. Of the assemblies
        measured, the lowest estimate is kept (ties: the earliest)."""
        scale = 1.0
        tried: list[tuple[float, dict, dict]] = []
        history = []
        first = info
        for r in range(rounds + 1):
            if r:
                info = {}
                decided = self._solve(model, views, scores, _scaled(losses, scale), info)
            chosen = info["assembly"]["variants"]
            if any(chosen == t[1]["assembly"]["variants"] for t in tried):
                break
            removed = [v for v, c in zip(views, chosen) if c["attention"] == NO_OP]
            predicted = sum(losses[v.index]["attention"][NO_OP] for v in removed)
            kl = (
                measure({"attention": [(v, LayerPlan(keep_heads=[])) for v in removed]})["attention"]
                if removed
                else 0.0
            )
            others = sum(losses[v.index]["mlp"][c["mlp"]] + (0.0 if c["attention"] == NO_OP else
                         losses[v.index]["attention"][c["attention"]]) for v, c in zip(views, chosen))  # fmt: skip
            history.append({
                "round": r, "attention_scale": scale, "no_attention": len(removed), "predicted_removal_kl": predicted,
                "measured_removal_kl": kl, "estimate": kl + others, "variants": chosen,
                "mean_mlp_width": _mean_width(chosen),
            })  # fmt: skip
            tried.append((kl + others, info, decided))
            if predicted <= 0:
                break
            scale = min(max(kl / predicted, 1e-2), 1e2)
        best = min(range(len(tried)), key=lambda k: tried[k][0])
        _, info_best, decided = tried[best]
        if info_best is not first:  # the losses recorded stay the unscaled ones
            unscaled = first["variant_losses"]
            first.clear()
            first.update(info_best, variant_losses=unscaled)
        first["joint_probes"] = {"rounds": history, "chosen": best}
        logger.info("serving: joint probes, estimated loss per round %s; kept round %d",
                    [round(h["estimate"], 4) for h in history], best)  # fmt: skip
        return decided

    def _solve(
        self, model: nn.Module, views: list[LayerView], scores: dict[int, tuple], losses: dict[int, dict], info: dict
    ) -> dict[int, LayerPlan]:
        """One knapsack solve (`decide_variants`)."""
        cfg = self.config
        budget = self.budget(model, views)
        shared = [None] if cfg.reader != "all" else sorted({k for v in views for k in _kv_counts(v)}, reverse=True)
        widths = self._width_steps(views, scores)
        best = None
        tried = {}
        for kv in shared:
            options = [self._options(v, kv) for v in views]
            if any(not o for o in options):
                continue
            found = None
            for step, width in enumerate(widths):
                opts = options if width is None else [
                    [(a, m) for a, m in o if m in (w, NO_OP)] for o, w in zip(options, width)
                ]  # fmt: skip
                pairs = [
                    [(self.costs(v, a, m), losses[v.index]["attention"][a] + losses[v.index]["mlp"][m]) for a, m in o]
                    for v, o in zip(views, opts)
                ]
                try:
                    choice, res = choose_options(pairs, budget, cfg.resolution, bound=False)
                except ValueError:
                    continue
                if found is None or res["error"] < found[2]["error"]:
                    found = (opts, choice, res, pairs, step)
            if found is None:
                continue
            opts, choice, res, pairs, step = found
            res.update(choose_options(pairs, budget, cfg.resolution)[1])  # its bound (the same choice)
            tried["any" if kv is None else str(kv)] = {k: res[k] for k in ("error", "cost", "gap")}
            if best is None or res["error"] < best[2]["error"]:
                best = (opts, choice, res, kv, step)
        if best is None:
            raise ValueError(f"No assembly meets the {cfg.target} target (budget {budget:.4g} {self._units()}).")
        options, choice, res, kv, step = best
        chosen = [opts[k] for opts, k in zip(options, choice)]
        info.update(
            allocation="variants",
            assembly={
                "target": cfg.target, "budget": budget, "units": self._units(), "cost": res["cost"],
                "error": res["error"], "lower_bound": res["bound"], "gap": res["gap"], "resolution": cfg.resolution,
                "kv_heads": "per layer" if kv is None else kv, "by_kv_heads": tried,
                "variants": [{"attention": a, "mlp": m} for a, m in chosen], "mlp_widths": cfg.mlp_widths,
            },
        )  # fmt: skip
        if cfg.mlp_widths == "ranked":  # the gap above is that of the problem at the chosen step of the ranking
            info["assembly"].update(ranked_step=step, ranked_steps=len(widths) - 1)
        info["variant_losses"] = [
            {kind: {str(k): float(v) for k, v in losses[v.index][kind].items()} for kind in ("attention", "mlp")}
            for v in views
        ]
        info["assembly"].update(self._predicted_speedup(model, views, chosen))
        logger.info("serving: %s target, chosen (KV heads, MLP width) per layer: %s (gap %.2g)", cfg.target,
                    [(a, m) for a, m in chosen], res["gap"])  # fmt: skip
        return {v.index: self._plan(v, a, m, scores.get(v.index)) for v, (a, m) in zip(views, chosen)}

    def _predicted_speedup(self, model: nn.Module, views: list[LayerView], chosen: list[tuple]) -> dict[str, float]:
        """`{"predicted_speedup": dense over assembled step time}` under a speed target (the cost table's), else
        `{}`."""
        if self.config.target != "speed":
            return {}
        table = self._table()
        rows = [layer_row_of(model.config, a, m) for a, m in chosen]
        dense_rows = [layer_row_of(model.config, v.num_kv_heads, v.intermediate_size) for v in views]
        return {"predicted_speedup": table.predict(dense_rows) / table.predict(rows)}

    def candidate_assemblies(
        self, model: nn.Module, views: list[LayerView], scores: dict[int, tuple], losses: dict[int, dict]
    ) -> dict[str, tuple[dict[int, LayerPlan], dict]]:
        """`{name: (plans, assembly record)}` of every assembly of `ServingConfig.candidates` that meets the target
        (see there); the variants pass refits each, with the solve, and keeps the one it measures best.

        `"mlp_only"` walks NP's servable ranking of channel blocks (`_ranked_widths`) with every attention whole and
        stops at the first step whose cost is within the budget (none: no candidate)."""
        out = {}
        if "mlp_only" in self.config.candidates:
            budget = self.budget(model, views)
            steps = self._ranked_widths(views, scores)
            for step, widths in enumerate(steps):
                cost = sum(self.costs(v, v.num_kv_heads, w) for v, w in zip(views, widths))
                if cost > budget:
                    continue
                chosen = [(v.num_kv_heads, w) for v, w in zip(views, widths)]
                error = sum(losses[v.index]["attention"][a] + losses[v.index]["mlp"][m] for v, (a, m) in
                            zip(views, chosen))  # fmt: skip
                record = {
                    "target": self.config.target, "budget": budget, "units": self._units(), "cost": cost,
                    "error": error, "variants": [{"attention": a, "mlp": m} for a, m in chosen],
                    "mlp_widths": "ranked", "ranked_step": step, "ranked_steps": len(steps) - 1,
                    **self._predicted_speedup(model, views, chosen),
                }  # fmt: skip
                plans = {v.index: self._plan(v, a, m, scores.get(v.index)) for v, (a, m) in zip(views, chosen)}
                out["mlp_only"] = (plans, record)
                break
            else:
                logger.info("serving: no MLP-only assembly meets the %s target: not a candidate", self.config.target)
        return out

    def _ranked_widths(self, views: list[LayerView], scores: dict[int, tuple]) -> list[list[int]]:
        """The MLP width of every layer at each step of NP's servable ranking of channel blocks (step 0: the dense
        widths; layers of `skip_layers` stay whole)."""
        skip = self.config.skip_layers
        ranked = [None if v.index in skip or v.index not in scores else scores[v.index][1] for v in views]
        width = [v.intermediate_size for v in views]
        steps = [list(width)]
        for position, channels in channel_block_path(ranked, FFN_MULTIPLE):
            width[position] -= len(channels)
            steps.append(list(width))
        return steps

    def _width_steps(self, views: list[LayerView], scores: dict[int, tuple]) -> list[list[int] | None]:
        """`[None]` (every layer's widths its own options) for `mlp_widths="knapsack"`; for `"ranked"`, the widths
        at each step of NP's servable ranking (`_ranked_widths`)."""
        if self.config.mlp_widths == "knapsack":
            return [None]
        return self._ranked_widths(views, scores)

    def _plan(self, view: LayerView, attention, mlp, scores) -> LayerPlan:
        lp = self.merge_plan(view, attention) if attention not in (NO_OP, view.num_kv_heads) else LayerPlan()
        if attention == NO_OP:
            lp.keep_heads = []
        if mlp == NO_OP:
            lp.keep_channels = []
        elif int(mlp) < view.intermediate_size:
            order = channel_order(scores[1])
            lp.keep_channels = sorted(int(c) for c in order[view.intermediate_size - int(mlp) :])
        lp.info["variant"] = {"attention": attention, "mlp": mlp}
        return lp

    # ---------------------------------------------------------------------------------------------- refit
    def refit_targets(self, view: LayerView, plan: LayerPlan) -> list[tuple[str, torch.Tensor]]:
        targets = super().refit_targets(view, plan)
        if plan.merge_kv:
            targets.insert(0, (view.spec.o_path, head_rows(range(view.num_heads), view.head_dim)))
        return targets
