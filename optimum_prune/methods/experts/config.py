"""Configuration of expert pruning for mixture-of-experts models (REAP, Lasby et al. 2025, arXiv 2510.13999, plus
Numerical Pruning's channel scores and refit inside the experts)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...config import PruningConfig, choice, validate_ratio

__all__ = ["ExpertConfig", "CRITERIA"]

CRITERIA = ("reap", "ean", "frequency", "random")


@dataclass
class ExpertConfig(PruningConfig):
    """Remove whole experts of every mixture-of-experts layer, and channels inside the experts that remain.

    Experts are ranked per layer by `criterion` on the calibration tokens (the router's decisions are recorded in the
    layer-wise calibration pass); the lowest go. Removing an expert removes its weights and its router row: the
    pruned layer routes exactly like the full router with that expert's logit masked to -inf. Then, with
    `channel_ratio > 0`, every kept expert loses the same number of channels (the fused experts have one width per
    layer), each expert its own weakest ones by Numerical Pruning's scores on the tokens routed to it (after the
    expert removal, so the tokens of removed experts count where they now go), and its down projection is refitted
    to them in closed form.

    Args:
        expert_ratio (`float`, defaults to `0.25`): fraction of each MoE layer's experts removed (rounded to a whole
            number of experts). With `allocation="uniform"` every layer keeps the same count and the checkpoint
            loads with stock transformers (`num_experts` / `num_local_experts` changes, `num_experts_per_tok` stays).
        channel_ratio (`float`, defaults to `0.0`): fraction of each kept expert's channels removed (one width for
            every expert of every layer), rounded by `round_to`.
        round_to (`int`, defaults to `32`): keep a multiple of this many channels per expert (the nearest). The
            stock `grouped_mm` experts kernel of transformers needs rows of a multiple of 16 bytes (4 float32 or 8
            bfloat16 channels), and llama.cpp's q8_0 quantizes rows in blocks of 32.
        criterion (`str`, defaults to `"reap"`): how experts are ranked, over the calibration tokens routed to each:
            `"reap"` the mean of router gate × ‖expert output‖ (REAP); `"ean"` the mean ‖expert output‖ alone;
            `"frequency"` how many tokens it received; `"random"` a seeded draw (`seed`; a baseline, no data).
        gate (`str`, defaults to `"softmax"`): REAP's gate: `"softmax"` the router's probability over every expert
            (REAP's reference code), or `"router"` the weight the layer's forward gives the expert's output (top-k
            renormalised where the model renormalises; gpt-oss's softmax over its top-k).
        allocation (`str`, defaults to `"uniform"`): `"uniform"` removes the same number of experts from every layer;
            `"global"` ranks the experts of all layers together by `criterion` (per-layer expert counts: the
            checkpoint then needs optimum_prune's per-layer model type).
        min_experts_per_layer (`int | None`, defaults to `None`): experts each layer keeps at least with
            `allocation="global"`; `None` is the model's `num_experts_per_tok` (the least the router can work with).
        channel_scores (`str`, defaults to `"numerical"`): how channels inside an expert are ranked:
            `"numerical"` Numerical Pruning's closed-form scores of the down projection on the expert's Gram, or
            `"fluctuation"` FLAP's `‖W_:,c‖²·Var(h_c)`.
        compensate (`bool`, defaults to `True`): refit each kept expert's down projection on its kept channels, in
            closed form, on the tokens routed to it.
        compensation_damping (`float`, defaults to `0.1`): relative ridge of that refit (as `NumericalConfig`).
        weighted_refit (`bool`, defaults to `True`): weight each token of an expert's Gram by its squared routing
            weight, so that the refit (and the channel scores) minimise the error of the layer's output rather than
            of the expert's own.
        skip_layers (`tuple[int, ...]`, defaults to `()`): decoder layers left untouched.
    """

    method = "experts"

    expert_ratio: float = 0.25
    channel_ratio: float = 0.0
    round_to: int = 32
    criterion: str = "reap"
    gate: str = "softmax"
    allocation: str = "uniform"
    min_experts_per_layer: int | None = None
    channel_scores: str = "numerical"
    compensate: bool = True
    compensation_damping: float = 0.1
    weighted_refit: bool = True
    skip_layers: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        super().__post_init__()
        validate_ratio("expert_ratio", self.expert_ratio)
        validate_ratio("channel_ratio", self.channel_ratio)
        if self.expert_ratio == 0 and self.channel_ratio == 0:
            raise ValueError("Set `expert_ratio` (whole experts) and / or `channel_ratio` (inside experts) above 0.")
        choice("criterion", self.criterion, CRITERIA)
        choice("gate", self.gate, ("softmax", "router"))
        choice("allocation", self.allocation, ("uniform", "global"))
        choice("channel_scores", self.channel_scores, ("numerical", "fluctuation"))
        if not isinstance(self.round_to, int) or isinstance(self.round_to, bool) or self.round_to < 1:
            raise ValueError(f"`round_to` must be an int >= 1, got {self.round_to!r}.")
        m = self.min_experts_per_layer
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"`min_experts_per_layer` must be an int >= 1 or None, got {m!r}.")
        if self.compensation_damping < 0:
            raise ValueError("`compensation_damping` must be >= 0.")
        self.skip_layers = tuple(int(i) for i in self.skip_layers)

    @property
    def pruning_ratio(self) -> float:
        """The fraction of the expert parameters removed (router rows aside): `1 − (1 − expert_ratio)(1 −
        channel_ratio)`; the report measures it over the attention and MoE parameters."""
        return 1 - (1 - self.expert_ratio) * (1 - self.channel_ratio)

    # what a recipe checks: this config prunes the MLP (the experts) and not the attention
    prune_attention = False
    prune_mlp = True

    def cuts_attention(self, modality: str = "text", pairs: bool = True) -> bool:
        return False
