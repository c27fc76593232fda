"""Configuration of AMP, attention-matrix pruning (Liang et al., arXiv 2410.11261; docs/methods/amp.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...config import UnstructuredPruningConfig, choice
from ...modeling.targets import normalize_targets

__all__ = ["AMPConfig"]

_SCORE_PATH = ("q_proj", "k_proj")


@dataclass
class AMPConfig(UnstructuredPruningConfig):
    """AMP: real-valued masks on `q_proj` / `k_proj` rank the weights by how much the softmax attention matrix needs
    them (through the model's real attention: GQA, q/k norms and biases, RoPE after masking, scaling, causal mask,
    sliding window); each matrix keeps its best-ranked weights, then the kept weights are refitted so that the pruned
    attention matrix matches the dense one. https://arxiv.org/abs/2410.11261 (Alg. 1 and the separate-mask form of
    §6).

    The default runs AMP's objective in the regime where its masks carry information: λ relative to the layer's
    curvature, the masks at the equilibrium of the quadratic model (`solver="cg"`), ranking by `|M∘W|·‖X_j‖` per
    row, and a refit of the kept masks (`refit_steps`). The paper's gradient descent from ones with λ = 0.05
    (`solver="descent"`) shrinks every mask nearly uniformly on real models and orders them by a transient; its
    literal setting is `AMPConfig.paper()`. Why these defaults, with the measurements: docs/methods/amp.md, "The
    paper's setting and our defaults".

    Args:
        sparsity (`float`, defaults to `0.5`) / pattern (`str`, defaults to `"unstructured"`): see
            `UnstructuredPruningConfig`. N:M keeps the N best-ranked entries of every group of M inputs of a row.
        targets (`tuple[str, ...]`, defaults to `("q_proj", "k_proj")`): `"q_proj"` and/or `"k_proj"`; AMP only
            prunes the attention score path (prune v/o and the MLP with another config of a recipe).
        solver (`str`, defaults to `"cg"`): `"cg"`: the masks minimising the quadratic model of the objective at
            `M = 1`, `(H + λ)(M − 1) = −λ`, `H` the Gauss-Newton matrix of the attention error, by `cg_steps`
            conjugate-gradient steps, with `λ = lambda_rel × tr(H)/N` (`methods/amp/equilibrium.py`).
            `"descent"`: the paper's heavy-ball descent from ones (`lambda_`, `lr`, `steps`, `momentum`).
        lambda_rel (`float`, defaults to `0.01`): λ as a multiple of the layer's mean curvature per mask entry
            (`solver="cg"`); larger values shrink the masks towards a uniform shrink, whose ranking carries little.
        cg_steps (`int`, defaults to `30`): conjugate-gradient iterations (`solver="cg"`; each costs two gradients).
        precondition (`bool`, defaults to `True`): precondition CG by `diag(H) + λ` (Hutchinson estimate, 8 probes).
            Without it, 30 steps leave the flat directions, the ones a ranking needs, near 1.
        lambda_ (`float`, defaults to `0.05`): λ of the regulariser `½λ(‖M_Q‖² + ‖M_K‖²)` for `solver="descent"`
            (Eq. (1) printed without λ is `lambda_=1`).
        lr (`float`, defaults to `0.005`): step size η (`solver="descent"`).
        steps (`int`, defaults to `100`): gradient steps T (`solver="descent"`; the paper does not state it for real
            models).
        momentum (`float`, defaults to `0.9`): heavy-ball β of the descent and of the refit (`0` for plain gradient
            descent).
        regularizer (`str`, defaults to `"unscaled"`): `"unscaled"` averages the data term over the calibration
            sequences and adds λM as is (the single-sample gradient of the paper's theory); `"divided_by_k"` is
            Algorithm 1 literally, `(η/k)(Σ_j W∘X_jᵀp_jX_j + λM)` (`solver="descent"`).
        gradient (`str`, defaults to `"exact"`): `"exact"` uses `p1 = c∘f̃` (Theorem D.5; autograd);
            `"algorithm1"` uses the dense `f` as printed in Algorithm 1, line 12 (a finite-difference check shows it is
            off by ~1e-2).
        score (`str`, defaults to `"masked_weight_input"`): binarisation ranks by `|M∘W|·‖X_j‖` (Wanda's score with
            AMP's masks), by `|M∘W|` (`"masked_weight"`) or by the mask value itself (`"mask"`, the paper).
        per (`str`, defaults to `"row"`): unstructured threshold per `"row"` (as Wanda) or per `"matrix"` (paper).
        refit_steps (`int`, defaults to `200`): heavy-ball steps on the kept entries' masks after binarisation
            (λ = 0; pruned entries stay zero), so that the kept `W∘M` reproduce the dense attention probabilities;
            `0` keeps the kept weights as they were (the paper).
        refit_target (`str`, defaults to `"layer"`): what the refit reproduces: `"layer"`, the dense weights'
            attention on the inputs this layer receives in the model being pruned; `"model"`, the dense model's own
            attention (its own inputs, carried through the unpruned layers alongside), so that the kept q/k weights
            also correct the drift of their inputs that earlier pruned layers caused (in a recipe: v/o and the MLP
            too). `"model"` costs one more forward of each layer's dense copy; it lowers the error against the dense
            model's attention, but what q and k learn to repair need not carry to new text.
        refit_lr (`float`, defaults to `1.5`): the refit's step as a multiple of `1 / L`, `L` the largest
            curvature of the attention error at `M = 1` (power iteration); heavy ball with β = 0.9 is stable up to
            ~3.8.
        max_chunk_mb (`float`, defaults to `256`): memory bound of one forward/backward chunk (samples × KV groups);
            the dense probabilities of a layer take another `4·k·H·n²` bytes (see `methods/amp/functional.py`).
        cache_dense (`bool`, defaults to `True`): keep the dense probabilities; `False` recomputes them every step
            (less memory, one dense forward more per step).
    """

    method = "amp"
    config_version = 2
    migrations = {2: {"solver": "descent", "refit_steps": 0}}  # version 1 files without them: the descent, no refit

    targets: tuple[str, ...] | None = _SCORE_PATH
    solver: str = "cg"
    lambda_rel: float = 0.01
    cg_steps: int = 30
    precondition: bool = True
    lambda_: float = 0.05
    lr: float = 0.005
    steps: int = 100
    momentum: float = 0.9
    regularizer: str = "unscaled"
    gradient: str = "exact"
    score: str = "masked_weight_input"
    per: str = "row"
    refit_steps: int = 200
    refit_lr: float = 1.5
    refit_target: str = "layer"
    max_chunk_mb: float = 256.0
    cache_dense: bool = True

    @classmethod
    def paper(cls, sparsity: float = 0.5, **kwargs) -> AMPConfig:
        """The paper's real-model setting, read literally: descent from ones, λ = 0.05, η = 0.005 (§6.2, §6.3),
        Algorithm 1's update
        `M ← M − (η/k)(Σ_j ∇_j + λM)` (the reading under which the paper's synthetic experiment reproduces),
        binarisation by mask value; 100 steps with momentum 0.9 (the paper
        states neither for real models: its synthetic setting). `kwargs` override any field."""
        fields = {"solver": "descent", "lambda_": 0.05, "lr": 0.005, "steps": 100, "momentum": 0.9,
                  "regularizer": "divided_by_k", "score": "mask", "per": "matrix", "refit_steps": 0}  # fmt: skip
        return cls(sparsity=sparsity, **{**fields, **kwargs})

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
        for name, lo in (("steps", 1), ("cg_steps", 1), ("refit_steps", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"`{name}` must be an int >= {lo}, got {v!r}.")
        for name, lo_ok in (("lr", False), ("lambda_", True), ("lambda_rel", False), ("refit_lr", False),
                            ("max_chunk_mb", False)):  # fmt: skip
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
        choice("solver", self.solver, ("cg", "descent"))
        choice("regularizer", self.regularizer, ("unscaled", "divided_by_k"))
        choice("gradient", self.gradient, ("exact", "algorithm1"))
        choice("score", self.score, ("mask", "masked_weight", "masked_weight_input"))
        choice("per", self.per, ("matrix", "row"))
        choice("refit_target", self.refit_target, ("layer", "model"))
        for name in ("cache_dense", "precondition"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be a bool, got {getattr(self, name)!r}.")
