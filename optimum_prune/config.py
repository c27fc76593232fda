"""Configuration dataclasses: the `PruningConfig` base every method config derives from, the structured and the
unstructured bases, and `CalibrationConfig`."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .constants import PRUNING_CONFIG_NAME
from .functional.masks import parse_pattern
from .modeling.targets import normalize_targets

__all__ = [
    "PruningConfig",
    "StructuredPruningConfig",
    "UnstructuredPruningConfig",
    "CalibrationConfig",
    "validate_ratio",
    "validate_sparsity",
    "validate_targets",
    "choice",
]

logger = logging.getLogger(__name__)


# The one registry of pruning methods: name -> (config class, pruner class). `register_pruning_method`
# (optimum_prune.methods.registry) validates a method and adds it; `PruningConfig.from_dict` on a base class looks the
# `method` key up here, the runner its pruner class.
_METHODS: dict[str, tuple[type, type]] = {}


def add_method(name: str, config_cls: type, pruner_cls: type) -> None:
    """Record a validated method (`register_pruning_method` calls this; use that instead)."""
    _METHODS[name] = (config_cls, pruner_cls)


def method_classes(name: str) -> tuple[type, type]:
    """`(config class, pruner class)` of a registered method, or a `ValueError` naming the registered ones."""
    if name not in _METHODS:
        raise ValueError(f"Unknown pruning method {name!r}. Available: {', '.join(method_names())}.")
    return _METHODS[name]


def method_names() -> list[str]:
    """The registered methods' names, sorted."""
    return sorted(_METHODS)


def validate_ratio(name: str, value: float) -> None:
    """Raise a `ValueError` unless `0 <= value < 1`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a number in [0, 1), got {value!r}.")
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(
            f"`{name}` must be in [0, 1) (the fraction of weights to remove), got {value}. "
            "Use e.g. 0.2 to remove 20%; 1.0 would remove everything."
        )


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    """Raise a `ValueError` unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {list(allowed)}, got {value!r}.")


@dataclass
class PruningConfig:
    """Base class of every pruning-method configuration.

    Subclasses are plain dataclasses whose fields are both their constructor and their JSON form. The `method`
    class attribute names the registered method. `config_version` (written into every file) and `migrations` read
    files of an older version as their version ran: `to_dict` writes every field, so only a field added since can be
    missing, and `migrations[v]` maps each field added in version `v` to the value that reproduces the behaviour before
    it existed (a file without `config_version`, written by hand, takes the current defaults).

    Args:
        seed (`int`, defaults to `0`): seed for every random choice the method makes.
    """

    method: ClassVar[str] = ""
    config_version: ClassVar[int] = 1
    migrations: ClassVar[dict[int, dict[str, Any]]] = {}

    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"`seed` must be an int, got {self.seed!r}.")

    # ------------------------------------------------------------------------------------------------ a run
    def frozen(self) -> PruningConfig:
        """A copy that refuses every assignment: the config as a run uses it (`prune_` resolves each config for the
        model, freezes it, and records it in the report and the saved `pruning_config.json`; the config passed in
        is never changed). `dataclasses.replace` of a frozen config gives an unfrozen one."""
        out = copy.copy(self)
        object.__setattr__(out, "_frozen", True)
        return out

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise dataclasses.FrozenInstanceError(
                f"{type(self).__name__} is frozen while it runs: cannot set {name!r}. Change the config you passed "
                "(or a `dataclasses.replace` copy of this one) and prune again."
            )
        super().__setattr__(name, value)

    def __deepcopy__(self, memo: dict) -> PruningConfig:  # a copy to change: not frozen
        out = copy.copy(self)
        out.__dict__.pop("_frozen", None)
        for k, v in out.__dict__.items():
            object.__setattr__(out, k, copy.deepcopy(v, memo))
        return out

    # ----------------------------------------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON-serialisable dict, including `method` and `config_version`."""
        out = {"method": self.method, "config_version": self.config_version}
        out.update(dataclasses.asdict(self))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PruningConfig:
        """Build a config from `to_dict()` output.

        Called on the base class, the `method` key selects the registered subclass. Unknown keys are dropped with a
        warning (forward compatibility); wrong types fail in `__post_init__`.
        """
        data = dict(data)
        method = data.pop("method", None)
        version = data.pop("config_version", None)
        target: type[PruningConfig] = cls
        if not cls.method:  # a base class: the `method` key picks the registered subclass
            if method is None:
                raise ValueError("The config dict has no `method` key; cannot tell which pruning method it is for.")
            target = method_classes(method)[0]
            if not issubclass(target, cls):
                raise ValueError(f"Config dict is for method {method!r} ({target.__name__}), not a {cls.__name__}.")
        elif method is not None and method != cls.method:
            raise ValueError(f"Config dict is for method {method!r}, not {cls.method!r}.")
        data = target._migrate(data, version)
        names = {f.name for f in dataclasses.fields(target)}
        unknown = sorted(set(data) - names)
        if unknown:
            logger.warning("Ignoring unknown keys for %s: %s", target.__name__, unknown)
        hints = typing.get_type_hints(target)
        kwargs = {}
        for k, v in data.items():
            if k in names:
                # JSON has no tuples: restore them where the field is declared as a tuple.
                if isinstance(v, list) and "tuple" in str(hints.get(k, "")):
                    v = tuple(v)
                kwargs[k] = v
        return target(**kwargs)

    @classmethod
    def _migrate(cls, data: dict[str, Any], version: Any) -> dict[str, Any]:
        """`data` of a file written at `version` with the fields it predates set as that version ran them."""
        if version is None:
            return data
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ValueError(f"`config_version` must be a positive int, got {version!r}.")
        if version > cls.config_version:
            logger.warning("This %s was written by a newer optimum_prune (config_version %d > %d); fields it added are "
                           "ignored.", cls.__name__, version, cls.config_version)  # fmt: skip
        filled = {}
        for added_in, values in sorted(cls.migrations.items()):
            if version < added_in:
                filled.update({k: v for k, v in values.items() if k not in data and k not in filled})
        if filled:
            logger.info("Reading a %s of config_version %d: %s (as that version ran).", cls.__name__, version, filled)
        return {**data, **filled}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json_string())

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> PruningConfig | list[PruningConfig]:
        """A config, or a recipe (a JSON list of configs, returned as a list) from a JSON file.

        A `pruning_config.json` written next to a model holds a history; the last applied config (or recipe) is
        returned, so that it can be re-run exactly.
        """
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, dict) and "history" in data:
            data = data["history"][-1]["config"]
        if isinstance(data, dict) and isinstance(data.get("recipe"), list):
            data = data["recipe"]
        if isinstance(data, list):
            if not data:
                raise ValueError(f"{path} holds an empty recipe; give at least one config.")
            return [cls.from_dict(d) for d in data]
        return cls.from_dict(data)

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write `pruning_config.json` (this config alone) into `save_directory`."""
        os.makedirs(save_directory, exist_ok=True)
        self.to_json_file(os.path.join(save_directory, PRUNING_CONFIG_NAME))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> PruningConfig | list[PruningConfig]:
        """Read a config (or a recipe: a list) from a directory holding `pruning_config.json`, or from a JSON file."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, PRUNING_CONFIG_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"No pruning config at {path!r}.")
        return cls.from_json_file(path)


@dataclass
class StructuredPruningConfig(PruningConfig):
    """Fields shared by the structured methods (heads / KV groups and MLP channels are physically removed).

    Args:
        pruning_ratio (`float`, defaults to `0.2`): fraction of the attention + MLP parameters to remove, in [0, 1).
            The report gives the measured value.
        allocation (`str`, defaults to `"global"`): `"global"` ranks every unit of every layer together (per-layer
            shapes then differ); `"servable"` keeps the shapes serving engines load in the DeciLM format
            (`save_pretrained` writes it; vLLM, SGLang, TensorRT-LLM, MLX, llama.cpp; llama / mistral models):
            every layer keeps all its attention heads, MLP channels go in blocks of 256 ranked over all layers (a
            kept width is a multiple of `round_to` and of 256), and no bias is added; `"auto"` is `"servable"` where
            the model and the settings allow it (a llama / mistral model with MLP widths in multiples of 256, no bias
            asked for, a ratio the MLP blocks can reach) and `"global"` otherwise (the saved config records which; the log why);
            `"uniform"` removes the same
            fraction from every layer (the checkpoint then loads
            with stock `transformers` and engines such as vLLM); `"owl"` gives each layer its own budget from its
            activation outliers (OWL, Yin et al., ICML 2024: the share of its weights whose `|W_ij|·‖X_j‖` exceeds
            `owl_threshold` × the layer's mean, rescaled to ±`owl_lambda` around the ratio; outlier-rich layers lose
            less), then ranks the layer's heads and channels together. Needs calibration data.
        owl_threshold (`float`, defaults to `5.0`) / owl_lambda (`float`, defaults to `0.08`): OWL's M and λ (the
            paper's LLaMA settings); used by `allocation="owl"` only.
        prune_attention (`bool`, defaults to `True`) / prune_mlp (`bool`, defaults to `True`): which parts to prune.
        gqa_mode (`str`, defaults to `"auto"`): `"group"` removes whole KV groups (1 KV head + its query heads);
            `"query"` removes only query heads, the same number from every group of a layer; `"auto"` uses
            `"group"` unless a layer has a single KV head.
        min_heads_per_layer (`int`, defaults to `1`): query heads each layer keeps at least.
        min_mlp_channels_per_layer (`int`, defaults to `1`): MLP channels each layer keeps at least.
        round_to (`int`, defaults to `64`): keep a multiple of this many MLP channels in every pruned layer (the
            nearest multiple, within the guards; a layer with at most `round_to` channels is left as allocated).
            Aligned widths keep llama.cpp's / ggml's matrix kernels on their fast paths and let q8_0 quantize every
            row (blocks of 32); `round_to=1` keeps the allocation's exact widths. llama.cpp's k-quants need rows that
            are a multiple of 256 (docs/methods/index.md, "Hardware-aligned shapes").
        skip_layers (`tuple[int, ...]`, defaults to `()`): decoder layers left untouched.
    """

    pruning_ratio: float = 0.2
    allocation: str = "global"
    prune_attention: bool = True
    prune_mlp: bool = True
    gqa_mode: str = "auto"
    min_heads_per_layer: int = 1
    min_mlp_channels_per_layer: int = 1
    round_to: int = 64
    skip_layers: tuple[int, ...] = field(default_factory=tuple)
    owl_threshold: float = 5.0
    owl_lambda: float = 0.08

    def __post_init__(self) -> None:
        super().__post_init__()
        validate_ratio("pruning_ratio", self.pruning_ratio)
        choice("allocation", self.allocation, ("auto", "global", "servable", "uniform", "owl"))
        if not self.owl_threshold > 0 or not 0 <= self.owl_lambda < 0.5:
            raise ValueError(
                f"`owl_threshold` must be > 0 and `owl_lambda` in [0, 0.5), got {self.owl_threshold}, {self.owl_lambda}."
            )
        choice("gqa_mode", self.gqa_mode, ("auto", "group", "query"))
        for name in ("min_heads_per_layer", "min_mlp_channels_per_layer", "round_to"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be an int >= 1, got {value!r}.")
        if not (self.prune_attention or self.prune_mlp):
            raise ValueError("At least one of `prune_attention` and `prune_mlp` must be True.")
        self.skip_layers = tuple(int(i) for i in self.skip_layers)

    # read only after the calibration pass (allocation, rounding): prunes that differ only in these share one pass
    # (`allocation` counts as "OWL or not": OWL's pass also measures outliers)
    after_calibration_fields: ClassVar[tuple[str, ...]] = ("pruning_ratio", "allocation", "round_to", "owl_lambda")
    # settings derived from the fields, the pruning ratio included, that the calibration pass depends on
    resolved_settings: ClassVar[tuple[str, ...]] = ()

    @property
    def allocation_mode(self) -> str:
        """The allocation that runs: `allocation`, unless the method's config sets its own (`own_allocation`)."""
        return self.allocation

    @property
    def own_allocation(self) -> str | None:
        """Why the config sets its own allocation in place of `allocation` (`None`: it does not)."""
        return None

    @property
    def adds_biases(self) -> bool:
        """Whether the method gives the pruned projections a bias (its compensation). Default: no."""
        return False

    def components(self) -> dict[str, Any]:
        """What runs, as three named choices: what ranks the units (`scores`), which units of which layer go
        (`allocation`), and how the kept weights are refitted (`refit`: `"none"` or its kind, with its settings).
        Read on the config as it runs (the report records it: `PruningReport.info["components"]`)."""
        return {"scores": self.method, "allocation": self.allocation_mode, "refit": "none"}

    def calibration_key(self) -> dict[str, Any]:
        """What this config's calibration pass depends on (the key of a `CalibrationStatsCache` entry): every field
        but `after_calibration_fields`, whether the allocation is OWL, and the `resolved_settings`."""
        key = {k: v for k, v in self.to_dict().items() if k not in self.after_calibration_fields}
        key["owl"] = self.allocation == "owl"
        key.update({name: getattr(self, name) for name in self.resolved_settings})
        return key

    def cuts_attention(self, modality: str = "text", pairs: bool = True) -> bool:
        """Whether this config removes attention structure from a model of `modality` (`prune_attention`; a method
        whose default depends on the modality resolves it)."""
        return bool(self.prune_attention)


def validate_sparsity(sparsity: Any, pattern: str) -> None:
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not math.isfinite(sparsity):
        raise ValueError(f"`sparsity` must be a number in [0, 1), got {sparsity!r}.")
    if not 0 <= sparsity < 1:
        raise ValueError(f"`sparsity` must be in [0, 1) (fraction of weights set to zero), got {sparsity}.")
    nm = parse_pattern(pattern)  # raises a clear ValueError for N >= M, N < 1, malformed strings
    if nm is not None and not math.isclose(sparsity, 1 - nm[0] / nm[1]):
        raise ValueError(
            f"pattern {pattern!r} keeps {nm[0]} of every {nm[1]} weights, i.e. sparsity {1 - nm[0] / nm[1]:g}, "
            f"but sparsity={sparsity} was requested. Set sparsity={1 - nm[0] / nm[1]:g} or pattern='unstructured'."
        )


def validate_targets(targets: Any) -> tuple[str, ...] | None:
    """Checks role names (`ROLES` plus `"attention"`, `"mlp"`); returns them as a tuple (`None`: all)."""
    if targets is None:
        return None
    if isinstance(targets, str):
        targets = (targets,)
    normalize_targets(targets)
    return tuple(targets)


@dataclass
class UnstructuredPruningConfig(PruningConfig):
    """Base class of the unstructured / N:M methods' configurations (the counterpart of `StructuredPruningConfig`):
    the fields every one of them has. A new unstructured method's config derives from it (see
    `optimum_prune.methods.unstructured.SequentialPruner` for the pruner side).

    Args:
        sparsity (`float`, defaults to `0.5`): fraction of each targeted projection's weights set to zero.
        pattern (`str`, defaults to `"unstructured"`): `"unstructured"` or `"N:M"` (N weights *kept* in every
            group of M consecutive inputs of a row, NVIDIA's convention; `"2:4"` is 50%).
        targets (`tuple[str, ...] | None`, defaults to `None`): projections to prune, by architecture-independent
            role: `"q_proj"`, `"k_proj"`, `"v_proj"`, `"o_proj"`, `"gate_proj"`, `"up_proj"`, `"down_proj"`, or the
            shorthands `"attention"` / `"mlp"`. `None` prunes every projection. Mapped through the architecture
            table (OPT's `fc1` is `up_proj`, GPT-2's `c_attn` holds q/k/v as row slices).
    """

    sparsity: float = 0.5
    pattern: str = "unstructured"
    targets: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.pattern, str) and self.pattern.strip().lower() not in ("unstructured",):
            validate_sparsity(self.sparsity, self.pattern)
        else:
            validate_sparsity(self.sparsity, "unstructured")
        self.targets = validate_targets(self.targets)

    @property
    def nm(self) -> tuple[int, int] | None:
        return None if self.pattern == "unstructured" else parse_pattern(self.pattern)


@dataclass
class CalibrationConfig:
    """Which text the calibration pass runs on.

    Args:
        dataset (`str | list[str] | datasets.Dataset`, defaults to `"wikitext2"`): a text file, a directory of
            `.txt` files, a list of strings, a `datasets.Dataset` with a text column, or one of `"wikitext2"`,
            `"c4"`, `"ptb"` (needs the Hugging Face Hub).
        num_samples (`int`, defaults to `128`): number of calibration sequences.
        seq_len (`int`, defaults to `2048`): tokens per sequence.
        seed (`int`, defaults to `0`): sampling seed; the same seed gives the same samples for every method.
        split (`str`, defaults to `"train"`): split for named datasets.
        text_column (`str`, defaults to `"text"`): column holding the text in a `datasets.Dataset` / JSONL file.
        batch_size (`int`, defaults to `8`): sequences per forward pass of a block during calibration.
    """

    dataset: Any = "wikitext2"
    num_samples: int = 128
    seq_len: int = 2048
    seed: int = 0
    split: str = "train"
    text_column: str = "text"
    batch_size: int = 8

    def __post_init__(self) -> None:
        for name in ("num_samples", "seq_len", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CalibrationConfig.{name} must be a positive int, got {value!r}.")
        if isinstance(self.dataset, os.PathLike):
            self.dataset = os.fspath(self.dataset)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form; an in-memory dataset is described, not copied."""
        out = (
            dataclasses.asdict(self)
            if not _is_in_memory(self.dataset)
            else {
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "dataset"},
                "dataset": f"<in-memory {type(self.dataset).__name__}>",
            }
        )
        return out


def _is_in_memory(dataset: Any) -> bool:
    return not isinstance(dataset, str)
