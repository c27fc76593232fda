import torch
from testing_utils import calibration_ids, tiny_model

from optimum_prune import FLAPConfig
from optimum_prune.functional.fluctuation import bias_compensation, fluctuation_metric
from optimum_prune.prune import _compute_plan


def test_bias_compensation_preserves_the_output_mean():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(500, 8, generator=g, dtype=torch.float64) + torch.arange(8, dtype=torch.float64)
    W = torch.randn(5, 8, generator=g, dtype=torch.float64)
    pruned = torch.tensor([1, 4, 6])
    b = bias_compensation(W, X.mean(0), pruned)
    W_cut = W.clone()
    W_cut[:, pruned] = 0
    torch.testing.assert_close((X @ W_cut.T + b).mean(0), (X @ W.T).mean(0))


def test_wifv_metric_matches_definition():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(300, 6, generator=g, dtype=torch.float64) * torch.arange(1, 7)
    W = torch.randn(4, 6, generator=g, dtype=torch.float64)
    m = fluctuation_metric(W, X.mean(0), X.var(0), "wifv")
    torch.testing.assert_close(m, X.var(0) * (W**2).sum(0))


def test_flap_plan_adds_biases_on_output_projections():
    model = tiny_model("llama")
    spec, plan = _compute_plan(model, FLAPConfig(pruning_ratio=0.3), calibration_ids())
    for lp in plan.layers.values():
        if lp.keep_channels is not None:
            assert spec.mlp_out_path in lp.biases
