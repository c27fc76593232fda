"""AMP pruner, `targets` and recipes: bad input fails before any weight changes; one calibration pass; the recipe is
stored in pruning_config.json and re-runs exactly; the CLI takes `--method amp` and `--config recipe.json`."""

import copy
import json

import pytest
import torch
from testing_utils import calibration_ids, logits, tiny_model

from optimum_prune import (
    AMPConfig,
    FLAPConfig,
    MagnitudeConfig,
    NumericalConfig,
    PruningConfig,
    SparseGPTConfig,
    WandaConfig,
    prune_,
    save_pruned_model,
)
from optimum_prune.calibration import sequential
from optimum_prune.methods.amp import functional as amp_functional
from optimum_prune.methods.amp.pruner import AMPPruner
from optimum_prune.modeling.architectures import get_layers, get_spec

IDS = calibration_ids()


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model, before):
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, "steps"),
        ({"steps": 2.5}, "steps"),
        ({"lr": 0.0}, "lr"),
        ({"lr": -1.0}, "lr"),
        ({"momentum": 1.0}, "momentum"),
        ({"targets": ["v_proj"]}, "q_proj, k_proj"),
        ({"targets": ["attention"]}, "q_proj, k_proj"),
        ({"targets": ["query"]}, "Valid targets"),
        ({"regularizer": "per_k"}, "regularizer"),
        ({"gradient": "paper"}, "gradient"),
        ({"solver": "adam"}, "solver"),
        ({"cg_steps": 0}, "cg_steps"),
        ({"refit_steps": -1}, "refit_steps"),
        ({"lambda_rel": 0.0}, "lambda_rel"),
        ({"refit_lr": float("nan")}, "refit_lr"),
        ({"precondition": 1}, "precondition"),
        ({"score": "wanda"}, "score"),
        ({"refit_target": "teacher"}, "refit_target"),
    ],
)
def test_amp_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AMPConfig(**kwargs)


def test_amp_paper_preset():
    """`AMPConfig.paper()`: the paper's literal real-model setting, one call away; fields can be overridden."""
    cfg = AMPConfig.paper()
    assert (cfg.lambda_, cfg.lr, cfg.steps, cfg.momentum) == (0.05, 0.005, 100, 0.9)
    assert (cfg.regularizer, cfg.score, cfg.sparsity) == ("divided_by_k", "mask", 0.5)
    assert (cfg.solver, cfg.per, cfg.refit_steps) == ("descent", "matrix", 0)
    assert AMPConfig.paper(0.7, steps=3).to_dict() == {**cfg.to_dict(), "sparsity": 0.7, "steps": 3}
    d = AMPConfig()
    assert (d.solver, d.score, d.per) == ("cg", "masked_weight_input", "row") and d.refit_steps > 0


def test_unknown_and_missing_targets():
    with pytest.raises(ValueError, match="Valid targets: q_proj"):
        WandaConfig(targets=["fc1"])
    model = tiny_model("opt")
    before = _weights(model)
    with pytest.raises(ValueError, match="no gate_proj"):
        prune_(model, WandaConfig(targets=["gate_proj", "down_proj"]), IDS)
    _unchanged(model, before)
    # the shorthand only takes what the architecture has: OPT's MLP is fc1 (up_proj) + fc2 (down_proj)
    report = prune_(model, WandaConfig(targets=["mlp"]), IDS)
    assert sorted(k.split(".", 2)[2] for k in report.sparsity if k.startswith("layers.0.")) == ["fc1", "fc2"]


def test_targets_prune_only_their_projections_gpt2_slices():
    model = tiny_model("gpt2")
    spec = get_spec(model)
    c_attn = get_layers(model, spec)[0].attn.c_attn.weight.detach().clone()  # Conv1D: (in, 3·out)
    report = prune_(model, WandaConfig(targets=["k_proj"]), IDS)
    W = get_layers(model, spec)[0].attn.c_attn.weight
    d = W.shape[0]
    assert torch.equal(W[:, :d], c_attn[:, :d]) and torch.equal(W[:, 2 * d :], c_attn[:, 2 * d :])
    assert (W[:, d : 2 * d] == 0).float().mean() == pytest.approx(0.5, abs=0.01)
    assert set(report.sparsity) == {f"layers.{i}.attn.c_attn[k_proj]" for i in range(3)}


def test_amp_nan_loss_names_the_layer_and_leaves_the_model_unchanged(monkeypatch):
    model = tiny_model("llama_gqa")
    before = _weights(model)
    real = amp_functional.DataTerm
    built = []

    class Poisoned(real):
        def __call__(self, *args, **kwargs):
            data, gq, gk = super().__call__(*args, **kwargs)
            return (float("nan") if len(built) == 2 else data), gq, gk  # layer 0 was pruned when layer 1 diverges

    def make(*args, **kwargs):
        built.append(1)
        return Poisoned(*args, **kwargs)

    monkeypatch.setattr(amp_functional, "DataTerm", make)
    with pytest.raises(FloatingPointError, match="layer 1"):
        prune_(model, AMPConfig(cg_steps=2, refit_steps=2), IDS)
    _unchanged(model, before)


def test_amp_real_nan_is_caught():
    model = tiny_model("llama")
    before = _weights(model)
    for config in (AMPConfig(solver="descent", steps=3, lr=1e300, lambda_=1e300), AMPConfig(refit_lr=1e300)):
        with pytest.raises(FloatingPointError, match="layer 0"):
            prune_(model, config, IDS)
        _unchanged(model, before)


def test_amp_report_and_sparsity():
    model = tiny_model("qwen3")
    report = prune_(model, AMPConfig(cg_steps=3, refit_steps=20), IDS)
    assert set(report.sparsity) == {f"layers.{i}.self_attn.{p}" for i in range(3) for p in ("q_proj", "k_proj")}
    for entry in report.info["layers"].values():
        assert set(entry) >= {"rel_attention_error_soft", "rel_attention_error_binary", "rel_attention_error_refit",
                              "lambda_", "cg_iterations", "curvature_mean", "curvature_max", "refit_loss", "seconds"}  # fmt: skip
        assert 1 <= entry["cg_iterations"] <= 3 and entry["rel_attention_error_binary"] > 0
        assert entry["rel_attention_error_refit"] < entry["rel_attention_error_binary"]
    report = prune_(tiny_model("qwen3"), AMPConfig.paper(steps=3), IDS)
    for entry in report.info["layers"].values():
        assert entry["steps"] == 3 and entry["loss_final"] < entry["loss_initial"]
        assert "rel_attention_error_refit" not in entry
    report = prune_(tiny_model("llama"), AMPConfig(solver="descent", steps=3, refit_steps=20), IDS)  # descent + refit
    for entry in report.info["layers"].values():
        assert entry["steps"] == 3 and entry["rel_attention_error_refit"] < entry["rel_attention_error_binary"]


def test_amp_amp_masks_rank_per_matrix_and_nm():
    W = torch.randn(8, 8, dtype=torch.float64)
    M = torch.arange(64, dtype=torch.float64).view(8, 8)
    keep = amp_functional.binarize(M, W, 0.5)
    assert keep.sum() == 32 and keep.view(-1)[32:].all()  # the 32 largest mask values, whatever W
    keep = amp_functional.binarize(M, W, 0.5, nm=(2, 4))
    assert (keep.view(8, 2, 4).sum(-1) == 2).all() and keep.view(8, 2, 4)[..., 2:].all()


# ---------------------------------------------------------------------------------------------------------- recipes
def test_recipe_runs_in_one_calibration_pass(monkeypatch):
    captures = []
    real = sequential.LayerwiseRunner._capture
    monkeypatch.setattr(sequential.LayerwiseRunner, "_capture", lambda self, *a: (captures.append(1), real(self, *a)))
    model = tiny_model("llama_gqa")
    recipe = [AMPConfig(cg_steps=2, refit_steps=2), WandaConfig(targets=["v_proj", "o_proj", "mlp"])]
    report = prune_(model, recipe, IDS)
    assert len(captures) == 1
    assert [s["method"] for s in report.sections] == ["amp", "wanda"]
    for s in report.sections:
        assert s["measured"] == pytest.approx(0.5, abs=0.01)
    assert report.sections[0]["layers"][0]["cg_iterations"] <= 2
    assert report.measured == pytest.approx(0.5, abs=0.01) and report.target == pytest.approx(0.5, abs=0.01)
    assert len(report.sparsity) == 3 * 7  # every projection of every layer, each owned by one config


def test_recipe_errors_leave_the_model_unchanged():
    model = tiny_model("llama")
    before = _weights(model)
    bad = [
        ([], "non-empty"),
        ([WandaConfig(targets=["attention"]), SparseGPTConfig(targets=["o_proj", "mlp"])], "both target 'o_proj'"),
        ([AMPConfig(steps=1), WandaConfig()], "both target 'q_proj'"),
        ([NumericalConfig(), FLAPConfig(prune_attention=False)], "both prune the mlp"),
        ([WandaConfig(targets=["mlp"]), "wanda"], "PruningConfig"),
    ]
    for recipe, match in bad:
        with pytest.raises((ValueError, TypeError), match=match):
            prune_(model, recipe, IDS)
        _unchanged(model, before)


def test_recipe_with_structured_stage_first():
    model = tiny_model("llama_gqa")
    recipe = [WandaConfig(targets=["mlp"]), NumericalConfig(pruning_ratio=0.2, prune_mlp=False)]
    report = prune_(model, recipe, IDS)
    assert report.params_after < report.params_before  # heads were removed
    assert report.sections[1]["method"] == "numerical" and report.sections[1]["measured"] > 0
    assert report.sections[0]["measured"] == pytest.approx(0.5, abs=0.01)
    assert torch.isfinite(logits(model)).all()


def test_recipe_is_saved_and_reruns_exactly(tmp_path):
    recipe = [AMPConfig(steps=2, pattern="2:4", sparsity=0.5), MagnitudeConfig(pattern="unstructured",
              targets=["v_proj", "o_proj"]), WandaConfig(targets=["mlp"], sparsity=0.3)]  # fmt: skip
    model = tiny_model("mistral")
    prune_(model, recipe, IDS)
    save_pruned_model(model, tmp_path / "out")
    loaded = PruningConfig.from_pretrained(tmp_path / "out")
    assert loaded == recipe
    again = tiny_model("mistral")
    prune_(again, loaded, IDS)
    torch.testing.assert_close(logits(again), logits(model), rtol=0, atol=0)
    history = json.loads((tmp_path / "out" / "pruning_config.json").read_text())["history"]
    assert history[-1]["method"] == "recipe" and len(history[-1]["config"]) == 3
    # a JSON list is a recipe for from_json_file as well
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps([c.to_dict() for c in recipe]))
    assert PruningConfig.from_json_file(path) == recipe
    path.write_text("[]")
    with pytest.raises(ValueError, match="empty recipe"):
        PruningConfig.from_json_file(path)


def test_refit_to_the_model_reproduces_the_dense_models_attention(monkeypatch):
    """`refit_target="model"` in a recipe with Wanda: the refit's target inputs are the dense model's own attention
    inputs at every layer (read here by hooks on an untouched copy), the pruner carries them alongside the pruned
    stream; the refit lowers the error against the dense model's attention, which on layers after the first also
    holds the drift Wanda's pruning of the earlier layers caused."""
    model = tiny_model("llama_gqa")
    dense = copy.deepcopy(model)
    want = {}
    for i, layer in enumerate(dense.model.layers):
        layer.self_attn.register_forward_pre_hook(
            lambda _m, a, kw, i=i: want.__setitem__(i, (a[0] if a else kw["hidden_states"]).detach()), with_kwargs=True
        )
    with torch.no_grad():
        dense(IDS)
    seen = {}
    original = AMPPruner.prune_qk

    def record(self, inp, *args, target=None, desc="amp", **kwargs):
        seen[int(desc.rsplit(" ", 1)[-1])] = torch.cat(target.xs)
        return original(self, inp, *args, target=target, desc=desc, **kwargs)

    monkeypatch.setattr(AMPPruner, "prune_qk", record)
    recipe = [
        AMPConfig(cg_steps=3, refit_steps=30, refit_target="model"),
        WandaConfig(targets=["v_proj", "o_proj", "mlp"]),
    ]
    report = prune_(model, recipe, IDS, batch_size=3)  # three chunks
    assert sorted(seen) == sorted(want) == [0, 1, 2]
    for i in want:
        torch.testing.assert_close(seen[i], want[i], rtol=1e-5, atol=1e-5)
    layers = report.sections[0]["layers"]
    for e in layers.values():
        assert e["rel_attention_error_model_refit"] < 0.5 * e["rel_attention_error_model_binary"]
    e0 = layers[0]  # the first layer's inputs are the embeddings in both streams
    assert e0["rel_attention_error_model_binary"] == e0["rel_attention_error_binary"]
    assert e0["rel_attention_error_model_refit"] == e0["rel_attention_error_refit"]
    assert all(layers[i]["rel_attention_error_model_binary"] > layers[i]["rel_attention_error_binary"] for i in (1, 2))
