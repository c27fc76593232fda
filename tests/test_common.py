"""Contract suite: every registered method × every supported tiny architecture."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from testing_utils import (
    ARCHS,
    VISION_ARCHS,
    assert_cached_decoding_matches,
    calibration_for,
    is_vision,
    logits,
    tiny_model,
)

from optimum_prune import (
    AMPConfig,
    AutoPrunedModelForCausalLM,
    AutoPrunedModelForImageClassification,
    ExpertConfig,
    FISTAConfig,
    FLAPConfig,
    MagnitudeConfig,
    NumericalConfig,
    PruningConfig,
    RIAConfig,
    ServingConfig,
    SparseGPTConfig,
    SPPConfig,
    SPPRIAConfig,
    WandaConfig,
    available_methods,
    prune_,
    save_pruned_model,
)
from optimum_prune.functional.masks import is_valid_nm, parse_pattern
from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view
from optimum_prune.modeling.surgery import apply_layer_plan_
from optimum_prune.prune import _compute_plan

# One row per registered method: (config class, kwargs, tolerance of the measured ratio / sparsity). Structured rows
# use round_to=1: the tiny models have 96 MLP channels, which the default 64-channel alignment rounds to 64 or 96 (the
# default is tested on a wider MLP in tests/methods/test_round_to.py).
METHOD_CASES = [
    (NumericalConfig, {"pruning_ratio": 0.3, "round_to": 1}, 0.08),
    (NumericalConfig, {"pruning_ratio": 0.3, "round_to": 1, "allocation": "uniform"}, 0.1),
    (NumericalConfig, {"pruning_ratio": 0.3, "round_to": 1, "compensation_inputs": "sequential"}, 0.08),
    (NumericalConfig, {"pruning_ratio": 0.3, "round_to": 1, "compensation_bias": True}, 0.08),
    (NumericalConfig, {"pruning_ratio": 0.3, "round_to": 1, "ranking": "loss"}, 0.08),
    (
        NumericalConfig,
        {"pruning_ratio": 0.3, "round_to": 1, "scores": "fluctuation", "compensation_bias": True},
        0.08,
    ),
    (
        NumericalConfig,
        {
            "pruning_ratio": 0.3,
            "round_to": 1,
            "compensation_bias": True,
            "compensation_inputs": "sequential",
            "allocation": "uniform",
        },
        0.1,
    ),
    (FLAPConfig, {"pruning_ratio": 0.3, "round_to": 1}, 0.08),
    (MagnitudeConfig, {"pruning_ratio": 0.3, "round_to": 1}, 0.08),
    (MagnitudeConfig, {"pattern": "unstructured", "sparsity": 0.6}, 0.01),
    (MagnitudeConfig, {"pattern": "2:4", "sparsity": 0.5}, 0.01),
    (WandaConfig, {"sparsity": 0.5}, 0.01),
    (WandaConfig, {"sparsity": 0.5, "pattern": "2:4"}, 0.01),
    (SparseGPTConfig, {"sparsity": 0.5}, 0.01),
    (SparseGPTConfig, {"sparsity": 0.75, "pattern": "1:4"}, 0.01),
    (RIAConfig, {"sparsity": 0.5}, 0.01),
    (RIAConfig, {"sparsity": 0.5, "pattern": "2:4", "reconstruction": True}, 0.01),
    # FISTA with few iterations keeps the contract suite fast; the paper defaults run in the benchmark.
    (FISTAConfig, {"sparsity": 0.5, "K": 5, "max_outer": 3}, 0.02),
    (FISTAConfig, {"sparsity": 0.5, "pattern": "2:4", "K": 5, "max_outer": 3, "warm_start": "sparsegpt"}, 0.02),
    (WandaConfig, {"sparsity": 0.5, "targets": ["v_proj", "o_proj", "mlp"]}, 0.01),
    # AMP with a few steps keeps the suite fast; the paper settings run in benchmarks/attention.py.
    (AMPConfig, {"sparsity": 0.5, "steps": 3}, 0.01),
    (AMPConfig, {"sparsity": 0.5, "pattern": "2:4", "steps": 3, "targets": ["k_proj"]}, 0.01),
    # SPP with a 10-step search whose units enter over several steps (tests/methods/test_spp.py: FAST).
    (
        SPPConfig,
        {
            "pruning_ratio": 0.3,
            "steps": 10,
            "lr": 0.08,
            "lambda_": 0.7,
            "betas": (0.5, 0.9),
            "round_to": 1,
            "head_dim_multiple": 1,
        },
        0.03,
    ),  # fmt: skip
    (SPPRIAConfig, {"sparsity": 0.5, "steps": 4, "lr": 0.08, "lambda_": 0.3}, 0.01),
    (
        SPPRIAConfig,
        {
            "sparsity": 0.5,
            "pattern": "2:4",
            "steps": 4,
            "lr": 0.08,
            "lambda_": 0.3,
            "combine": "support",
            "targets": ["mlp"],
        },
        0.01,
    ),  # fmt: skip
]
CASE_IDS = [f"{c.method}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for c, kw, _ in METHOD_CASES]


def test_every_registered_method_is_in_the_contract_suite():
    from experts.tiny import MOE_CASES  # the expert method's rows run on the MoE architectures (tests/experts)

    moe = {ExpertConfig.method} if MOE_CASES else set()
    # ServingConfig only prunes models the DeciLM format holds (llama / mistral, MLP widths in multiples of 256): its
    # contract (prune, removed = zeroed, deterministic, save -> reload, the config as it ran) is in
    # tests/methods/test_serving.py, on such models
    servable = {ServingConfig.method}
    assert {c.method for c, _, _ in METHOD_CASES} | moe | servable == set(available_methods())


def _is_structured(cfg_cls, kwargs) -> bool:
    return "pruning_ratio" in kwargs


def _projections(model, targets=None):
    """(name, weight) of every projection, or of every target (`layers.<i>.<key>`, fused slices included)."""
    from optimum_prune.modeling.architectures import get_spec, resolve_targets, weight_oi

    spec = get_spec(model)
    for i, layer in enumerate(get_layers(model, spec)):
        for t in resolve_targets(spec, targets) if targets is not None else ():
            w = weight_oi(layer.get_submodule(t.path))
            yield f"layers.{i}.{t.key}", w[t.rows(w.shape[0])]
        if targets is None:
            for path in spec.linear_paths:
                yield f"layers.{i}.{path}", weight_oi(layer.get_submodule(path))


SEARCHES = {"spp", "spp_ria"}  # they train on the model's task loss: an image classifier's needs labelled images


def _calibration(arch, config):
    return calibration_for(arch, labelled=config.method in SEARCHES)


@pytest.mark.parametrize("arch", ARCHS + VISION_ARCHS)
@pytest.mark.parametrize(("cfg_cls", "kwargs", "tol"), METHOD_CASES, ids=CASE_IDS)
def test_contract(arch, cfg_cls, kwargs, tol, tmp_path):
    config = cfg_cls(**kwargs)
    model = tiny_model(arch)
    ids = _calibration(arch, config)
    report = prune_(model, config, ids)
    out = logits(model)
    assert torch.isfinite(out).all()
    structured = _is_structured(cfg_cls, kwargs)
    assert report.target == pytest.approx(config.pruning_ratio if structured else config.sparsity)
    assert abs(report.measured - report.target) <= tol, report
    if structured:
        assert report.params_after < report.params_before
    else:
        nm = parse_pattern(kwargs.get("pattern", "unstructured"))
        targeted = dict(_projections(model, config.targets))
        assert set(report.sparsity) == set(targeted)  # the report covers exactly the targeted projections
        for name, w in targeted.items():
            assert abs(report.sparsity[name] - config.sparsity) <= tol, name
            assert nm is None or is_valid_nm(w, *nm), name
        assert 0 < report.info["whole_model_sparsity"] < config.sparsity
    if structured and not is_vision(arch):  # per-layer shapes differ: each layer's cache must hold its own widths
        assert_cached_decoding_matches(model)
    # save -> load gives identical logits, with our loader and with plain transformers (once optimum_prune is imported)
    save_pruned_model(model, tmp_path / "out")
    from transformers import AutoModelForCausalLM, AutoModelForImageClassification

    loaders = (AutoPrunedModelForImageClassification, AutoModelForImageClassification) if is_vision(arch) else (
        AutoPrunedModelForCausalLM, AutoModelForCausalLM)  # fmt: skip
    for loader in loaders:
        reloaded = loader.from_pretrained(tmp_path / "out", attn_implementation="eager")
        torch.testing.assert_close(logits(reloaded), out, rtol=0, atol=0)
        if structured and not is_vision(arch):
            assert_cached_decoding_matches(reloaded)
        for (name, w), (_, w2) in zip(_projections(model), _projections(reloaded)):
            assert torch.equal(w == 0, w2 == 0), name  # every zero kept
    # config round-trips through dict, JSON and save_pretrained
    assert PruningConfig.from_dict(config.to_dict()) == config
    config.save_pretrained(tmp_path / "cfg")
    assert PruningConfig.from_pretrained(tmp_path / "cfg") == config
    # the history's last entry: the config as it ran, its architecture-dependent defaults resolved
    resolved = config.for_architecture(get_spec(model)) if hasattr(config, "for_architecture") else config
    if getattr(resolved, "allocation", None) == "auto":  # these MLPs are narrower than the DeciLM format's 256
        resolved = dataclasses.replace(resolved, allocation="global")
    assert PruningConfig.from_pretrained(tmp_path / "out") == resolved


@pytest.mark.parametrize("arch", ARCHS + VISION_ARCHS)
@pytest.mark.parametrize(("cfg_cls", "kwargs", "tol"), [c for c in METHOD_CASES if _is_structured(c[0], c[1])])
def test_removed_equals_zeroed_and_plan_is_deterministic(arch, cfg_cls, kwargs, tol):
    config = cfg_cls(**kwargs)
    model = tiny_model(arch)
    ids = _calibration(arch, config)
    spec, plan = _compute_plan(model, config, ids)
    _, plan2 = _compute_plan(tiny_model(arch), cfg_cls(**kwargs), ids)
    assert plan.summary() == plan2.summary()
    assert plan.layers, "nothing was pruned"
    zeroed, removed = copy.deepcopy(model), copy.deepcopy(model)
    for m, mode in ((zeroed, "zero"), (removed, "remove")):
        layers = get_layers(m, spec)
        for i, lp in plan.layers.items():
            apply_layer_plan_(layer_view(layers[i], i, spec, m.config), lp, mode=mode)
    assert sum(p.numel() for p in removed.parameters()) < sum(p.numel() for p in zeroed.parameters())
    torch.testing.assert_close(logits(removed), logits(zeroed), rtol=1e-5, atol=1e-5)
    # the decision itself changed nothing
    torch.testing.assert_close(logits(model), logits(tiny_model(arch)), rtol=0, atol=0)
