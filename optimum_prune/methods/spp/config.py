"""Configuration of Solution Path Pruning (Ding et al., ICLR 2025, arXiv 2501.03289), structured and + RIA."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from ...config import StructuredPruningConfig, UnstructuredPruningConfig, choice
from .search_fields import SEARCH_FIELDS, _SearchFields

__all__ = ["SPPConfig", "SPPRIAConfig", "SEARCH_FIELDS"]

# The extraction's defaults per modality, each chosen on its selection split (why: docs/methods/spp.md, "The paper's
# setting and our defaults"). Language models: the whole ratio from the MLP channels (`prune_attention=None`: the
# search still masks the attention), NP's order within each layer (`channel_order=None`) and the full refit without
# an intercept (`compensation_bias=None`); image models: every kind cut in the path's order, the full refit with an
# intercept. `compensation_strength=None`: the full refit, but half of it with an intercept on a language model (the
# better of the two there, measured when the intercept was the default)
TEXT_BIAS_STRENGTH = 0.5
# `channel_order="np"` ranks a layer's channels by FLAP's fluctuation metric below this pruning ratio and by the
# numerical scores from it: the ratio at which `NumericalConfig(allocation="servable")` switches (a test keeps the two
# equal), since SPP's language-model cut, like the servable allocation, keeps every head and cuts MLP channels.
NP_ORDER_FLUCTUATION_BELOW = 0.25


@dataclass
class SPPConfig(StructuredPruningConfig, _SearchFields):
    """Solution Path Pruning: one search gives the whole family of structures from dense to sparse; any
    `pruning_ratio` is then extracted from the path in seconds (https://arxiv.org/abs/2501.03289; docs/methods/spp.md).

    Masks on the inner dimensions of coupled pairs (QK: head dimensions of q and k, shared by every head of a layer,
    rotary `rotate_half` pairs (j, j + d/2) tied; VO: head dimensions of v and the matching o_proj inputs; MLP:
    channels, gate/up rows + down columns or fc1 rows + fc2 columns) are the only trainable parameters; the weights
    are frozen. A `transformers.Trainer` loop minimises the model's own loss (LM loss for causal LMs) and our
    optimizer runs the Linearized-Bregman dynamics: the mask `M`, its sparse companion `Γ` and the dual `Z`. A unit
    enters the path when `Γ` becomes non-zero; important units enter first. A model at ratio `r` keeps the units that
    entered first (ties broken by `Z`, or `|Γ|`) until the kept parameters make `1 − r` of the attention + MLP ones.
    Removed dimensions are physically sliced; the softmax scale stays that of the original head dimension.

    Inherits `pruning_ratio`, `allocation` (`"global"`: the threshold over all layers; `"uniform"`: the same fraction
    in every layer), `prune_mlp`, `min_mlp_channels_per_layer`, `round_to` (MLP channels) and `skip_layers` from
    `StructuredPruningConfig`; `gqa_mode` and `min_heads_per_layer` do not apply (no head is removed, so GQA groups
    stay intact).

    The defaults differ by modality, each chosen on its selection split (docs/methods/spp.md): on a language model the
    whole ratio comes from the MLP channels, the path setting each layer's width and Numerical Pruning's scores
    choosing the channels, then the full refit without an intercept (the model keeps the dense model's attention and
    adds no bias, so it exports to GGUF); on an image model every kind is cut in the path's order, then the full refit with an
    intercept. The `None` fields below resolve so (`for_architecture`; the report records the resolved values).

    Args:
        prune_attention (`bool | None`, defaults to `None`): cut q/k and v/o head dimensions too (`True`) or MLP
            channels only (`False`, and the search then masks no attention). `None`: the search masks the attention
            wherever SPP can prune it, and the cut keeps it on language models and removes it on image models.
        solution_path (`str | None`, defaults to `None`): a directory written by `SolutionPath.save_pretrained`: the
            ratio is extracted from it with no search, and with no calibration when `compensate=False` (the path
            must come from this model and these settings). `None`: search first (needs calibration).
        pools (`str`, defaults to `"per_kind"`): how the removed parameters are shared out: `"per_kind"` (q/k
            units, v/o units and MLP channels, over all layers, each lose the same fraction of their parameters; the
            path orders the units within each kind), `"separate"` (the authors' code: attention units (QK + VO
            together) and MLP channels each lose that fraction, so the path also decides q/k against v/o) or
            `"cost_weighted"` (one pool: all units by entry, cut where the removed parameters reach the ratio).
            Why `"per_kind"`: docs/methods/spp.md.
        statistic (`str`, defaults to `"entry_time"`): what units are ranked by: `"entry_time"` (the step at which
            `Γ` first became non-zero) or `"step_record"` (the code's count of `interval`s spent in the support).
        tie_break (`str`, defaults to `"z"`): orders units with the same statistic (and units that never entered):
            `"z"` (larger dual `Z` = closer to entering = kept first) or `"gamma"` (larger `|Γ|`).
        extrapolate (`bool | None`, defaults to `None`): allow ratios the path did not reach (the kept units then
            include some that never entered, ranked by `tie_break`); `False` makes such a ratio an error. `None`
            (auto): allowed on a path of the `"coupled"` dynamics, where a unit that never entered has been pulled
            down by the coupling and its `Z` (the time integral of its mask) ranks it; an error on the others.
        head_dim_multiple (`int`, defaults to `8`): keep a multiple of this many q/k and v/o dimensions per head
            (rotary pairs count 2), for GEMM-friendly shapes; `1` keeps the exact widths.
        attention_scale (`str`, defaults to `"original"`): `"original"` keeps `1/√d_h` (the dense model's logits; exact
            for post-training use) or `"reduced"` (`1/√d_qk`, what the authors' `compress_model` does before
            fine-tuning).
        fold_masks (`bool`, defaults to `False`): multiply the searched mask values of the kept units into the
            weights (q/k rows, v rows, down columns or fc1 rows), so the extracted model computes what the masked
            model did at the end of the search; the authors' `compress_model` keeps the weights as they were.
        compensate (`bool`, defaults to `True`): after extraction, refit o_proj on its kept v/o inputs and down_proj
            (fc2) on its kept channels by Numerical Pruning's closed-form least squares (`NumericalConfig`'s
            compensation, on the Grams of the dense model's inputs: one calibration pass, so extracting from a
            saved path then needs calibration data too). Not with `fold_masks`.
        compensation_damping (`float`, defaults to `0.1`): relative ridge of that refit, γ / mean(diag H) (as
            `NumericalConfig.compensation_damping`).
        compensation_strength (`float | None`, defaults to `None`): the fraction s of the refit's change applied,
            `W + s·(W* − W)` on the kept inputs (as `NumericalConfig.compensation_strength`): 1 is the full
            least-squares refit, 0 keeps the extracted weights (with `compensation_bias`, FLAP's bias compensation).
            `None` (`refit_strength(modality)`): 1, but 0.5 with an intercept on a language model (the better of the
            two there on its selection split, docs/methods/spp.md).
        compensation_bias (`bool | None`, defaults to `None`): refit with an intercept
            (`NumericalConfig.compensation_bias`): a bias on o_proj / down_proj restores the mean output the removed
            inputs carried. `None`: on image models, not on language models (whose chosen default keeps the dense
            model's shape without new biases).
        channel_order (`str | None`, defaults to `None`): which MLP channels a layer keeps. `"path"` (the paper):
            those that entered the path first. `"np"` (an extension, not in the paper): the cut of the path still
            sets how many channels every layer keeps, and Numerical Pruning's scores of down_proj's (fc2's) inputs,
            from the refit's Gram, choose which (FLAP's fluctuation metric below `NP_ORDER_FLUCTUATION_BELOW`, the
            numerical scores from it, as `NumericalConfig`'s servable default does): the path's allocation across the layers, NP's
            order within them. Needs `compensate=True`. `None`: `"np"` on language models with the refit, `"path"`
            otherwise. Why: docs/methods/spp.md.
        faithful_to (`str`, defaults to `"coupled"`): the dynamics (docs/methods/spp.md). `"coupled"`: AdamW on the
            gradient of the paper's coupled loss (Eq. 9), `∇L + (M − Γ)/ν`, which pulls every mask towards `Γ` (0
            until the unit enters), then `Z ← Z + lr·κ·(M_{k+1} − Γ)` and the one-sided `Γ = max(Z − λ, 0)`: a unit
            stays up only as far as the loss resists its removal, so important units enter first and dead ones never.
            `"code"` (the authors' released optimizer): an AdamW step on `M` on the task loss only (weight decay 0,
            `eps`, `betas`), then `Z ← Z + s_t·κ·(M_{k+1} − Γ)` with `s_t = lr/(1 − β1^t)`; nothing pulls a mask down
            (the code adds the coupling to the loss after `backward()`, for logging), so a unit with no gradient
            keeps `M = 1` and enters at ≈ λ/lr with the crowd: it ranks dead units mid-path. `"paper"` (Eq. 10):
            `M ← M − κ·lr·(∇L + (M − Γ)/ν)`, `Z ← Z + (lr/ν)(M_k − Γ)`, `Γ = κ·sign(Z)·max(|Z| − λ, 0)`.
        steps (`int`, defaults to `120`): optimizer steps of the search (`epochs` overrides it). A search that
            cannot enter any unit (a unit at `M = 1` reaches `Z = lr·κ·steps` in `"coupled"`, which must pass
            `lambda_`) is refused before it runs.
        epochs (`float | None`, defaults to `None`): passes over the calibration data instead of `steps`.
        batch_size (`int`, defaults to `8`) / gradient_accumulation_steps (`int`, defaults to `1`): sequences per
            step (per device), and accumulation. One sequence a step fits the masks to that sequence's noise; the
            defaults see 960 windows of `search_seq_len` tokens.
        lr (`float`, defaults to `3e-2`): step size (Adam's lr in `"coupled"` / `"code"`, α in `"paper"`).
        lambda_ (`float`, defaults to `1.0`): the soft threshold λ (the code: 3; paper Table 8: 15 or 3). In
            `"coupled"` a unit holding `M ≈ m` enters after ≈ λ/(lr·m) steps (33 steps at `m = 1` with the
            defaults, so the entries spread over the 120 steps down to `m ≈ 0.3`), and a unit with no gradient, whose
            mask falls to 0 in ≈ 1/lr steps, stops at `Z ≈ 0.5 < λ`: it never enters.
        kappa (`float`, defaults to `1`): damping factor κ.
        nu (`float | str`, defaults to `"auto"`): the coupling ν. `"auto"`: one ν per unit kind (q/k, v/o, MLP),
            `nu_scale / RMS(∇_M L)` of that kind's mask gradients at the first step (the gradient scale, from that
            step's own backward pass; recorded in the path's `nu`). A number: that ν for every kind (the paper's
            canonical 100).
        nu_scale (`float`, defaults to `1.0`): with `nu="auto"`, the pull `(M − Γ)/ν` at `M = 1` is `1/nu_scale`
            times the typical loss gradient; larger values pull less (more units enter).
        coupling (`bool`, defaults to `False`): in `"code"`, step AdamW on `∇L + (M − Γ)/ν` (Z still with the
            bias-corrected `s_t`); `"coupled"` and `"paper"` always couple.
        search_labels (`str | None`, defaults to `None`: `"sampled"` on language models, `"dense"` on image
            classifiers, each chosen on its selection split; `"data"` in SPP + RIA): the search's loss. `"data"`:
            the calibration text's next tokens (an image's label). `"sampled"`: next tokens (an image's class) drawn
            from the dense model's own predictions in one no-grad pass before the search, so the loss measures how
            much the masks change the model's output, with zero expected gradient at `M = 1`, instead of how well
            they fit the calibration text. `"dense"`: the KL divergence from the dense model's own predictions (its
            64 most likely outputs per position plus one bucket for the rest, from the same kind of pass): zero,
            with a zero gradient, at `M = 1`, so `nu="auto"` takes the scale of the cross-entropy against the dense
            model's most likely outputs. `"layers"`: the dense model's hidden states, layer by layer: each searched
            layer runs with the masks on the dense model's own input to it, and the loss is its squared error
            against the dense layer's output relative to the layer's own update, averaged over the layers
            (`search_data.LayerwiseLoss`; no output head, so any architecture in the table); zero with a zero gradient at
            `M = 1`, so `nu="auto"` takes the scale of its gradient at masks moved by ±0.1, times 4
            (`search.NU_PROBE_FACTOR`: why there). An option for study, not a recommendation: it measured worse
            than `"sampled"` (docs/methods/spp.md).
        search_seq_len (`int | None`, defaults to `128`; `None` in SPP + RIA): the tokens per window the search trains
            on. Each calibration window of `L` tokens is cut into `round(L / search_seq_len)` consecutive pieces of
            equal length (the same tokens, more windows; the few left over at a window's end are dropped; a window
            that starts with the model's BOS token, as from a tokenizer that prepends one, gives every piece that
            BOS), so that 32 × 512, 64 × 256 and 128 × 128 windows of one text give the same search: the same
            tokens per step, cost per step and gradient scale (which sets `nu="auto"`). `None`: the windows as
            given. Image inputs are never cut.
        betas / eps: Adam's (`"code"`; eps 1e-4 as in the code).
        interval (`int`, defaults to `20`): steps between `step_record` updates (the code's default; 10 in its
            script).
        stop_at_density (`float | None`, defaults to `None`): stop the search once this fraction of the units has
            entered (early stopping; `None`: run every step).
        dropout (`bool`, defaults to `False`): run the search in train mode (dropout on); by default the model runs in
            eval mode, as post-training pruning should.
        training_args (`dict`, defaults to `{}`): more `TrainingArguments` for the search loop (`bf16`,
            `gradient_checkpointing`, `logging_steps`, ...).

    `SPPConfig.code()` and `SPPConfig.paper()` give the authors' literal settings; `SPPConfig(faithful_to="code")`
    their dynamics with our step sizes.
    """

    method = "spp"
    # version 2 added the refit after extraction; files of version 1 that lack its fields ran without it, and a file
    # with `compensate` but without the later fields ran the full refit without an intercept. Version 3 made the
    # extraction's defaults per modality; a file of version 2 without `channel_order` ran the path's order (its
    # `prune_attention` and `compensation_bias` are written as booleans, so it runs as it did)
    config_version = 3
    migrations = {
        2: {"compensate": False, "compensation_strength": 1.0, "compensation_bias": False},
        3: {"channel_order": "path"},
    }

    solution_path: str | None = None
    pools: str = "per_kind"
    statistic: str = "entry_time"
    tie_break: str = "z"
    extrapolate: bool | None = None
    head_dim_multiple: int = 8
    attention_scale: str = "original"
    fold_masks: bool = False
    prune_attention: bool | None = None
    compensate: bool = True
    compensation_damping: float = 0.1
    compensation_strength: float | None = None
    compensation_bias: bool | None = None
    channel_order: str | None = None

    def cuts_attention(self, modality: str = "text", pairs: bool = True) -> bool:
        """Whether the cut removes q/k and v/o dimensions on a model of `modality` (`"text"` or `"image"`, the
        architecture's) whose attention SPP can prune (`pairs`): `prune_attention`, or with `None` on image models
        only."""
        if self.prune_attention is not None:
            return self.prune_attention
        return modality == "image" and pairs

    def searches_attention(self, pairs: bool = True) -> bool:
        """Whether the search puts masks on the q/k and v/o dimensions: `prune_attention`, or with `None` wherever
        SPP can prune the architecture's attention (`pairs`), also where the default cut keeps it: the masks were
        searched so when the MLP-only cut was chosen, and the path then also serves `prune_attention=True`."""
        return self.prune_attention if self.prune_attention is not None else pairs

    def refit_bias(self, modality: str = "text") -> bool:
        """Whether the refit fits an intercept: `compensation_bias`, or with `None` on image models only."""
        return self.compensation_bias if self.compensation_bias is not None else modality == "image"

    def refit_strength(self, modality: str = "text") -> float:
        """The fraction of the refit's change applied to a model of `modality`: `compensation_strength`, or with
        `None` the full refit, `TEXT_BIAS_STRENGTH` of it with an intercept on a language model."""
        if self.compensation_strength is not None:
            return float(self.compensation_strength)
        return TEXT_BIAS_STRENGTH if modality != "image" and self.refit_bias(modality) else 1.0

    def order_of_channels(self, modality: str = "text") -> str:
        """Which MLP channels a layer keeps: `channel_order`, or with `None` NP's order on a language model with
        the refit (whose Gram it scores) and the path's otherwise."""
        if self.channel_order is not None:
            return self.channel_order
        return "np" if modality != "image" and self.compensate else "path"

    def components(self) -> dict:
        """What runs (on the resolved config): the units ranked by their entry into the solution path, the widths per
        layer from the path's cut, the MLP channels kept in the path's order or NP's (`channel_order`), and the
        least-squares refit (with its bias and strength) or none."""
        refit = {"refit": "dense" if self.compensate else "none"}
        if self.compensate:
            refit.update(refit_bias=bool(self.compensation_bias), refit_strength=self.compensation_strength)
        return {"scores": "solution_path", "allocation": "solution_path", "channels": self.channel_order, **refit}

    def for_architecture(self, spec, pairs: bool = True) -> SPPConfig:
        """This config with every per-modality default (`None`) of the extraction resolved for an architecture (its
        `ArchitectureSpec`, whose `modality` decides) whose attention SPP can (`pairs`) or cannot prune: the
        settings as the model is pruned (and as its report records them). The search's own fields stay as given (a
        saved path checks them)."""
        modality = spec.modality
        return dataclasses.replace(
            self,
            prune_attention=self.cuts_attention(modality, pairs),
            compensation_bias=self.refit_bias(modality),
            compensation_strength=self.refit_strength(modality),
            channel_order=self.order_of_channels(modality),
        )

    @classmethod
    def code(cls, pruning_ratio: float = 0.2, **kwargs: Any) -> SPPConfig:
        """The authors' released code: AdamW dynamics, λ = 3, lr 1e-3 (their search script),
        `step_record` ranking every 20 steps, separate pools and the reduced softmax scale of `compress_model` (their
        pipeline fine-tunes afterwards). Ties are still broken by `Z` (the code keeps every tied unit)."""
        settings = {"faithful_to": "code", "lambda_": 3.0, "lr": 1e-3, "nu": 100.0, "interval": 20,
                    "statistic": "step_record", "pools": "separate", "attention_scale": "reduced", "steps": 4000,
                    "search_labels": "data"}  # fmt: skip
        return cls(pruning_ratio=pruning_ratio, **{**settings, **kwargs})

    @classmethod
    def paper(cls, pruning_ratio: float = 0.2, **kwargs: Any) -> SPPConfig:
        """The paper's Eq. 10 with its Table 8 values for DeiT (κ = 1, λ = 15, lr 8e-4) and the canonical ν = 100;
        entry-time ranking. A unit at `M = 1` enters after λν/lr ≈ 1.9 million steps, which is what `steps` is set
        to (a shorter search is refused): these values cannot serve a language model on a CPU."""
        settings = {"faithful_to": "paper", "kappa": 1.0, "lambda_": 15.0, "lr": 8e-4, "nu": 100.0,
                    "statistic": "entry_time", "steps": 2_000_000, "search_labels": "data"}  # fmt: skip
        return cls(pruning_ratio=pruning_ratio, **{**settings, **kwargs})

    def __post_init__(self) -> None:
        if self.prune_attention is None and not self.prune_mlp:
            self.prune_attention = True  # (the attention alone: what prune_mlp=False asks for)
        if self.prune_attention is not None and not isinstance(self.prune_attention, bool):
            raise ValueError(f"`prune_attention` must be True, False or None (per modality), got "
                             f"{self.prune_attention!r}.")  # fmt: skip
        super().__post_init__()
        self._validate_search()
        if self.allocation not in ("global", "uniform"):
            raise ValueError(
                f"SPPConfig takes allocation='global' or 'uniform', not {self.allocation!r} (SPP prunes head "
                "dimensions, which the DeciLM format of allocation='servable' cannot hold)."
            )
        choice("pools", self.pools, ("separate", "per_kind", "cost_weighted"))
        choice("statistic", self.statistic, ("entry_time", "step_record"))
        choice("tie_break", self.tie_break, ("z", "gamma"))
        choice("attention_scale", self.attention_scale, ("original", "reduced"))
        if isinstance(self.head_dim_multiple, bool) or not isinstance(self.head_dim_multiple, int):
            raise ValueError(f"`head_dim_multiple` must be a positive int, got {self.head_dim_multiple!r}.")
        if self.head_dim_multiple < 1:
            raise ValueError(f"`head_dim_multiple` must be >= 1, got {self.head_dim_multiple}.")
        if not isinstance(self.compensate, bool):
            raise ValueError(f"`compensate` must be a bool, got {self.compensate!r}.")
        if self.channel_order is not None:
            choice("channel_order", self.channel_order, ("path", "np"))
        if self.channel_order == "np" and not self.compensate:
            raise ValueError("channel_order='np' picks each layer's MLP channels by scores of the refit's Gram; it "
                             "needs compensate=True (the default).")  # fmt: skip
        if self.compensate and self.fold_masks:
            raise ValueError("compensate=True refits o_proj / down_proj on the dense model's weights; it cannot be "
                             "combined with fold_masks=True (which rescales them). Choose one.")  # fmt: skip
        damping = self.compensation_damping
        if isinstance(damping, bool) or not isinstance(damping, (int, float)) or not damping >= 0:
            raise ValueError(f"`compensation_damping` must be a number >= 0, got {damping!r}.")
        strength = self.compensation_strength
        if strength is not None and (
            isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0 <= strength <= 1
        ):
            raise ValueError(f"`compensation_strength` must be a number in [0, 1] or None (auto), got {strength!r}.")
        if self.compensation_bias is not None and not isinstance(self.compensation_bias, bool):
            raise ValueError(f"`compensation_bias` must be True, False or None (per modality), got "
                             f"{self.compensation_bias!r}.")  # fmt: skip
        if self.extrapolate is not None and not isinstance(self.extrapolate, bool):
            raise ValueError(f"`extrapolate` must be True, False or None (auto), got {self.extrapolate!r}.")
        if self.solution_path is not None:
            if not isinstance(self.solution_path, (str, os.PathLike)):
                raise ValueError(f"`solution_path` must be a directory path, got {self.solution_path!r}.")
            self.solution_path = os.fspath(self.solution_path)


@dataclass
class SPPRIAConfig(UnstructuredPruningConfig, _SearchFields):
    """**Experimental.** SPP combined with RIA for unstructured / N:M LLM pruning (the paper's Table 5; its
    "Algorithm 2" and LLM code were never published, so this is our reconstruction: docs/methods/spp.md).

    One search (as `SPPConfig`'s, same fields) with an elementwise mask on every targeted weight and the LM loss;
    then RIA's layer-by-layer pass (pruned outputs feed the next layer) prunes each matrix's lowest-scoring
    `sparsity` (per matrix, or N:M) with the score chosen by `combine`. The masks cost about six float32 copies of the
    targeted weights in memory during the search (mask, Adam moments, Z, Γ, entry step).

    Args:
        sparsity (`float`, defaults to `0.5`) / pattern (`str`, defaults to `"unstructured"`) / targets: see
            `UnstructuredPruningConfig`.
        combine (`str`, defaults to `"masked"`): how the path enters the score: `"masked"` (RIA of the mask-scaled
            weights `W∘M`), `"scaled"` (RIA(W) times the path's order normalised to [0, 1] per matrix)
            or `"support"` (the units in the path's support at the matching density first, RIA within).
        a (`float`, defaults to `0.5`) / per (`str`, defaults to `"matrix"`): RIA's activation exponent and comparison
            group.
        statistic / tie_break: the path statistic (as in `SPPConfig`).
        Search fields: as in `SPPConfig` (`faithful_to`, `steps`, `lr`, `lambda_`, ...).
    """

    method = "spp_ria"
    search_labels: str | None = "data"  # the loss its results were obtained with
    search_seq_len: int | None = None  # (the same: the calibration windows as given)

    combine: str = "masked"
    a: float = 0.5
    per: str = "matrix"
    statistic: str = "entry_time"
    tie_break: str = "z"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._validate_search()
        choice("combine", self.combine, ("masked", "scaled", "support"))
        choice("per", self.per, ("row", "matrix"))
        choice("statistic", self.statistic, ("entry_time", "step_record"))
        choice("tie_break", self.tie_break, ("z", "gamma"))
