"""ExpertConfig on the four MoE architectures: the contract (prune, report, cached decoding, save → stock reload,
config round-trip), REAP against a direct float64 computation, the planted experts, the channel refit, clear errors,
recipes."""

import copy

import pytest
import torch
from testing_utils import assert_cached_decoding_matches, tiny_model
from transformers import AutoModelForCausalLM

from experts.tiny import MOE_CASES, MOE_TYPES, masked_router, moe_ids, tiny_moe
from optimum_prune import (
    AutoPrunedModelForCausalLM,
    ExpertConfig,
    NumericalConfig,
    PruningConfig,
    WandaConfig,
    prune_,
    save_pruned_model,
)
from optimum_prune.calibration.expert_stats import ExpertGramStats, RoutingStats
from optimum_prune.methods.experts.functional import expert_saliency, kept_width, prune_expert_channels
from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view
from optimum_prune.modeling.experts import routed_experts
from optimum_prune.prune import _compute_plan


def _logits(model, ids=None):
    with torch.no_grad():
        return model(moe_ids(2, 12, seed=5) if ids is None else ids).logits


@pytest.mark.parametrize("model_type", MOE_TYPES)
@pytest.mark.parametrize("kwargs", MOE_CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_contract(model_type, kwargs, tmp_path):
    config = ExpertConfig(**kwargs)
    model = tiny_moe(model_type, dtype=torch.float32)
    report = prune_(model, config, moe_ids())
    assert report.params_after < report.params_before
    assert 0 < report.measured <= report.target + 1e-9
    rows = [r for r in report.layers if "num_experts" in r]
    if config.allocation == "uniform":
        assert {r["num_experts"] for r in rows} == {6 - round(6 * config.expert_ratio)}
    else:
        rows.sort(key=lambda r: r["num_experts"])  # the card gives the range
    assert {r["intermediate_size"] for r in rows} == {kept_width(24, config.channel_ratio, config.round_to)}
    out = _logits(model)
    assert torch.isfinite(out).all()
    assert_cached_decoding_matches(model)
    save_pruned_model(model, tmp_path / "out")
    loaders = [AutoPrunedModelForCausalLM] + [AutoModelForCausalLM] * (config.allocation == "uniform")
    for loader in loaders:
        reloaded = loader.from_pretrained(tmp_path / "out").eval()
        torch.testing.assert_close(_logits(reloaded), out, rtol=0, atol=0)
    assert PruningConfig.from_dict(config.to_dict()) == config
    assert PruningConfig.from_pretrained(tmp_path / "out") == config
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"Experts per layer: 6 → {rows[0]['num_experts']}" in card, card


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_pruned_model_routes_like_the_masked_router(model_type):
    model = tiny_moe(model_type)
    spec, plan = _compute_plan(model, ExpertConfig(expert_ratio=0.5), moe_ids())
    dropped = {i: sorted(set(range(6)) - set(lp.keep_experts)) for i, lp in plan.layers.items()}
    assert all(len(d) == 3 for d in dropped.values())
    with masked_router(model, dropped):
        ref = _logits(model)
    prune_(model, ExpertConfig(expert_ratio=0.5), moe_ids())
    torch.testing.assert_close(_logits(model), ref, rtol=0, atol=1e-10)


def test_reap_matches_a_direct_computation():
    """REAP, EAN and frequency from the recorded sums against a token-by-token float64 computation through the stock
    experts module (each token sent to one expert with weight 1)."""
    model = tiny_moe("olmoe")
    spec = get_spec(model)
    view = layer_view(get_layers(model, spec)[1], 1, spec, model.config)
    x = torch.randn(3, 10, 32, dtype=torch.float64)
    stats = RoutingStats(6)
    stats.add_tokens(x)
    for j, _, prob, weight, _, out in routed_experts(view, x):
        stats.update(j, prob, weight, out.norm(dim=-1))
    flat = x.reshape(-1, 32)
    logits = flat @ view.router.weight.T
    probs = torch.softmax(logits, -1)
    top = probs.topk(2, dim=-1).indices
    reap, ean, freq = torch.zeros(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64), torch.zeros(6)
    for t in range(flat.shape[0]):
        for j in top[t].tolist():
            f = view.experts(flat[t : t + 1], torch.tensor([[j]]), torch.ones(1, 1, dtype=torch.float64))[0]
            reap[j] += probs[t, j] * f.norm()
            ean[j] += f.norm()
            freq[j] += 1
    sums = stats.sums()
    torch.testing.assert_close(expert_saliency(sums, "reap"), reap / freq.clamp_min(1).double(), rtol=1e-10, atol=0)
    torch.testing.assert_close(expert_saliency(sums, "ean"), ean / freq.clamp_min(1).double(), rtol=1e-10, atol=0)
    torch.testing.assert_close(expert_saliency(sums, "frequency"), freq.double())
    assert stats.count == 30


def test_planted_experts_go_first():
    """An expert the router never picks (gpt-oss's router bias) and one whose output is ~0 are REAP's first two;
    frequency removes the unpicked one but keeps the silent one, which it sees often."""
    model = tiny_moe("gpt_oss")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.bias[1] = -1e4
            layer.mlp.experts.down_proj[3] *= 1e-6
            layer.mlp.experts.down_proj_bias[3] = 0
    ids = moe_ids(16, 24)
    _, plan = _compute_plan(model, ExpertConfig(expert_ratio=2 / 6), ids)
    assert all(lp.keep_experts == [0, 2, 4, 5] for lp in plan.layers.values()), plan.summary()
    _, freq = _compute_plan(model, ExpertConfig(expert_ratio=2 / 6, criterion="frequency"), ids)
    assert all(1 not in lp.keep_experts and 3 in lp.keep_experts for lp in freq.layers.values()), freq.summary()


def test_expert_gram_matches_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(40, 5, generator=g, dtype=torch.float64), torch.rand(40, generator=g, dtype=torch.float64)
    stats = ExpertGramStats(3, 5, dtype=torch.float64)
    stats.update(2, h[:25], w[:25])
    stats.update(2, h[25:], w[25:])
    ref = (h * w[:, None] ** 2).T @ h / (w**2).sum()
    torch.testing.assert_close(stats.gram(2), ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(stats.mean(2), (h * w[:, None] ** 2).sum(0) / (w**2).sum(), rtol=1e-12, atol=0)
    assert stats.weight_sum()[0] == 0


def test_channel_refit_is_the_least_squares_solution():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(200, 8, generator=g, dtype=torch.float64) @ torch.randn(8, 8, generator=g, dtype=torch.float64)
    W = torch.randn(6, 8, generator=g, dtype=torch.float64)
    gram = h.T @ h / 200
    kept, W_new, _ = prune_expert_channels(W, gram, h.mean(0), keep=5, ratio=3 / 8, damping=0.0)
    assert len(kept) == 5 and W_new[:, [c for c in range(8) if c not in kept]].abs().max() == 0
    ref = torch.linalg.lstsq(h[:, kept], h @ W.T).solution.T  # min ‖h_K W_Kᵀ − h Wᵀ‖
    torch.testing.assert_close(W_new[:, kept], ref, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_refit_reduces_the_layer_error(model_type):
    """With the refit, every pruned MoE block reproduces the dense block's output on the calibration text better."""
    ids = moe_ids(8, 16)
    dense = tiny_moe(model_type)
    errors = {}
    for compensate in (False, True):
        model = copy.deepcopy(dense)
        prune_(model, ExpertConfig(expert_ratio=0.0, channel_ratio=0.5, round_to=4, compensate=compensate), ids)
        errors[compensate] = _block_errors(dense, model, ids)
    assert all(a < b for a, b in zip(errors[True], errors[False])), errors


def _block_errors(dense, pruned, ids) -> list[float]:
    """Per MoE block: ‖pruned block(x) − dense block(x)‖² on the dense model's block inputs."""
    inputs = []
    handles = [layer.mlp.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for layer in dense.model.layers]
    with torch.no_grad():
        dense(ids)
    for h in handles:
        h.remove()
    out = []
    with torch.no_grad():
        for x, d, p in zip(inputs, dense.model.layers, pruned.model.layers):
            yd, yp = d.mlp(x), p.mlp(x)
            yd, yp = (y[0] if isinstance(y, tuple) else y for y in (yd, yp))
            out.append(float((yd - yp).pow(2).sum()))
    return out


def test_clear_errors_before_any_weight_changes():
    model = tiny_moe("mixtral")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="num_experts_per_tok=2"):
        prune_(model, ExpertConfig(expert_ratio=0.9), moe_ids())
    with pytest.raises(ValueError, match="prune_mlp=False"):
        prune_(model, NumericalConfig(pruning_ratio=0.2), moe_ids())
    with pytest.raises(ValueError, match="targets='attention'"):
        prune_(model, WandaConfig(sparsity=0.5), moe_ids())
    with pytest.raises(ValueError, match="prune_attention=False"):
        prune_(tiny_moe("olmoe"), NumericalConfig(pruning_ratio=0.2, prune_mlp=False), moe_ids())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(ValueError, match="no experts"):
        prune_(tiny_model("llama"), ExpertConfig(), moe_ids())
    with pytest.raises(ValueError, match="above 0"):
        ExpertConfig(expert_ratio=0.0)


def test_recipe_with_attention_pruning(tmp_path):
    """NP on the attention (heads) and REAP on the experts, in one recipe; the result reloads exactly."""
    model = tiny_moe("qwen3_moe", dtype=torch.float32)
    experts = ExpertConfig(expert_ratio=0.34, channel_ratio=0.25, round_to=8)
    recipe = [NumericalConfig(pruning_ratio=0.1, prune_mlp=False), experts]
    report = prune_(model, recipe, moe_ids())
    assert len(report.sections) == 2
    rows = report.layers
    assert any(r["num_attention_heads"] < 4 for r in rows) and {r["num_experts"] for r in rows} == {4}
    save_pruned_model(model, tmp_path / "out")
    reloaded = AutoPrunedModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(_logits(reloaded), _logits(model), rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs",
    [{"expert_ratio": 0.34, "channel_ratio": 0.25, "round_to": 8}, {"expert_ratio": 0.5, "allocation": "global"}],
    ids=["uniform-channels", "global"],
)
def test_low_memory_equals_in_memory(kwargs, tmp_path, monkeypatch):
    """Blocks streamed from disk one at a time: routing is recorded in the same layer-wise pass, same model."""
    from scale_utils import assert_same_state, prune_and_save, saved_state

    from optimum_prune.storage.streaming import LayerStore

    src = tmp_path / "src"
    save_pruned_model(tiny_moe("qwen3_moe", dtype=torch.float32, num_hidden_layers=3), src, model_card=False)
    loads, original = [], LayerStore.load

    def load(self, i, stage=None):
        assert not set(self.loaded) - {i}, "a second block was loaded"
        loads.append(i)
        return original(self, i, stage)

    monkeypatch.setattr(LayerStore, "load", load)
    config, ids = ExpertConfig(**kwargs), moe_ids()
    prune_and_save(src, config, tmp_path / "mem", calibration=ids, batch_size=3)
    assert not loads
    report = prune_and_save(src, config, tmp_path / "low", low_memory=True, calibration=ids, batch_size=3)
    assert loads and report.info["low_memory"] is True
    assert_same_state(saved_state(tmp_path / "mem"), saved_state(tmp_path / "low"))


def test_two_processes_give_the_single_process_result(tmp_path):
    """torchrun, 2 CPU processes on gloo, each calibrating on its half of the samples (low-memory and not): the routing
    statistics and the experts' Grams are summed over the ranks, so the decisions and the refit are those of one
    process."""
    from scale_utils import assert_same_state, prune_and_save, saved_state
    from test_distributed import _torchrun
    from testing_utils import calibration_ids

    src = tmp_path / "src"
    save_pruned_model(tiny_moe("mixtral", dtype=torch.float32), src, model_card=False)
    cases = {"uniform": (ExpertConfig(expert_ratio=0.34, channel_ratio=0.25, round_to=8), True),
             "global": (ExpertConfig(expert_ratio=0.5, allocation="global"), False)}  # fmt: skip
    job = {"mode": "cases", "src": str(src), "out": str(tmp_path / "dp"),
           "cases": [{"name": n, "config": c.to_dict(), "low_memory": low} for n, (c, low) in cases.items()]}  # fmt: skip
    proc, log = _torchrun(job, tmp_path)
    assert proc.returncode == 0, log
    for name, (config, _) in cases.items():
        prune_and_save(src, config, tmp_path / "single" / name, calibration=calibration_ids(8, 16), batch_size=3)
        # the same experts and channels kept (shapes and names), the same refitted weights
        assert_same_state(saved_state(tmp_path / "single" / name), saved_state(tmp_path / "dp" / name), atol=1e-5)


def test_cli_method_experts_and_gguf_export(tmp_path, smollm2_tokenizer):
    """`optimum-prune prune --method experts --ratio` (the expert ratio), `--set` for channels, then `export`."""
    from optimum_prune.cli import main

    src = tmp_path / "src"
    model = tiny_moe("qwen3_moe", dtype=torch.float32, vocab_size=len(smollm2_tokenizer))
    model.save_pretrained(src)
    smollm2_tokenizer.save_pretrained(src)
    calib = tmp_path / "calib.txt"
    calib.write_text("the bank said profits rose sharply as markets recovered while the minister warned. " * 60)
    argv = ["prune", str(src), "--method", "experts", "--ratio", "0.34", "--set", "channel_ratio=0.25", "--set",
            "round_to=8", "--calib", str(calib), "--num-samples", "4", "--seq-len", "32", "-o", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 0
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # uniform: a stock Qwen3-MoE checkpoint
    assert reloaded.config.num_experts == 4 and reloaded.config.moe_intermediate_size == 16
    assert (
        main(["export-gguf", "--model", str(tmp_path / "out"), "-o", str(tmp_path / "m.gguf"), "--outtype", "f32"])
        == 0
    )
    assert (tmp_path / "m.gguf").stat().st_size > 0
