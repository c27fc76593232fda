"""Image models (ViT, Dinov2, its SwiGLU variant and backbones): calibration forms, errors before any change, exact
reload through every loader, layer scale, fine-tuning, and the causal-LM-only features refusing them. (Every method
on ViT and Dinov2 classifiers runs in the contract suite, tests/test_common.py.)"""

from __future__ import annotations

import copy
import json

import datasets
import pytest
import torch
from testing_utils import calibration_for, calibration_ids, calibration_pixels, logits, tiny_model
from transformers import AutoModel, AutoModelForImageClassification

from optimum_prune import (
    AMPConfig,
    AutoPrunedModelForCausalLM,
    AutoPrunedModelForImageClassification,
    AutoPruner,
    CalibrationConfig,
    FinetuneConfig,
    FLAPConfig,
    MagnitudeConfig,
    NumericalConfig,
    SPPConfig,
    WandaConfig,
    export_gguf,
    finetune_,
    load_pruned_model,
    prune_,
    save_pruned_model,
)
from optimum_prune.evaluation import perplexity
from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view
from optimum_prune.modeling.surgery import apply_layer_plan_
from optimum_prune.prune import _compute_plan

NP = NumericalConfig(pruning_ratio=0.3, round_to=1)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _examples(n: int = 64, seed: int = 5) -> list[dict]:
    """An easy task: classes 0..3 in turn, each image faint noise on two channels offset by +-1, the signs being the
    class's two bits; a random tiny ViT scores ~chance, a few training steps learn it."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 4  # (n,)
    px = 0.3 * calibration_pixels(n, seed=seed)  # (n, 3, H, W)
    px[:, 0] += torch.where(y % 2 == 1, 1.0, -1.0)[:, None, None]
    px[:, 1] += torch.where(y // 2 == 1, 1.0, -1.0)[:, None, None]
    order = torch.randperm(n, generator=g).tolist()
    return [{"pixel_values": px[i], "labels": int(y[i])} for i in order]


def test_every_calibration_form_gives_the_same_pruning():
    """A stacked tensor, a list of examples, a datasets.Dataset and CalibrationConfig(dataset=...) are one input."""
    px = calibration_pixels(8)
    ex = [{"pixel_values": p, "labels": i % 5} for i, p in enumerate(px)]
    ds = datasets.Dataset.from_dict({"pixel_values": px.numpy(), "labels": [i % 5 for i in range(8)]})
    outs = []
    for calib in (px, ex, ds, CalibrationConfig(dataset=ex, num_samples=8), CalibrationConfig(dataset=ds)):
        model = tiny_model("vit")
        report = prune_(model, NP, calib)
        assert report.calibration["num_samples"] == 8 and report.calibration["image_shape"] == [3, 16, 16]
        outs.append(logits(model))
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)
    # num_samples picks a seeded subset: same seed, same images
    sub = [prune_(tiny_model("vit"), NP, CalibrationConfig(dataset=ex, num_samples=4, seed=s)).calibration for s in (1, 1, 2)]  # fmt: skip
    assert sub[0]["source"]["sha256"] == sub[1]["source"]["sha256"] != sub[2]["source"]["sha256"]


@pytest.mark.parametrize(
    ("arch", "calibration", "match"),
    [
        ("vit", lambda: calibration_ids(), "image model: calibration takes images, not token ids"),
        ("vit", lambda: CalibrationConfig(dataset=["some text"] * 4), "image model: calibration takes images, not text"),
        ("vit", lambda: torch.randn(4, 1, 16, 16), "1 channels but ViTForImageClassification expects 3"),
        ("vit", lambda: torch.randn(4, 3, 24, 24), "do not fit ViTForImageClassification"),
        ("vit", lambda: [{"pixel_values": torch.randn(3, 16, 16)}, {"pixel_values": torch.randn(3, 8, 8)}], "different shapes"),
        ("vit", lambda: datasets.Dataset.from_dict({"text": ["a", "b"]}), "not text"),
        ("dinov2", lambda: torch.full((2, 3, 16, 16), float("nan")), "NaN"),
        ("llama", lambda: calibration_pixels(4), "text model: calibration takes text"),
    ],
)  # fmt: skip
def test_wrong_calibration_fails_before_any_change(arch, calibration, match):
    model = tiny_model(arch)
    before = _state(model)
    with pytest.raises(ValueError, match=match):
        prune_(model, NP, calibration())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_recipe_on_vision_transformer():
    """AMP (non-causal attention) on q/k and Wanda on the rest, in one layer-wise pass over pixel calibration."""
    model = tiny_model("vit")
    recipe = [AMPConfig(sparsity=0.5, steps=2), WandaConfig(sparsity=0.5, targets=["v_proj", "o_proj", "mlp"])]
    report = prune_(model, recipe, calibration_pixels())
    assert abs(report.measured - 0.5) < 0.02 and torch.isfinite(logits(model)).all()


@pytest.mark.parametrize("method", ["flap", "spp"])
def test_deit_prunes_and_reloads_exactly(method, tmp_path):
    model = tiny_model("deit")
    if method == "spp":  # per-layer q/k and v/o head dims, searched on the classifier's cross-entropy
        config = SPPConfig(pruning_ratio=0.3, steps=6, lr=0.08, lambda_=0.3, round_to=1, head_dim_multiple=1)
        report = prune_(model, config, calibration_for("deit", labelled=True))
        assert any("qk_head_dim" in layer for layer in report.layers)
    else:
        prune_(model, FLAPConfig(pruning_ratio=0.3, round_to=1), calibration_pixels())
    save_pruned_model(model, tmp_path / "out")
    for loader in (AutoPrunedModelForImageClassification, AutoModelForImageClassification):
        reloaded = loader.from_pretrained(tmp_path / "out", attn_implementation="eager")
        torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["dinov2_backbone", "vit_backbone"])
def test_backbone_prunes_and_reloads_exactly(arch, tmp_path):
    model = tiny_model(arch)
    prune_(model, NP, calibration_pixels())
    save_pruned_model(model, tmp_path / "out")
    assert json.loads((tmp_path / "out/config.json").read_text())["architectures"][0].endswith("Model")
    for reloaded in (
        AutoModel.from_pretrained(tmp_path / "out", attn_implementation="eager"),
        load_pruned_model(tmp_path / "out", attn_implementation="eager"),
    ):
        assert type(reloaded).__name__.endswith("Model")
        torch.testing.assert_close(logits(reloaded.eval()), logits(model), rtol=0, atol=0)
    with pytest.raises(ValueError, match="feature-extraction"):
        AutoPrunedModelForImageClassification.from_pretrained(tmp_path / "out", attn_implementation="eager")


def test_swiglu_dinov2_removed_equals_zeroed_and_reloads(tmp_path):
    """Dinov2 with `use_swiglu_ffn`: gate/up rows and down columns go together, like Llama's MLP."""
    model = tiny_model("dinov2_swiglu")
    spec = get_spec(model)
    assert spec.mlp_in == ("gate_proj", "up_proj") and spec.role_targets()["gate_proj"].path == "mlp.gate_proj"
    _, plan = _compute_plan(model, FLAPConfig(pruning_ratio=0.3, round_to=1), calibration_pixels())
    zeroed, removed = copy.deepcopy(model), copy.deepcopy(model)
    for m, mode in ((zeroed, "zero"), (removed, "remove")):
        layers = get_layers(m, spec)
        for i, lp in plan.layers.items():
            apply_layer_plan_(layer_view(layers[i], i, spec, m.config), lp, mode=mode)
    torch.testing.assert_close(logits(removed), logits(zeroed), rtol=1e-5, atol=1e-5)
    save_pruned_model(removed, tmp_path / "out")
    reloaded = AutoPrunedModelForImageClassification.from_pretrained(tmp_path / "out", attn_implementation="eager")
    torch.testing.assert_close(logits(reloaded), logits(removed), rtol=0, atol=0)
    prune_(model, WandaConfig(sparsity=0.5, targets=["mlp"]), calibration_pixels())
    w = model.dinov2.encoder.layer[0].mlp.gate_proj.weight
    assert abs(float((w == 0).float().mean()) - 0.5) < 0.01


def test_layer_scale_and_head_geometry_after_pruning():
    """Inner-dimension pruning leaves Dinov2's layer scales (hidden size) untouched; the attention module's head
    count follows the removal; a uniform ViT saves as a stock checkpoint and a uniform Dinov2 whose MLP is
    untouched does too (its `mlp_ratio` is still an int)."""
    model = tiny_model("dinov2")
    scales = {k: v.clone() for k, v in model.state_dict().items() if "layer_scale" in k}
    prune_(model, NP, calibration_pixels())
    for k, v in scales.items():
        assert torch.equal(model.state_dict()[k], v), k
    for layer in model.dinov2.encoder.layer:
        assert layer.attention.num_attention_heads * layer.attention.head_dim == layer.attention.q_proj.out_features


@pytest.mark.parametrize(("arch", "kwargs"), [("vit", {}), ("dinov2", {"prune_mlp": False})])
def test_uniform_pruning_saves_a_stock_checkpoint(arch, kwargs, tmp_path):
    model = tiny_model(arch)
    prune_(
        model,
        NumericalConfig(pruning_ratio=0.25, allocation="uniform", round_to=1, **kwargs),
        calibration_pixels(),
    )
    save_pruned_model(model, tmp_path / "out")
    assert json.loads((tmp_path / "out/config.json").read_text())["model_type"] == arch
    reloaded = AutoModelForImageClassification.from_pretrained(tmp_path / "out", attn_implementation="eager")
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)


def test_auto_pruner_loads_image_models_and_loaders_check_the_task(tmp_path):
    tiny_model("dinov2").save_pretrained(tmp_path / "dense")
    pruner = AutoPruner.from_pretrained(tmp_path / "dense", attn_implementation="eager")
    assert type(pruner.model).__name__ == "Dinov2ForImageClassification"
    pruner.prune(MagnitudeConfig(pruning_ratio=0.3, round_to=1))
    pruner.save_pretrained(tmp_path / "out")
    card = (tmp_path / "out/README.md").read_text()
    assert "pipeline_tag: image-classification" in card and "AutoPrunedModelForImageClassification" in card
    with pytest.raises(ValueError, match="AutoPrunedModelForImageClassification"):
        AutoPrunedModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    again = AutoPruner.from_pretrained(tmp_path / "out", attn_implementation="eager")  # loads pruned checkpoints too
    torch.testing.assert_close(logits(again.model), logits(pruner.model), rtol=0, atol=0)
    AutoPruner.from_pretrained(tiny_model("vit_backbone")).prune(NP, calibration=calibration_pixels())


def _with_processor(path):
    tiny_model("vit").save_pretrained(path)
    processor = {"image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": 32, "width": 32},
                 "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}  # fmt: skip
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return path


def test_image_processor_without_pillow_names_the_extra(tmp_path, monkeypatch):
    """A checkpoint with no image processor loads without Pillow; one with a processor says which extra loads it."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "PIL" else find_spec(name, *a))
    tiny_model("vit").save_pretrained(tmp_path / "bare")
    assert AutoPruner.from_pretrained(tmp_path / "bare").tokenizer is None
    with pytest.raises(ImportError, match=r"pip install 'optimum-prune\[vision\]'"):
        AutoPruner.from_pretrained(_with_processor(tmp_path / "dense"))


def test_image_processor_is_loaded_and_saved_with_the_model(tmp_path):
    pytest.importorskip("PIL", reason="the `vision` extra (Pillow) loads image processors")
    pruner = AutoPruner.from_pretrained(_with_processor(tmp_path / "dense"))
    assert type(pruner.tokenizer).__name__.startswith("ViTImageProcessor")
    pruner.prune(MagnitudeConfig(pruning_ratio=0.3, round_to=1))
    pruner.save_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out/preprocessor_config.json").read_text())["size"] == {"height": 32, "width": 32}


def test_causal_lm_only_features_refuse_image_models(tmp_path):
    model = tiny_model("vit")
    with pytest.raises(ValueError, match="Perplexity is for causal language models"):
        perplexity(model, None, ["text"])
    with pytest.raises(ValueError, match="GGUF export"):
        export_gguf(model, tmp_path / "m.gguf")
    save_pruned_model(model, tmp_path / "out")
    with pytest.raises(ValueError, match="GGUF export"):
        export_gguf(tmp_path / "out", tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize(
    ("config", "ft"),
    [
        (
            WandaConfig(sparsity=0.5),
            FinetuneConfig(method="lora", max_steps=4, batch_size=8, learning_rate=1e-2, eval_fraction=0.25),
        ),
        (NP, FinetuneConfig(method="full", max_steps=4, batch_size=8, learning_rate=1e-3, eval_fraction=0.25)),
    ],
)
def test_finetune_image_classifier(config, ft, tmp_path):
    """Cross-entropy on labels, LoRA (head trained fully) or full training on the pruned shapes; zeros stay zero;
    training learns the easy task (held-out accuracy from chance to >= 75%); the model saves and reloads exactly."""
    model = tiny_model("vit")
    prune_(model, config, calibration_pixels())
    before = _state(model)
    model, report = finetune_(model, ft, _examples(), None)
    assert report.accuracy_before is not None and report.perplexity_before is None
    assert report.eval_examples == 16 and report.train_documents == 48 and len(report.loss_history) == 4
    # measured: held-out accuracy 0/16 -> 16/16 (LoRA) and 0/16 -> 13/16 (full); chance is 1/4
    assert report.accuracy_before <= 0.5 and report.accuracy_after >= 0.75
    assert report.eval_loss_after < 0.5 * report.eval_loss_before
    assert report.sparsity_kept is (True if config is not NP else None)
    assert not torch.equal(model.classifier.weight, before["classifier.weight"])  # the head was trained
    save_pruned_model(model, tmp_path / "out")
    reloaded = AutoPrunedModelForImageClassification.from_pretrained(tmp_path / "out", attn_implementation="eager")
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)
    saved = json.loads((tmp_path / "out/pruning_config.json").read_text())["finetune"][0]
    assert saved["accuracy_after"] == report.accuracy_after


def test_finetune_refuses_bad_image_input():
    model = tiny_model("vit")
    before = _state(model)
    unlabelled = [{"pixel_values": p} for p in calibration_pixels(8)]
    with pytest.raises(ValueError, match="no labels"):
        finetune_(model, FinetuneConfig(max_steps=1), unlabelled, None)
    with pytest.raises(ValueError, match="outside the model's 5 classes"):
        finetune_(model, FinetuneConfig(max_steps=1), [{**e, "labels": 7} for e in _examples(4)], None)
    with pytest.raises(ValueError, match="no classification head"):
        finetune_(tiny_model("dinov2_backbone"), FinetuneConfig(max_steps=1), _examples(4), None)
    with pytest.raises(ValueError, match="token_budget applies to text"):  # token options are for causal LMs
        finetune_(model, FinetuneConfig(token_budget=64, seq_len=16, batch_size=2), _examples(4), None)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_cli_prunes_an_image_checkpoint_and_eval_refuses_it(tmp_path, capsys):
    from optimum_prune.cli import main

    tiny_model("vit").save_pretrained(tmp_path / "dense")
    args = ["--set", "pruning_ratio=0.3", "--set", "round_to=1", "--output", str(tmp_path / "out")]
    assert main(["prune", str(tmp_path / "dense"), "--method", "magnitude", *args]) == 0
    assert AutoPrunedModelForImageClassification.from_pretrained(tmp_path / "out").num_parameters() > 0
    assert main(["prune", str(tmp_path / "dense"), "--method", "numerical", "--calib", "bbc", "--output", "x"]) == 2
    assert main(["eval", str(tmp_path / "out"), "--data", "bbc"]) == 2
    assert "image model" in capsys.readouterr().err
