"""The public API: what `optimum_prune` exports, warning-free."""

from __future__ import annotations

import importlib
import inspect
import json
import warnings
from pathlib import Path

import pytest

import optimum_prune
from optimum_prune import (
    AutoPruner,
    FISTAConfig,
    MagnitudeConfig,
    NumericalConfig,
    PruningConfig,
    StructuredPruningConfig,
    UnstructuredPruningConfig,
    WandaConfig,
    save_pruned_model,
)


def test_new_names_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in optimum_prune.__all__:
            getattr(optimum_prune, name)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchConfig'"):
        optimum_prune.NoSuchConfig  # noqa: B018


def test_compute_plan_is_private():
    assert "compute_plan" not in optimum_prune.__all__
    for module in (optimum_prune, importlib.import_module("optimum_prune.prune")):
        assert not hasattr(module, "compute_plan")


def test_config_names_follow_one_rule():
    """`<Method>Config` with the method's name as its paper writes it (acronyms in capitals), beside a pruner class
    `<Method>Pruner`; a method derives from `StructuredPruningConfig` (heads / KV groups / channels) or
    `UnstructuredPruningConfig`, except expert pruning, whose units are whole experts (`ExpertConfig(PruningConfig)`)."""
    from optimum_prune.methods.registry import available_methods, get_config_class, get_pruner_class

    for name in available_methods():
        config_cls, pruner_cls = get_config_class(name), get_pruner_class(name)
        stem = config_cls.__name__.removesuffix("Config")
        assert config_cls.__name__.endswith("Config") and not stem.endswith("Pruning"), config_cls.__name__
        assert pruner_cls.__name__ == stem + "Pruner", (name, pruner_cls.__name__)
        assert getattr(optimum_prune, config_cls.__name__) is config_cls
        family = (StructuredPruningConfig, UnstructuredPruningConfig)
        assert issubclass(config_cls, family) or (name == "experts" and issubclass(config_cls, PruningConfig)), name


def test_saved_configs_load_under_the_new_names():
    """The registry's method names did not change: a config written before the renames loads as the new class."""
    assert type(PruningConfig.from_dict({"method": "fista", "config_version": 1, "sparsity": 0.5})) is FISTAConfig
    assert type(PruningConfig.from_dict({"method": "numerical", "pruning_ratio": 0.2})) is NumericalConfig
    assert type(PruningConfig.from_dict({"method": "magnitude", "pruning_ratio": 0.2})) is MagnitudeConfig
    assert type(UnstructuredPruningConfig.from_dict({"method": "wanda", "sparsity": 0.6})) is WandaConfig
    with pytest.raises(ValueError, match="not a UnstructuredPruningConfig"):
        UnstructuredPruningConfig.from_dict({"method": "numerical", "pruning_ratio": 0.2})


def test_old_config_files_run_as_their_version_did(caplog):
    """`to_dict` writes every field, so a file of an older `config_version` lacks only the fields added since; they
    take the value that reproduces what that version did (SPP version 1: no refit after extraction, and, where the
    file has `compensate`, the full refit without an intercept). A hand-written dict takes today's defaults."""
    from optimum_prune.methods.spp import SPPConfig

    current = SPPConfig(pruning_ratio=0.3).to_dict()
    assert current["config_version"] == SPPConfig.config_version == 3
    assert PruningConfig.from_dict(current) == SPPConfig(pruning_ratio=0.3)
    old = {k: v for k, v in current.items() if not k.startswith("compensat")}
    first = PruningConfig.from_dict({**old, "config_version": 1})
    assert (first.compensate, first.compensation_strength, first.compensation_bias) == (False, 1.0, False)
    refit = PruningConfig.from_dict({**old, "config_version": 1, "compensate": True})
    assert (refit.compensate, refit.refit_strength("text"), refit.compensation_bias) == (True, 1.0, False)
    for version in (None, 3):  # by hand, or today's version: the defaults
        data = {k: v for k, v in old.items() if k != "config_version"}
        config = PruningConfig.from_dict(data if version is None else {**data, "config_version": version})
        assert config == SPPConfig(pruning_ratio=0.3)
    # version 2 wrote `prune_attention` and `compensation_bias` as booleans; a file of it without `channel_order`
    # (before that option) cut in the path's order
    second = {**current, "config_version": 2, "prune_attention": True, "compensation_bias": True}
    del second["channel_order"]
    v2 = PruningConfig.from_dict(second)
    assert (v2.channel_order, v2.prune_attention, v2.refit_bias("text"), v2.refit_strength("text")) == (
        "path",
        True,
        True,
        0.5,
    )
    with caplog.at_level("WARNING", logger="optimum_prune"):
        assert PruningConfig.from_dict({**current, "config_version": 9}) == SPPConfig(pruning_ratio=0.3)
    assert "written by a newer optimum_prune" in caplog.text
    with pytest.raises(ValueError, match="config_version"):
        PruningConfig.from_dict({**current, "config_version": "1"})
    from optimum_prune.methods.registry import available_methods, get_config_class

    migrated = {get_config_class(name) for name in available_methods() if get_config_class(name).migrations}
    assert {c.method for c in migrated} >= {"spp", "numerical", "fista", "amp"}
    for cls in migrated:  # every migration: a version-1 file lacking the fields gets the recorded values
        current = cls().to_dict()
        assert current["config_version"] == cls.config_version == max(cls.migrations)
        values = {k: v for version in cls.migrations.values() for k, v in version.items()}
        old = PruningConfig.from_dict({**{k: v for k, v in current.items() if k not in values}, "config_version": 1})
        assert {k: getattr(old, k) for k in values} == values, cls.__name__


def _package_modules():
    root = Path(optimum_prune.__file__).parent
    for path in sorted(root.rglob("*.py")):  # every module, also in folders without an __init__.py
        name = ".".join(("optimum_prune", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        if ".cli" not in name:  # the CLI's UserError is its own exit signal, never raised to a caller
            yield importlib.import_module(name)


def test_every_error_class_is_exported():
    errors = {
        obj
        for module in _package_modules()
        for name, obj in vars(module).items()
        if inspect.isclass(obj)
        and issubclass(obj, Exception)
        and obj.__module__.startswith("optimum_prune")
        and not name.startswith("_")
    }
    assert {e.__name__ for e in errors} >= {"GGUFExportError", "SolutionPathError", "UnsupportedArchitectureError"}
    for error in errors:
        assert error.__name__ in optimum_prune.__all__ and getattr(optimum_prune, error.__name__) is error, error


def test_save_and_load_names_match():
    assert save_pruned_model.__name__ == "save_pruned_model" and "load_pruned_model" in optimum_prune.__all__


def test_teacher_copy_is_made_only_when_asked():
    from testing_utils import tiny_model

    config = MagnitudeConfig(pruning_ratio=0.4, round_to=1)
    plain = AutoPruner.from_pretrained(tiny_model("llama"))
    plain.prune(config)
    assert plain._teacher is None
    with pytest.raises(ValueError, match="keep_teacher=True"):
        plain.teacher()
    kept = AutoPruner.from_pretrained(tiny_model("llama"), keep_teacher=True)
    kept.prune(config)
    width = kept.teacher().model.layers[0].mlp.up_proj.out_features
    assert width == 96 > kept.model.model.layers[0].mlp.up_proj.out_features


def test_import_is_light_every_public_name_resolves_and_stock_loaders_read_pruned_types(tmp_path):
    """`import optimum_prune` loads neither torch nor transformers (its names load on first use); every name of
    `__all__` resolves; and in a script that imports optimum_prune before transformers, stock
    `AutoModelForCausalLM` still reads a pruned checkpoint (the types register when transformers loads)."""
    import subprocess
    import sys

    from testing_utils import calibration_ids, tiny_model

    from optimum_prune import NumericalConfig, prune_, save_pruned_model

    model = tiny_model("llama")
    prune_(model, NumericalConfig(pruning_ratio=0.3, allocation="global"), calibration_ids())
    out = save_pruned_model(model, tmp_path / "out")
    probe = (
        "import sys, json\nimport optimum_prune\n"
        "light = not {'torch', 'transformers'} & set(sys.modules)\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r})\n"
        "names = [n for n in optimum_prune.__all__ if getattr(optimum_prune, n, None) is None]\n"
        "print(json.dumps([light, type(m).__name__, names]))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    light, cls, missing = json.loads(result.stdout.strip().splitlines()[-1])
    assert light and cls.startswith("Pruned") and not missing, (light, cls, missing)
