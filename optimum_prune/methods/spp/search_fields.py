"""The search's fields, shared by `SPPConfig` and `SPPRIAConfig` (documented there and in docs/methods/spp.md)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ...config import choice
from .functional import reachable_z

__all__ = ["SEARCH_FIELDS", "TEXT_LABELS", "IMAGE_LABELS"]

# `search_labels=None`: the search's loss per modality, each chosen on its selection split (docs/methods/spp.md): next
# tokens drawn from the dense model on language models, the KL divergence from the dense classifier on image models
TEXT_LABELS = "sampled"
IMAGE_LABELS = "dense"


@dataclass
class _SearchFields:
    """Fields of the search; documented in `SPPConfig` and docs/methods/spp.md."""

    faithful_to: str = "coupled"
    steps: int = 120
    epochs: float | None = None
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    lr: float = 3e-2
    lambda_: float = 1.0
    kappa: float = 1.0
    nu: float | str = "auto"
    nu_scale: float = 1.0
    coupling: bool = False
    search_labels: str | None = None  # per modality (`labels_for`); SPP + RIA: "data"
    search_seq_len: int | None = 128  # SPP + RIA: None
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-4
    interval: int = 20
    stop_at_density: float | None = None
    dropout: bool = False
    training_args: dict[str, Any] = field(default_factory=dict)

    def _validate_search(self) -> None:
        choice("faithful_to", self.faithful_to, ("coupled", "code", "paper"))
        if self.search_labels is not None:
            choice("search_labels", self.search_labels, ("data", "sampled", "dense", "layers"))
        for name in ("steps", "batch_size", "gradient_accumulation_steps", "interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
        n = self.search_seq_len
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 2):
            raise ValueError(f"`search_seq_len` must be an int >= 2 (tokens per search window) or None (the calibration "
                             f"windows as given), got {n!r}.")  # fmt: skip
        if self.nu != "auto" and (isinstance(self.nu, (bool, str)) or not isinstance(self.nu, (int, float))
                                  or not math.isfinite(self.nu) or self.nu <= 0):  # fmt: skip
            raise ValueError(f"`nu` must be 'auto' or a positive number, got {self.nu!r}.")
        for name in ("lr", "kappa", "nu_scale", "eps"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"`{name}` must be a positive number, got {value!r}.")
        if not isinstance(self.lambda_, (int, float)) or not math.isfinite(self.lambda_) or self.lambda_ < 0:
            raise ValueError(f"`lambda_` (the soft threshold) must be a number >= 0, got {self.lambda_!r}.")
        if self.epochs is not None and (not isinstance(self.epochs, (int, float)) or self.epochs <= 0):
            raise ValueError(f"`epochs` must be a positive number or None (use `steps`), got {self.epochs!r}.")
        self.betas = tuple(float(b) for b in self.betas)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"`betas` must be two numbers in [0, 1), got {self.betas!r}.")
        if not isinstance(self.coupling, bool):
            raise ValueError(f"`coupling` must be a bool, got {self.coupling!r}.")
        if self.stop_at_density is not None and not 0 < self.stop_at_density <= 1:
            raise ValueError(f"`stop_at_density` must be in (0, 1] or None, got {self.stop_at_density!r}.")
        if not isinstance(self.training_args, dict):
            raise ValueError(f"`training_args` must be a dict of TrainingArguments, got {self.training_args!r}.")
        self.check_search_length(self.steps if self.epochs is None else None)

    def check_search_length(self, steps: int | None, nu: float | None = None) -> None:
        """Raise a `ValueError` when `steps` steps cannot enter any unit: a unit whose mask stays at 1 reaches
        `Z = reachable_z(...)`, and enters only once `Z > lambda_` (`nu`: the coupling of `"paper"`, needed there;
        `None` with `nu="auto"` skips that check until ν is measured). `steps=None` (an `epochs` search) checks
        nothing."""
        if steps is None:
            return
        if self.faithful_to == "paper":
            nu = nu if nu is not None else (None if self.nu == "auto" else float(self.nu))
            if nu is None:
                return
        z = reachable_z(self.faithful_to, steps, self.lr, self.kappa, nu or 1.0, self.betas)
        if z <= self.lambda_:
            raise ValueError(
                f"A search of {steps} steps cannot enter any unit into the path: with lr={self.lr}, kappa={self.kappa}"
                f"{'' if self.faithful_to != 'paper' else f', nu={nu:.4g}'} and faithful_to={self.faithful_to!r} the "
                f"dual Z of a unit whose mask stays at 1 reaches only {z:.3g}, below lambda_={self.lambda_}. Search "
                "longer (`steps`), raise `lr` or lower `lambda_`."
            )

    def labels_for(self, modality: str = "text") -> str:
        """The search's loss on a model of `modality` (`"text"` or `"image"`, the architecture's): `search_labels`,
        or with `None` `TEXT_LABELS` / `IMAGE_LABELS`."""
        if self.search_labels is not None:
            return self.search_labels
        return IMAGE_LABELS if modality == "image" else TEXT_LABELS

    def search_settings(self, modality: str | None = None) -> dict[str, Any]:
        """The fields that shape the search (what a saved path records and checks); with `modality`, the loss
        resolved for it (`labels_for`)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(_SearchFields)}
        if modality is not None:
            out["search_labels"] = self.labels_for(modality)
        return out


SEARCH_FIELDS = tuple(f.name for f in dataclasses.fields(_SearchFields))
