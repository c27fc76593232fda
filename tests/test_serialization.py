"""Save / load: stock checkpoints for uniform shapes, the registered pruned type otherwise; never silent."""

import json
import subprocess
import sys

import pytest
import torch
from testing_utils import calibration_ids, logits, tiny_model
from transformers import AutoModelForCausalLM

from optimum_prune import AutoPrunedModelForCausalLM, NumericalConfig, prune_, save_pruned_model


def _pruned(arch, **kw):
    model = tiny_model(arch)
    prune_(model, NumericalConfig(pruning_ratio=0.3, **kw), calibration_ids())
    return model


def test_uniform_pruning_saves_a_stock_config(tmp_path):
    model = _pruned("llama_gqa", allocation="uniform")
    save_pruned_model(model, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    side = json.loads((tmp_path / "out" / "pruning_config.json").read_text())
    assert cfg["model_type"] == "llama" and side["loadable_with_stock_transformers"]
    assert cfg["num_attention_heads"] == 3 and cfg["num_key_value_heads"] == 1 and cfg["head_dim"] == 12
    assert cfg["intermediate_size"] == model.model.layers[0].mlp.down_proj.in_features
    assert side["history"][0]["method"] == "numerical" and "report" in side["history"][0]
    assert not list((tmp_path / "out").glob("*.bin")) and not list((tmp_path / "out").glob("*.pt"))
    # a process that never imports optimum_prune loads it with stock transformers
    code = (
        "import sys, torch; from transformers import AutoModelForCausalLM as A; "
        f"m = A.from_pretrained({str(tmp_path / 'out')!r}, attn_implementation='eager'); "
        "assert 'optimum_prune' not in sys.modules; print(m.model.layers[0].self_attn.q_proj.out_features)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("36")


def test_heterogeneous_shapes_need_optimum_prune_and_fail_loudly_without_it(tmp_path):
    model = _pruned("llama")  # global allocation: layers differ
    save_pruned_model(model, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "optimum_pruned_llama" and len(cfg["pruned_layers"]) == 3
    code = f"from transformers import AutoModelForCausalLM as A; A.from_pretrained({str(tmp_path / 'out')!r})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0 and "optimum_pruned_llama" in out.stderr
    for loader in (AutoPrunedModelForCausalLM, AutoModelForCausalLM):
        reloaded = loader.from_pretrained(tmp_path / "out", attn_implementation="eager")
        torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)


def test_reloaded_model_can_be_pruned_again_and_history_accumulates(tmp_path):
    model = _pruned("qwen2")
    save_pruned_model(model, tmp_path / "a")
    again = AutoPrunedModelForCausalLM.from_pretrained(tmp_path / "a", attn_implementation="eager")
    prune_(again, NumericalConfig(pruning_ratio=0.2), calibration_ids())
    save_pruned_model(again, tmp_path / "b")
    side = json.loads((tmp_path / "b" / "pruning_config.json").read_text())
    assert [h["config"]["pruning_ratio"] for h in side["history"]] == [0.3, 0.2]
    reloaded = AutoPrunedModelForCausalLM.from_pretrained(tmp_path / "b", attn_implementation="eager")
    torch.testing.assert_close(logits(reloaded), logits(again), rtol=0, atol=0)


def test_load_fails_on_tampered_shapes(tmp_path):
    model = _pruned("llama")
    save_pruned_model(model, tmp_path / "out")
    path = tmp_path / "out" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["pruned_layers"][0]["intermediate_size"] += 1
    path.write_text(json.dumps(cfg))
    with pytest.raises((RuntimeError, ValueError)):
        AutoPrunedModelForCausalLM.from_pretrained(tmp_path / "out")
