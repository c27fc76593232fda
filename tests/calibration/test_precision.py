"""fp16 / bf16 models: statistics accumulate in fp32 / fp64 (no overflow), pruned weights keep the model's dtype."""

import copy

import pytest
import torch
from testing_utils import calibration_ids, logits, tiny_model

from optimum_prune import NumericalConfig, SparseGPTConfig, WandaConfig, prune_
from optimum_prune.calibration.sequential import LayerwiseRunner
from optimum_prune.calibration.stats import GramStats, MomentStats, SquaredNormStats
from optimum_prune.modeling.architectures import get_layers, get_spec


@pytest.fixture(scope="module")
def loud_fp16_model():
    """A tiny fp16 Llama whose first q/k/v inputs are ~30: over 128 tokens, x² sums pass fp16's maximum (65504),
    while the forward itself stays finite."""
    model = tiny_model("llama_gqa")
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.fill_(30.0)
    return model.half()


def test_fp16_activations_that_overflow_an_fp16_gram_give_exact_statistics(loud_fp16_model):
    model, ids = loud_fp16_model, calibration_ids(8, 16)
    spec = get_spec(model)
    run = LayerwiseRunner(model, spec, ids, batch_size=4)
    q = get_layers(model, spec)[0].get_submodule(spec.qkv_paths[0])
    xs, gram, norms, moments = [], GramStats(72), SquaredNormStats(72), MomentStats(72)

    def observe(_, x):
        xs.append(x)
        for s in (gram, norms, moments):
            s.update(x)

    run.run_layer(0, observe={"q": q}, callback=observe)
    X = torch.cat([x.reshape(-1, 72) for x in xs])  # (128, 72)
    assert X.dtype == torch.float16
    assert torch.isinf(X.T @ X).any()  # the trap these statistics avoid
    ref = X.double().T @ X.double()
    assert torch.isfinite(gram.sum).all() and gram.sum.dtype == torch.float32
    scale = float(ref.abs().max())  # fp32 accumulation: errors relative to the largest entry
    torch.testing.assert_close(gram.sum.double(), ref, rtol=0, atol=1e-6 * scale)
    torch.testing.assert_close(norms.sumsq.double(), ref.diagonal(), rtol=0, atol=1e-6 * scale)
    torch.testing.assert_close(moments.var, X.double().var(0), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "config",
    [WandaConfig(sparsity=0.5), SparseGPTConfig(sparsity=0.5), NumericalConfig(pruning_ratio=0.3, round_to=1)],
    ids=lambda c: c.method,
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_models_prune_to_finite_weights_of_their_dtype(loud_fp16_model, config, dtype):
    model = copy.deepcopy(loud_fp16_model).to(dtype)
    prune_(model, config, calibration_ids(8, 16), batch_size=4)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert torch.isfinite(logits(model)).all()
