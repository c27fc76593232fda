"""Configuration of Numerical Pruning (Shen et al., AAAI 2025, arXiv 2412.12441)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

from ...config import StructuredPruningConfig, choice

# Below these pruning ratios `NumericalConfig(scores="auto")` ranks units by FLAP's fluctuation metric (with a bias
# refit where the architecture takes one), from them by the numerical scores: per allocation, each the first ratio of
# a selection-split grid (0.1-0.35) at which the numerical scores won (why: docs/methods/numerical.md, "The paper's
# setting and our defaults"; SPP's `channel_order="np"` follows the servable one). "global" also serves "uniform"
# and "owl", and an unresolved "auto" (the pruner resolves it first).
LIGHT_RATIOS = {"servable": 0.25, "global": 0.275}

__all__ = ["NumericalConfig"]

# `compensation_strength=None` below it (with the fluctuation ranking): the refit's change shrunk to half, so that it
# fits the calibration text less (docs/methods/numerical.md).
LIGHT_STRENGTH = 0.5
# Under `allocation="servable"` the numerical scores rank raw (not z-scored per module), except on this band of
# pruning ratios [low, high), where a selection-split grid found the standardised scores better (0.35 and 0.4; raw
# better at 0.3 and from 0.45: docs/methods/numerical.md).
SERVABLE_STANDARDIZED_RATIOS = (0.35, 0.45)


@dataclass
class NumericalConfig(StructuredPruningConfig):
    """Numerical Pruning: Newton "numerical scores" of the o_proj / down_proj input channels, global cost-weighted
    ranking of heads (or KV groups) and MLP channels, and closed-form compensation of o_proj / down_proj.

    Paper: https://arxiv.org/abs/2412.12441 (Alg. 1, Eqs. 6-7, Thm. 3). Where the paper leaves a choice open, the
    default is our resolution and every alternative is an option (docs/methods/numerical.md). Inherits the
    `StructuredPruningConfig` fields.

    The defaults standardise each module's scores before the global ranking and damp the refit 10× more than the
    paper's reading; why, with the measurements: docs/methods/numerical.md, "The paper's setting and our defaults".
    The paper's own setting (raw per-module scores, whose mean is
    1 − ρ in every module, so the global ranking degenerates into a per-module quota, and γ = 0.01) is
    `NumericalConfig.paper(pruning_ratio=...)`.

    Args:
        allocation (`str`, defaults to `"auto"`): as in `StructuredPruningConfig`, with `"auto"` the default: the
            DeciLM shapes (`"servable"`: every head kept, MLP channels in blocks of 256 ranked over all layers,
            no bias; vLLM, SGLang, TensorRT-LLM, MLX and llama.cpp load them) where the model allows them, the
            per-layer shapes (`"global"`) elsewhere; why: docs/methods/numerical.md, "The paper's setting and our
            defaults".
        lambda_ (`float | None`, defaults to `None`): weight of the soft count constraint. `None` is the exact
            constraint limit (λ → ∞, scale-free, recommended); a number is dimensionless (× mean diag A).
        solver (`str`, defaults to `"closed_form"`): `"closed_form"` (one solve; the objective is quadratic so
            Newton converges in one step) or `"newton"` (the paper's iterations, for reproduction; needs `lambda_`).
        newton_iters (`int`, defaults to `50`): iterations of the `"newton"` solver.
        score_damping (`float`, defaults to `1e-6`): relative ridge added to A before the solve.
        compensate (`bool`, defaults to `True`): refit the kept input channels of o_proj / down_proj (Thm. 3).
        compensation_damping (`float`, defaults to `0.1`): relative ridge γ / mean(diag H) of the refit; raised
            10× on Cholesky failure. Larger values shrink the refit towards the original weights: less fit to the
            calibration text, more robust on other text.
        ranking (`str`, defaults to `"cost_weighted"`): `"cost_weighted"` (the numerical scores, α = 4·D_h/3 as a
            parameter cost, the FLAP-style threshold; the ratio then counts parameters), `"literal"` (the printed
            formula: head scores × α, unit-count threshold; α is the unit's cost in MLP channels, 4·D_h/3 for an MHA
            head, `(2·n_rep+2)·D_h/3` for a GQA group; reproduction only, it rarely prunes heads) or `"loss"` (an
            extension: each head / KV group / MLP channel scores the output loss its removal leaves after the
            optimal refit, Thm. 3's `L* = tr(W_P ((H⁻¹)_PP)⁻¹ W_Pᵀ)` (`tr(W_P H_PP W_Pᵀ)` without compensation), per
            parameter it removes; absolute, so it compares units across modules and layers; it tends to over-prune
            the first layers, whose residual stream is small; kept for research).
        standardize_per_layer (`bool`, *optional*): z-score each module's scores before the global ranking (FLAP
            does; the paper does not); a head / KV group is expressed in the units of its module's channel scores.
            With `ranking="loss"` the losses are standardised the same way (a unit's loss over its channel count,
            against the module's single-channel losses) instead of divided by the parameters they remove. `None`
            (the default): on, except with `allocation="servable"` and the numerical scores, where only MLP
            channels are ranked across layers and the raw scores ranked better on the selection split at 30% and
            from 45%; on at 35% ≤ ratio < 45%, where a finer grid found them worse (`resolved_standardize`,
            docs/methods/numerical.md).
        head_score (`str`, defaults to `"unit"`): how a head or KV group is scored. `"unit"`: the numerical score of
            the unit itself, the paper's objective solved with one mask per unit (the mask pruning applies; see
            `functional.numerical_scores(unit_size=...)`), so the unit weighs its channels' importance by their
            sum; `"channel_mean"` (the paper's formula): the mean of its channels' scores, which, the scores being
            ≈ 1 − c/importance, ranks it by the harmonic mean of its channels' importance: a few weak channels
            decide, and whole KV groups go too readily.
        score_correlations (`bool`, defaults to `True`): whether the scores (or losses) see the correlations of the
            input channels (the full Gram, as the paper) or only each channel's energy (its diagonal: the
            independence approximation, in which a channel's score or removal loss depends on `‖W_:,j‖²·E[x_j²]`
            alone, or `‖W_:,j‖²·Var(x_j)` with `compensation_bias`, FLAP's metric). The refit always uses the
            full Gram.
        compensation_strength (`float | None`, defaults to `None`): the fraction s of the refit's weight change
            applied, `W + s·(W* − W)` on the kept inputs (as FISTA's `refit_strength`): 1 is the least-squares
            refit, 0 keeps the kept weights (with `compensation_bias`, 0 is FLAP's bias compensation exactly: the
            bias restores the mean output of whatever weights are kept); between the two, the refit fits the
            calibration text less. `None`: 0.5 with the fluctuation metric (light ratios, where the full refit's
            in-domain gain costs out of domain), 1 with the numerical scores and with `allocation="servable"` (no
            bias refit restores the mean a partial refit leaves).
        compensation_inputs (`str`, defaults to `"dense"`): `"dense"` refits on the dense model's inputs (the same
            Grams as the scores; the paper's setting, which leaves it implicit) or `"sequential"` (an extension, not in
            the paper): after the masks are fixed, layers are refitted in order on the inputs produced by the already
            pruned and compensated layers, `W'_K = W·C[:, K]·(X*_KᵀX*_K)⁻¹` with the cross-Gram `C = XᵀX*`.
        scores (`str`, defaults to `"auto"`): what ranks the units. `"numerical"`: the paper's numerical scores
            (above); `"fluctuation"`: FLAP's fluctuation metric `‖W_:,j‖²·Var(x_j)` of each input channel (computed
            from the same Gram and mean; a head scores by the mean of its channels' squared metric, as FLAP's code),
            standardised per module (`standardize_per_layer`) and ranked the same way, NP's closed-form refit still
            compensating (an extension, not in the paper); `"auto"`: `"fluctuation"` below the light ratio,
            `"numerical"` from it; the light ratio is 0.25 with `allocation="servable"` and 0.275 with the per-layer
            allocations (`light_ratio`).
        compensation_bias (`bool | None`, defaults to `None`): refit a bias of o_proj / down_proj together with the
            kept weights (least squares with an intercept, on centred inputs; an extension, not in the paper). It
            subsumes FLAP's bias compensation (the removed channels' mean contribution) and adds bias parameters
            to those projections, as FLAP does. `None`: on with the fluctuation metric (whose variance is centred),
            off with the numerical scores and with `allocation="servable"`, and off where the architecture's GGUF
            graph reads no such bias (Qwen3, Gemma-3: `ArchitectureSpec.output_bias`), so that the default output
            exports.
    """

    method = "numerical"
    # version 2: files of version 1 lacking these fields ran heads as the mean of their channels' scores, the
    # numerical scores at every ratio and the full refit without an intercept
    config_version = 2
    migrations = {
        2: {
            "head_score": "channel_mean",
            "scores": "numerical",
            "compensation_strength": 1.0,
            "compensation_bias": False,
        }
    }

    allocation: str = "auto"
    lambda_: float | None = None
    solver: str = "closed_form"
    newton_iters: int = 50
    score_damping: float = 1e-6
    compensate: bool = True
    compensation_damping: float = 0.1
    compensation_strength: float | None = None
    ranking: str = "cost_weighted"
    standardize_per_layer: bool | None = None
    head_score: str = "unit"
    score_correlations: bool = True
    compensation_inputs: str = "dense"
    compensation_bias: bool | None = None
    scores: str = "auto"

    # derived from the fields, the pruning ratio included: what the calibration pass's cache key must also hold
    resolved_settings: ClassVar[tuple[str, ...]] = (
        "resolved_scores",
        "refit_bias",
        "refit_strength",
        "resolved_standardize",
    )

    @property
    def light_ratio(self) -> float:
        """The pruning ratio below which `scores="auto"` ranks by FLAP's metric: 0.25 with `allocation="servable"`,
        0.275 with the per-layer allocations (`"global"`, `"uniform"`, `"owl"`; `"auto"` before the pruner resolves
        it), where each allocation's selection-split grid put it."""
        return LIGHT_RATIOS.get(self.allocation, LIGHT_RATIOS["global"])

    @property
    def resolved_scores(self) -> str:
        """`scores` with `"auto"` resolved for this pruning ratio (the loss / literal rankings and the Newton solver
        always use the numerical scores)."""
        if self.scores != "auto":
            return self.scores
        plain = self.ranking == "cost_weighted" and self.solver == "closed_form"
        return "fluctuation" if plain and self.pruning_ratio < self.light_ratio else "numerical"

    @property
    def resolved_standardize(self) -> bool:
        """Whether each module's scores are z-scored before the global ranking: `standardize_per_layer`, or with
        `None` everywhere but `allocation="servable"` with the numerical scores outside
        `SERVABLE_STANDARDIZED_RATIOS` (its selection-split grid: raw scores better at 30%, 45% and 50%, worse at 35%
        and 40%; docs/methods/numerical.md)."""
        if self.standardize_per_layer is not None:
            return self.standardize_per_layer
        if self.allocation != "servable" or self.resolved_scores != "numerical":
            return True
        low, high = SERVABLE_STANDARDIZED_RATIOS
        return low <= self.pruning_ratio < high

    @property
    def refit_bias(self) -> bool:
        """Whether the refit fits a bias: `compensation_bias`, or with `None` whether the fluctuation metric ranks
        (never with `allocation="servable"`, whose format has no bias)."""
        if self.compensation_bias is not None:
            return self.compensation_bias
        return self.compensate and self.resolved_scores == "fluctuation" and self.allocation != "servable"

    @property
    def refit_strength(self) -> float:
        """The fraction of the refit's change applied: `compensation_strength`, or with `None` `LIGHT_STRENGTH`
        when the fluctuation metric ranks (with the bias refit: not with `allocation="servable"`) and 1 otherwise."""
        if self.compensation_strength is not None:
            return float(self.compensation_strength)
        return LIGHT_STRENGTH if self.resolved_scores == "fluctuation" and self.allocation != "servable" else 1.0

    @property
    def adds_biases(self) -> bool:
        return self.refit_bias

    @property
    def allocation_mode(self) -> str:
        return "literal" if self.ranking == "literal" else self.allocation

    @property
    def own_allocation(self) -> str | None:
        return "ranking='literal' sets its own allocation" if self.ranking == "literal" else None

    def components(self) -> dict:
        """What runs (`StructuredPruningConfig.components`): the scores (`"numerical"`, FLAP's `"fluctuation"`
        metric, or the removal `"loss"`) and whether they are standardised per module, the allocation, and the refit:
        least squares on the `"dense"` or `"sequential"` inputs with its bias and strength, or `"none"`."""
        refit = {"refit": self.compensation_inputs if self.compensate else "none"}
        if self.compensate:
            refit.update(refit_bias=self.refit_bias, refit_strength=self.refit_strength)
        scores = "loss" if self.ranking == "loss" else self.resolved_scores
        return {"scores": scores, "standardized": self.resolved_standardize, "allocation": self.allocation_mode,
                **refit}  # fmt: skip

    def for_architecture(self, spec) -> NumericalConfig:
        """This config with `compensation_bias=None` resolved for an architecture (its `ArchitectureSpec`): the
        automatic choice where its o_proj / down_proj may carry a bias everywhere (`spec.output_bias`), off where not
        (Qwen3, Gemma-3: their GGUF graphs have no such bias)."""
        if self.compensation_bias is not None:
            return self
        return replace(self, compensation_bias=spec.output_bias and self.refit_bias)

    @classmethod
    def paper(cls, pruning_ratio: float = 0.2, literal: bool = False, **kwargs) -> NumericalConfig:
        """The paper's setting, for reproducing it (docs/methods/numerical.md): each module's exact-constraint
        numerical scores of heads and channels ranked together in one global cost-weighted ranking (α = 4·D_h/3 as a parameter cost), no
        standardisation, a head scored by the mean of its channels' scores, dense compensation of the weights only
        (no bias).

        Args:
            pruning_ratio (`float`, defaults to `0.2`): fraction of the attention + MLP parameters to remove.
            literal (`bool`, defaults to `False`): the printed ranking instead (head scores × α, unit-count
                threshold; `ranking="literal"`).
            kwargs: any other field (e.g. `round_to`, `gqa_mode`).
        """
        settings = {
            "allocation": "global",
            "ranking": "literal" if literal else "cost_weighted",
            "standardize_per_layer": False,
            "head_score": "channel_mean",
            "score_correlations": True,
            "compensation_damping": 0.01,
            "compensation_strength": 1.0,
            "compensate": True,
            "compensation_inputs": "dense",
            "compensation_bias": False,
            "scores": "numerical",
        }
        return cls(pruning_ratio=pruning_ratio, **{**settings, **kwargs})

    def __post_init__(self) -> None:
        super().__post_init__()
        choice("compensation_inputs", self.compensation_inputs, ("dense", "sequential"))
        choice("solver", self.solver, ("closed_form", "newton"))
        choice("ranking", self.ranking, ("cost_weighted", "literal", "loss"))
        choice("head_score", self.head_score, ("unit", "channel_mean"))
        choice("scores", self.scores, ("auto", "numerical", "fluctuation"))
        if self.scores == "fluctuation" and (self.ranking != "cost_weighted" or self.solver != "closed_form"):
            raise ValueError(
                "scores='fluctuation' ranks units by FLAP's metric with the cost-weighted ranking: it takes "
                "ranking='cost_weighted' and solver='closed_form' (the numerical solvers do not apply)."
            )
        if self.ranking == "loss" and self.solver != "closed_form":
            raise ValueError(
                "ranking='loss' ranks units by their removal loss, not by numerical scores: solver='newton' does "
                "not apply (set ranking='cost_weighted' to use it)."
            )
        if self.lambda_ is not None and (not math.isfinite(self.lambda_) or self.lambda_ <= 0):
            raise ValueError(f"`lambda_` must be a positive number or None (exact constraint), got {self.lambda_}.")
        if self.solver == "newton" and self.lambda_ is None:
            raise ValueError(
                "solver='newton' iterates the penalised objective and needs a finite `lambda_` (e.g. 10)."
            )
        if self.compensation_bias is True and not self.compensate:
            raise ValueError("compensation_bias=True refits a bias during compensation: it needs compensate=True.")
        if not isinstance(self.newton_iters, int) or self.newton_iters < 1:
            raise ValueError(f"`newton_iters` must be a positive int, got {self.newton_iters!r}.")
        for name in ("score_damping", "compensation_damping"):
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}` must be >= 0.")
        s = self.compensation_strength
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s <= 1):
            raise ValueError(f"`compensation_strength` must be a number in [0, 1] or None, got {s!r}.")
