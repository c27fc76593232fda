"""Configuration of FLAP (An et al., AAAI 2024, arXiv 2312.11983)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...config import StructuredPruningConfig, choice

__all__ = ["FLAPConfig"]


@dataclass
class FLAPConfig(StructuredPruningConfig):
    """FLAP: fluctuation-based structured pruning with bias compensation (baseline of Numerical Pruning).

    Paper: https://arxiv.org/abs/2312.11983; formulas from the official code. Inherits the
    `StructuredPruningConfig` fields; `allocation="global"` with `standardize=True` is FLAP's AL-AM structure.

    Args:
        metric (`str`, defaults to `"wifv"`): `"wifv"` (Var(X_j)·‖W_:,j‖²), `"ifv"` (Var(X_j)) or `"wifn"`
            (mean_i |W_ij| · sqrt(mean X_j²)).
        standardize (`bool`, defaults to `True`): standardise each layer's attention and MLP metrics.
        square_attention_metric (`bool`, defaults to `True`): square the attention channel metric, as the code does.
        bias_compensation (`bool | None`, defaults to `None`): add `Σ_{j pruned} mean(X_j)·W_:,j` as a bias of
            o_proj / down_proj (creates the bias where the model has none). `None`: on, except with
            `allocation="servable"` (whose format has no bias) and on architectures whose GGUF graph has no such
            bias (Qwen3, Gemma-3: `ArchitectureSpec.output_bias`), where the pruned model could not be exported with
            it; resolved when pruning starts and recorded in the saved config.
    """

    method = "flap"

    metric: str = "wifv"
    standardize: bool = True
    square_attention_metric: bool = True
    bias_compensation: bool | None = None

    def for_architecture(self, spec) -> FLAPConfig:
        """This config with `bias_compensation=None` resolved for an architecture (its `ArchitectureSpec`: where
        `spec.output_bias`)."""
        if self.bias_compensation is not None:
            return self
        return replace(self, bias_compensation=spec.output_bias and self.compensates_bias)

    def components(self) -> dict:
        """What runs: the fluctuation `metric`, the allocation, and the bias compensation (`"bias"`) or none."""
        return {"scores": self.metric, "standardized": self.standardize, "allocation": self.allocation_mode,
                "refit": "bias" if self.compensates_bias else "none"}  # fmt: skip

    @property
    def adds_biases(self) -> bool:
        return self.compensates_bias

    @property
    def compensates_bias(self) -> bool:
        """`bias_compensation`, with `None` resolved (on unless `allocation="servable"`)."""
        if self.bias_compensation is not None:
            return self.bias_compensation
        return self.allocation != "servable"

    def __post_init__(self) -> None:
        super().__post_init__()
        choice("metric", self.metric, ("wifv", "ifv", "wifn"))
