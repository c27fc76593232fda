"""Configuration of FISTAPruner (Zhao et al., arXiv 2404.09773)."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import UnstructuredPruningConfig, choice

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
    correction. https://arxiv.org/abs/2404.09773 (Alg. 1, Eqs. 5, 8, 9). Defaults follow the paper (LLaMA settings)
    except the stop rule `eps=1e-2` (paper: 1e-3) and the shrunk re-fit `refit_strength=0.75` (paper: 1);
    `FISTAConfig.paper()` pins the paper's setting. Our resolutions of the paper's ambiguities are the defaults, the
    literal readings are options. Why these defaults, with the measurements: docs/methods/fista.md, "The paper's
    setting and our defaults".

    Args:
        sparsity (`float`, defaults to `0.5`) / pattern (`str`, defaults to `"unstructured"`): see
            `UnstructuredPruningConfig`.
        warm_start (`str`, defaults to `"wanda"`): the solution each projection starts from: `"wanda"` (paper, LLaMA)
            or `"sparsegpt"` (paper, OPT). The starting mask largely decides how the result transfers to text unlike
            the calibration text.
        lam0 (`float`, defaults to `1e-5`): initial λ.
        xi (`float`, defaults to `0.3`): rounding-error ratio threshold ξ of the λ update.
        K (`int`, defaults to `20`): FISTA iterations per outer step.
        tol (`float`, defaults to `1e-6`): FISTA early stop on ‖W_k − W_{k−1}‖_F.
        T (`int`, defaults to `3`): non-improving outer steps before stopping.
        eps (`float`, defaults to `1e-2`): relative-improvement stop ε (paper: 1e-3 LLaMA, 1e-6 OPT): smaller values
            run more outer steps, which re-fit the kept weights closer to the calibration text. A *smaller*
            calibration set makes FISTA slower, not faster (nearly rank-deficient Grams keep the improvement above ε
            for longer); calibrate on at least ~40 tokens per input feature (fewer logs a warning).
        lambda_search (`str`, defaults to `"log"`): `"log"` (bisection on log λ, scale-robust) or `"paper"`
            (arithmetic bisection on [0, 1e6]).
        momentum (`str`, defaults to `"standard"`): `"standard"` Beck–Teboulle or `"paper"` (the printed update).
        rounding_per (`str`, defaults to `"matrix"`): unstructured rounding threshold per matrix (paper) or per row.
        rounding_score (`str`, defaults to `"magnitude"`): what the rounding to the pattern (Eq. 8) ranks:
            `"magnitude"` `|W*_ij|` (paper) or `"wanda"` `|W*_ij| · ||X*_j||` (the norm of the input it multiplies, on
            the calibration tokens, as Wanda's score: the output error each entry alone would add).
        reset_bad_counter (`bool`, defaults to `False`): reset the non-improving counter after an improvement.
        max_outer (`int`, defaults to `200`): safety cap on outer steps per projection (the paper has none; it stops
            only by `T` and `eps`).
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
            the calibration text barely excites (SparseGPT damps its Hessian the same way, by 1%). Not in the paper;
            it also pulls on the entries the rounding zeroes, and so changes the mask.
        refit_strength (`float`, defaults to `0.75`): once every projection of a layer is solved, its kept weights
            become `W + s·(W* − W)` on the support of FISTA's solution `W*` (the mask is FISTA's; `s = 1` is the
            paper, `s = 0` the dense weights under that mask). Not in the paper. The re-fit of the kept weights fits
            the calibration kind of text; shrinking it trades some of that fit for text of other kinds.
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
