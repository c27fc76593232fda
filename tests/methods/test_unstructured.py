"""Unstructured / N:M methods: errors, FISTA guarantees, semi-structured conversion."""

import pytest
import torch
from testing_utils import calibration_ids, logits, tiny_model

from optimum_prune import (
    FISTAConfig,
    MagnitudeConfig,
    RIAConfig,
    SparseGPTConfig,
    WandaConfig,
    prune_,
    to_semi_structured_,
)
from optimum_prune.modeling.semi_structured import (
    _sparse_tensor_class,
    check_semi_structured_support,
    find_non_24_layers,
)


@pytest.mark.parametrize("cfg_cls", [WandaConfig, SparseGPTConfig, RIAConfig, FISTAConfig])
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sparsity": 1.0}, "sparsity"),
        ({"sparsity": -0.1}, "sparsity"),
        ({"pattern": "4:4"}, "N"),
        ({"pattern": "3:2"}, "N"),
        ({"pattern": "two:four"}, "pattern"),
        ({"sparsity": 0.7, "pattern": "2:4"}, "sparsity=0.5"),
    ],
)
def test_bad_sparsity_and_pattern(cfg_cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cfg_cls(**kwargs)


def test_pattern_not_dividing_the_width_fails_before_touching_weights():
    model = tiny_model("llama")  # widths 64 and 96: a group of 5 divides neither
    before = logits(model)
    with pytest.raises(ValueError, match="64"):
        prune_(model, SparseGPTConfig(sparsity=0.6, pattern="2:5"), calibration_ids())
    torch.testing.assert_close(logits(model), before, rtol=0, atol=0)


def test_fista_is_never_worse_than_its_warm_start_and_beats_magnitude():
    ids = calibration_ids(8, 16)
    model = tiny_model("llama")
    report = prune_(model, FISTAConfig(sparsity=0.5, K=10, max_outer=5), ids)
    for layer_info in report.info["layers"].values():
        for path, res in layer_info.items():
            assert res["error_best"] <= res["error_init"] * (1 + 1e-6), path
    dense = logits(tiny_model("llama"), ids)
    mag = tiny_model("llama")
    prune_(mag, MagnitudeConfig(pattern="unstructured", sparsity=0.5, per="matrix"))
    err_fista = (logits(model, ids) - dense).pow(2).mean()
    err_mag = (logits(mag, ids) - dense).pow(2).mean()
    assert err_fista < err_mag


def test_semi_structured_conversion_checks_pattern_then_hardware():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="not 2:4"):
        to_semi_structured_(model)
    prune_(model, WandaConfig(pattern="2:4"), calibration_ids())
    assert find_non_24_layers(model) == []
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="compute capability >= 8.0"):
            to_semi_structured_(model)


def test_semi_structured_backend_is_checked_before_any_weight_changes():
    model = tiny_model("llama")
    prune_(model, WandaConfig(pattern="2:4"), calibration_ids())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="'auto', 'cusparselt', 'cutlass'"):
        to_semi_structured_(model, backend="cuSPARSELt")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("backend", "cusparselt", "expected"),
    [
        ("auto", True, "SparseSemiStructuredTensorCUSPARSELT"),
        ("auto", False, "SparseSemiStructuredTensorCUTLASS"),
        ("cutlass", True, "SparseSemiStructuredTensorCUTLASS"),
        ("cusparselt", True, "SparseSemiStructuredTensorCUSPARSELT"),
    ],
)
def test_semi_structured_backend_choice(monkeypatch, backend, cusparselt, expected):
    """The backend is chosen per conversion (PyTorch's global `_FORCE_CUTLASS` is left alone); `auto` falls back to
    CUTLASS on a torch built without cuSPARSELt instead of leaving every layer dense."""
    monkeypatch.setattr(torch.backends.cusparselt, "is_available", lambda: cusparselt)
    assert _sparse_tensor_class(backend).__name__ == expected


def test_semi_structured_cusparselt_missing_names_the_alternative(monkeypatch):
    monkeypatch.setattr(torch.backends.cusparselt, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="backend='cutlass'"):
        _sparse_tensor_class("cusparselt")


def _has_24_kernels() -> bool:
    try:
        check_semi_structured_support()
    except RuntimeError:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not _has_24_kernels(), reason="needs an NVIDIA GPU with compute capability >= 8.0")
@pytest.mark.parametrize("backend", ["auto", "cutlass"])
def test_semi_structured_conversion_on_gpu(backend):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4, vocab_size=128)
    ).eval()
    prune_(model, MagnitudeConfig(pattern="2:4", sparsity=0.5))
    ids = calibration_ids(2, 64).cuda()
    ref = model.half().cuda()(ids).logits.float()
    assert to_semi_structured_(model, backend=backend)
    torch.testing.assert_close(model(ids).logits.float(), ref, rtol=2e-2, atol=2e-2)
