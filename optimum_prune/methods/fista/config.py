"""Configuration of FISTAPruner (Zhao et al., arXiv 2404.09773)."""

from __future__ import annotations

from dataclasses import dataclass

from ..unstructured import UnstructuredPruningConfig, choice

__all__ = ["FISTAConfig"]

# The paper's setting (its LLaMA hyperparameters), applied by `FISTAConfig.paper()`.
_PAPER = {
    "warm_start": "wanda",
    "lam0": 1e-5,
    "xi": 0.3,
    "K": 20,
    "T": 3,
    "eps": 1e-3,
    "intra_layer_correction": True,
    "inter_layer": "dense",
    "ridge": 0.0,
    "rounding_score": "magnitude",
    "refit_strength": 1.0,
}


@dataclass
class FISTAConfig(UnstructuredPruningConfig):
    """FISTAPruner: per projection, the ℓ1-regularised layer-wise reconstruction `½‖W*X* − WX‖² + λ‖W*‖₁` solved
    with FISTA, rounded to the exact pattern, with λ adapted by the rounding-error ratio ξ, and intra-layer error
    correction. https://arxiv.org/abs/2404.09773 (Alg. 1, Eqs. 5, 8, 9; docs/methods/fista.md). Defaults follow the
    paper (LLaMA settings) except the stop rule `eps=1e-2` (paper: 1e-3) and the shrunk re-fit `refit_strength=0.75`
    (paper: 1), measured end to end to generalise better (and, for `eps`, to run at < 3× SparseGPT's time);
    `FISTAConfig.paper()` pins the paper's setting. Our resolutions of the paper's ambiguities are the defaults, the
    literal readings are options.

    Args:
        sparsity (`float`, defaults to `0.5`) / pattern (`str`, defaults to `"unstructured"`): see
            `UnstructuredPruningConfig`.
        warm_start (`str`, defaults to `"wanda"`): `"wanda"` (paper, LLaMA) or `"sparsegpt"` (paper, OPT). On
            SmolLM2-135M (32 × 512 BBC tokens) SparseGPT's start fits the calibration kind of text better (held-out
            BBC perplexity 47.5 vs 48.4 at 50%, 77.7 vs 83.6 at 2:4) and transfers far worse (Python docs 35.6 vs
            30.8, 142.3 vs 96.8): the mask it starts from, not the re-fit, decides the out-of-domain quality.
        lam0 (`float`, defaults to `1e-5`): initial λ.
        xi (`float`, defaults to `0.3`): rounding-error ratio threshold ξ of the λ update.
        K (`int`, defaults to `20`): FISTA iterations per outer step.
        tol (`float`, defaults to `1e-6`): FISTA early stop on ‖W_k − W_{k−1}‖_F.
        T (`int`, defaults to `3`): non-improving outer steps before stopping.
        eps (`float`, defaults to `1e-2`): relative-improvement stop ε (paper: 1e-3 LLaMA, 1e-6 OPT). The paper's
            1e-3 keeps re-fitting the kept weights to the calibration text for ~4× more outer steps (median 6 vs ~23
            per projection on SmolLM2-135M): layer-wise that buys 2.5% on held-out text of the calibration kind and
            costs 3% on text of another kind (`benchmarks/results/fista_generalization_32x512.md`). End to end
            (SmolLM2-135M, 2:4, 32 × 512 BBC tokens, full re-fit), 1e-3 against 1e-2: held-out BBC perplexity 76.4
            vs 83.6, Python docs 106.7 vs 96.8 (`benchmarks/results/unstructured_smollm2_32x512.md`). Pruning time
            with 1e-2: 2.2× (50%) and 2.3× (2:4) SparseGPT's in the same process
            (`unstructured_smollm2_32x512_timing.md`).
            A *smaller* calibration set makes FISTA slower, not faster: an outer step costs the same whatever the
            number of tokens, and with few tokens per input feature the Grams are nearly rank-deficient, so every step
            still fits the calibration windows a little better and the improvement stays above ε for longer. Those
            extra steps overfit. SmolLM2-135M layer 0, 8 × 256 vs 32 × 512 tokens: 50 vs 28 outer steps (q_proj),
            41 vs 19 (gate_proj), 43 vs 31 (down_proj), 1.6× the time; down_proj's held-out reconstruction error ends
            at 1.34× that of its Wanda warm start with 8 × 256 tokens (0.68× with 32 × 512). Calibrate on at least
            ~40 tokens per input feature (128 × 512 for a 135M model; fewer logs a warning): 32 × 512 instead of
            128 × 512 cost FISTA's default 1.5% (50%) and 5% (2:4) of its perplexity on the Python docs. With fewer tokens,
            `eps=1e-2` is 2-3× faster than 1e-3 and overfits less (down_proj 1.05×), while with 32 × 512 it costs
            2-5% of the layer-wise held-out error on text of the calibration kind
            (`benchmarks/results/fista_calibration_size.md`).
        lambda_search (`str`, defaults to `"log"`): `"log"` (bisection on log λ, scale-robust) or `"paper"`
            (arithmetic bisection on [0, 1e6]).
        momentum (`str`, defaults to `"standard"`): `"standard"` Beck–Teboulle or `"paper"` (the printed update).
        rounding_per (`str`, defaults to `"matrix"`): unstructured rounding threshold per matrix (paper) or per row.
            Per row, 50%, SmolLM2-135M (32 × 512): held-out BBC 46.1 vs 46.2, Python docs 25.6 vs 25.3 (16,384
            scored tokens), so the paper's per-matrix threshold stays the default.
        rounding_score (`str`, defaults to `"magnitude"`): what the rounding to the pattern (Eq. 8) ranks:
            `"magnitude"` `|W*_ij|` (paper) or `"wanda"` `|W*_ij| · ||X*_j||` (the norm of the input it multiplies, on
            the calibration tokens, as Wanda's score: the output error each entry alone would add). Measured on
            SmolLM2-135M (32 × 512): 0.3-0.4% better on held-out BBC, 1.3% (50%) and 3% (2:4) worse on the Python
            docs, so the paper's rule stays the default.
        reset_bad_counter (`bool`, defaults to `False`): reset the non-improving counter after an improvement.
        max_outer (`int`, defaults to `200`): safety cap on outer steps per projection (the paper has none; it stops
            only by `T` and `eps`, which on SmolLM2-135M takes at most ~130 steps).
        spectral (`bool`, defaults to `True`): once λ is so small that the soft threshold cannot move the weights by
            more than `tol` within one outer step (the usual case after a few steps of the adaptive λ), run that step's
            FISTA iterations in the eigenbasis of `X*X*ᵀ`, where they cost O(m·n) instead of O(m·n²). Same iterates
            to within `tol`; `False` always iterates in the weight basis.
        intra_layer_correction (`bool`, defaults to `True`): each projection reconstructs the dense output from the
            inputs produced by the already-pruned projections of the same layer (paper); `False` uses dense inputs.
        inter_layer (`str`, defaults to `"dense"`): inputs of the next layer: `"dense"` (paper: layers independent)
            or `"sequential"` (pruned outputs, as Wanda/SparseGPT).
        ridge (`float`, defaults to `0.0`): adds `(δ/2)||W* − W||²` with `δ = ridge · mean(diag X*X*ᵀ)` to each
            projection's objective, pulling the re-optimised weights towards the dense ones in the input directions
            the calibration text barely excites (SparseGPT damps its Hessian the same way, by 1%). Not in the paper.
            Layer-wise, `ridge=0.1` makes FISTA's projections 3% better on text of another kind than the calibration
            set and 2.5% worse on held-out text of the same kind (`benchmarks/results/fista_generalization_32x512.md`),
            as `eps=1e-2` does at 1/3 of the time. End to end (SmolLM2-135M, 32 × 512, 2:4) it is worse on both
            kinds of text: `ridge=0.1` 88.6 / 97.5 and `ridge=0.01` 84.3 / 97.0 against 83.6 / 96.8 without
            (held-out BBC / Python docs perplexity; it also pulls on the entries the rounding zeroes, and so changes
            the mask), so the default stays the paper's `0`; `refit_strength` is the shrinkage that works.
        refit_strength (`float`, defaults to `0.75`): once every projection of a layer is solved, its kept weights
            become `W + s·(W* − W)` on the support of FISTA's solution `W*` (the mask is FISTA's; `s = 1` is the
            paper, `s = 0` the dense weights under that mask). Not in the paper. The re-fit of the kept weights is
            what makes FISTA strong on text of the calibration kind and what costs it on text of another kind:
            SmolLM2-135M, 128 × 512 BBC tokens, 50%, held-out BBC / Python docs perplexity (16,384 tokens each) for
            `s` = 0, 0.25, 0.5, 0.75, 1: 60.5 / 24.0, 53.1 / 23.0, 48.6 / 22.9, 46.1 / 23.5, 45.2 / 24.8 (Wanda
            65.9 / 24.3, SparseGPT 54.2 / 29.7); at 2:4, 204.7 / 75.9, 124.9 / 62.5, 92.5 / 59.0, 78.4 / 61.8,
            73.1 / 70.8 (Wanda 258.7 / 74.9, SparseGPT 91.6 / 84.0). `0.75` has the best product of the two at both
            patterns and both calibration sizes measured (32 and 128 × 512), keeps most of the in-domain gain and
            beats Wanda and SparseGPT on the docs at all of them (`benchmarks/results/unstructured_*.md`); `0.5`
            is best on the docs alone.
    """

    method = "fista"
    config_version = 2
    migrations = {2: {"refit_strength": 1.0}}  # version 1 files without it ran the full re-fit

    warm_start: str = "wanda"
    lam0: float = 1e-5
    xi: float = 0.3
    K: int = 20
    tol: float = 1e-6
    T: int = 3
    eps: float = 1e-2
    lambda_search: str = "log"
    momentum: str = "standard"
    rounding_per: str = "matrix"
    rounding_score: str = "magnitude"
    reset_bad_counter: bool = False
    max_outer: int = 200
    spectral: bool = True
    intra_layer_correction: bool = True
    inter_layer: str = "dense"
    ridge: float = 0.0
    refit_strength: float = 0.75

    @classmethod
    def paper(cls, sparsity: float = 0.5, pattern: str = "unstructured", **kwargs) -> FISTAConfig:
        """The paper's setting (its LLaMA hyperparameters), for reproducing it: Wanda warm start, λ₀ = 1e-5, ξ = 0.3,
        K = 20, T = 3, ε = 1e-3, no ridge, the outer loop stopped and the kept solution chosen on the calibration
        error, intra-layer error correction with dense layer inputs. Our resolutions of the paper's
        ambiguities stay (Beck–Teboulle momentum, log-λ bisection); pass `momentum="paper"`,
        `lambda_search="paper"` for the printed forms.

        Args:
            sparsity (`float`, defaults to `0.5`), pattern (`str`, defaults to `"unstructured"`): the target.
            kwargs: any other field (e.g. `eps`, `max_outer`).
        """
        settings = dict(_PAPER)
        return cls(sparsity=sparsity, pattern=pattern, **{**settings, **kwargs})

    def __post_init__(self) -> None:
        super().__post_init__()
        choice("warm_start", self.warm_start, ("wanda", "sparsegpt"))
        choice("lambda_search", self.lambda_search, ("log", "paper"))
        choice("momentum", self.momentum, ("standard", "paper"))
        choice("rounding_per", self.rounding_per, ("matrix", "row"))
        choice("rounding_score", self.rounding_score, ("magnitude", "wanda"))
        choice("inter_layer", self.inter_layer, ("dense", "sequential"))
        for name in ("K", "T", "max_outer"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be a positive int, got {getattr(self, name)!r}.")
        if not (isinstance(self.ridge, (int, float)) and self.ridge >= 0):
            raise ValueError(f"`ridge` must be a number >= 0 (0: the paper's objective), got {self.ridge!r}.")
        if not (isinstance(self.refit_strength, (int, float)) and 0 <= self.refit_strength <= 1):
            raise ValueError(
                f"`refit_strength` must be in [0, 1] (1: the paper's re-fitted weights, 0: the dense weights under "
                f"FISTA's mask), got {self.refit_strength!r}."
            )
        if not 0 < self.xi < 1:
            raise ValueError(f"`xi` must be in (0, 1), got {self.xi}.")
