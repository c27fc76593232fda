"""Configuration of AMP, attention-matrix pruning (Liang et al., arXiv 2410.11261; docs/methods/amp.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...modeling.targets import normalize_targets
from ..unstructured import UnstructuredPruningConfig, choice

__all__ = ["AMPConfig"]

_SCORE_PATH = ("q_proj", "k_proj")


@dataclass
class AMPConfig(UnstructuredPruningConfig):
    """AMP: real-valued masks on `q_proj` / `k_proj` (initialised to ones) are optimised by gradient descent with
    momentum so that the pruned softmax attention matrix matches the dense one, through the model's real attention
    (GQA, q/k norms and biases, RoPE after masking, scaling, causal mask, sliding window); then each matrix keeps
    its largest mask values. https://arxiv.org/abs/2410.11261 (Alg. 1 and the separate-mask form of §6).

    The defaults are the paper's real-model settings and our resolutions of its ambiguities (docs/methods/amp.md),
    except the ranking (`score`), where the paper's reading measured far worse; each literal reading is one argument
    away.

    Args:
        sparsity (`float`, defaults to `0.5`) / pattern (`str`, defaults to `"unstructured"`): see
            `UnstructuredPruningConfig`. N:M keeps the N largest mask values of every group of M inputs of a row.
        targets (`tuple[str, ...]`, defaults to `("q_proj", "k_proj")`): `"q_proj"` and/or `"k_proj"`; AMP only
            prunes the attention score path (prune v/o and the MLP with another config of a recipe).
        lambda_ (`float`, defaults to `0.05`): λ of the regulariser `½λ(‖M_Q‖² + ‖M_K‖²)` (the setup's λ; Eq. (1)
            printed without λ is `lambda_=1`).
        lr (`float`, defaults to `0.005`): step size η.
        steps (`int`, defaults to `100`): gradient steps T (the paper does not state it for real models).
        momentum (`float`, defaults to `0.9`): heavy-ball β (`0` for plain gradient descent).
        regularizer (`str`, defaults to `"unscaled"`): `"unscaled"` averages the data term over the calibration
            sequences and adds λM as is (the single-sample gradient of the paper's theory); `"divided_by_k"` is
            Algorithm 1 literally, `(η/k)(Σ_j W∘X_jᵀp_jX_j + λM)`.
        gradient (`str`, defaults to `"exact"`): `"exact"` uses `p1 = c∘f̃` (Theorem D.5; autograd);
            `"algorithm1"` uses the dense `f` as printed in Algorithm 1, line 12 (a finite-difference check shows it is
            off by ~1e-2).
        score (`str`, defaults to `"masked_weight"`): binarisation ranks by `|M∘W|`, or by the mask value itself
            (`"mask"`, the paper). Measured on SmolLM2 (`benchmarks/attention.py`, paper λ/η/steps), ranking by the
            mask value gives a relative attention error of 0.76-1.6 at ρ = 0.5 (the masks stay within ~1e-4 of a
            uniform shrink, so their order follows the sign of each entry's gradient, not its importance), against
            0.005-0.05 for `|M∘W|`; hence the default.
        per (`str`, defaults to `"matrix"`): unstructured threshold per matrix (paper) or per `"row"`.
        max_chunk_mb (`float`, defaults to `256`): memory bound of one forward/backward chunk (samples × KV groups);
            the dense probabilities of a layer take another `4·k·H·n²` bytes (see `methods/amp/functional.py`).
        cache_dense (`bool`, defaults to `True`): keep the dense probabilities; `False` recomputes them every step
            (less memory, one dense forward more per step).
    """

    method = "amp"

    targets: tuple[str, ...] | None = _SCORE_PATH
    lambda_: float = 0.05
    lr: float = 0.005
    steps: int = 100
    momentum: float = 0.9
    regularizer: str = "unscaled"
    gradient: str = "exact"
    score: str = "masked_weight"
    per: str = "matrix"
    max_chunk_mb: float = 256.0
    cache_dense: bool = True

    @classmethod
    def paper(cls, sparsity: float = 0.5, **kwargs) -> AMPConfig:
        """The paper's real-model setting, read literally: λ = 0.05, η = 0.005 (§6.2, §6.3), Algorithm 1's update
        `M ← M − (η/k)(Σ_j ∇_j + λM)` (the reading under which the synthetic experiment reproduces, see
        `benchmarks/results/amp_synthetic.md`), binarisation by mask value; 100 steps with momentum 0.9 (the paper
        states neither for real models: its synthetic setting). `kwargs` override any field."""
        fields = {"lambda_": 0.05, "lr": 0.005, "steps": 100, "momentum": 0.9, "regularizer": "divided_by_k"}
        return cls(sparsity=sparsity, **{**fields, "score": "mask", **kwargs})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.targets is None:
            self.targets = _SCORE_PATH
        roles = normalize_targets(self.targets)
        extra = [r for r in roles if r not in _SCORE_PATH]
        if extra:
            raise ValueError(
                f"AMP prunes only the attention score path (q_proj, k_proj), not {extra}. Prune those with another "
                "config of a recipe, e.g. [AMPConfig(), WandaConfig(targets=['v_proj', 'o_proj', 'mlp'])]."
            )
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"`steps` must be a positive int, got {self.steps!r}.")
        for name, lo_ok in (("lr", False), ("lambda_", True), ("max_chunk_mb", False)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"`{name}` must be a finite number > 0, got {v!r}.")
            if v == 0 and not lo_ok:
                raise ValueError(f"`{name}` must be > 0, got {v!r}.")
        if (
            isinstance(self.momentum, bool)
            or not isinstance(self.momentum, (int, float))
            or not 0 <= self.momentum < 1
        ):
            raise ValueError(f"`momentum` must be in [0, 1), got {self.momentum!r}.")
        choice("regularizer", self.regularizer, ("unscaled", "divided_by_k"))
        choice("gradient", self.gradient, ("exact", "algorithm1"))
        choice("score", self.score, ("mask", "masked_weight"))
        choice("per", self.per, ("matrix", "row"))
        if not isinstance(self.cache_dense, bool):
            raise ValueError(f"`cache_dense` must be a bool, got {self.cache_dense!r}.")
