"""`allocation="owl"`: per-layer budgets from each layer's activation outliers, measured in the calibration pass."""

import pytest
import torch
from testing_utils import calibration_ids, tiny_model

from optimum_prune import FLAPConfig, MagnitudeConfig, NumericalConfig, prune_
from optimum_prune.functional.allocation import outlier_fraction, owl_layer_ratios
from optimum_prune.modeling.architectures import get_layers, get_spec, weight_oi
from optimum_prune.prune import _compute_plan


@torch.no_grad()
def _direct_outlier_fractions(model, ids, threshold):
    """Hooks on every projection of the dense model: ‖X_j‖ of its input over all tokens, |W_ij|·‖X_j‖ per weight."""
    spec = get_spec(model)
    inputs, handles = {}, []
    for i, layer in enumerate(get_layers(model, spec)):
        for path in spec.linear_paths:
            mod = layer.get_submodule(path)
            hook = lambda m, a, key=(i, path): inputs.setdefault(key, []).append(a[0].reshape(-1, a[0].shape[-1]))  # noqa: E731
            handles.append(mod.register_forward_pre_hook(hook))
    model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    fractions = []
    for i, layer in enumerate(get_layers(model, spec)):
        metrics = []
        for path in spec.linear_paths:
            x = torch.cat(inputs[(i, path)]).double()
            norm = (x * x).mean(0).sqrt()
            metrics.append(weight_oi(layer.get_submodule(path)).double().abs() * norm[None])
        fractions.append(outlier_fraction(metrics, threshold))
    return fractions


@pytest.mark.parametrize("arch", ["llama_gqa", "gpt2"])
@pytest.mark.parametrize("cfg_cls", [NumericalConfig, FLAPConfig])
def test_owl_budgets_follow_the_dense_models_outlier_fractions(arch, cfg_cls):
    model, ids = tiny_model(arch), calibration_ids()
    config = cfg_cls(pruning_ratio=0.3, round_to=1, allocation="owl", owl_threshold=2.0, owl_lambda=0.1)
    expected = _direct_outlier_fractions(tiny_model(arch), ids, 2.0)
    _, plan = _compute_plan(model, config, ids)
    torch.testing.assert_close(torch.tensor(plan.info["outlier_fractions"]), torch.tensor(expected))
    assert len(set(expected)) > 1  # a real spread of budgets
    torch.testing.assert_close(
        torch.tensor(plan.info["layer_ratios"]), torch.tensor(owl_layer_ratios(expected, 0.3, 0.1))
    )
    report = prune_(model, config, ids)
    assert abs(report.measured - 0.3) < 0.08


def test_owl_needs_calibration_data():
    with pytest.raises(ValueError, match="allocation='owl'.*calibration"):
        prune_(tiny_model("llama"), MagnitudeConfig(pruning_ratio=0.3, allocation="owl"))


@pytest.mark.parametrize("kwargs", [{"owl_threshold": 0.0}, {"owl_lambda": 0.5}])
def test_owl_settings_are_validated(kwargs):
    with pytest.raises(ValueError, match="owl_"):
        FLAPConfig(allocation="owl", **kwargs)
