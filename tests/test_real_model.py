"""The real SmolLM2-135M (GGUF, dequantized) pruned end to end on BBC text, small and fast."""

import json
import math

import torch

from optimum_prune import AutoPrunedModelForCausalLM, AutoPruner, CalibrationConfig, NumericalConfig
from optimum_prune.calibration.data import bbc_news_dir, load_texts, split_documents
from optimum_prune.cli.demo import SMOLLM2_GGUF_FILE, smollm2_dir
from optimum_prune.evaluation import perplexity


def test_smollm2_numerical_pruning_end_to_end(tmp_path):
    pruner = AutoPruner.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF_FILE)
    calib_docs, eval_docs = split_documents(load_texts(str(bbc_news_dir())), 0.5, seed=0)
    dense_ppl = perplexity(pruner.model, pruner.tokenizer, eval_docs, seq_len=128, max_tokens=1024)
    report = pruner.prune(
        NumericalConfig(pruning_ratio=0.2),
        calibration=CalibrationConfig(dataset=calib_docs, num_samples=4, seq_len=128),
    )
    assert abs(report.measured - 0.2) < 0.02
    assert report.calibration["num_samples"] == 4
    # the default allocation on a llama model: every head kept, MLP widths in blocks of 256 (the DeciLM shapes)
    assert report.config["allocation"] == "servable"
    assert all(layer["num_attention_heads"] == 9 and layer["intermediate_size"] % 256 == 0 for layer in report.layers)
    pruned_ppl = perplexity(pruner.model, pruner.tokenizer, eval_docs, seq_len=128, max_tokens=1024)
    # Re-measured with today's default at 20% (servable shapes, FLAP's metric, full refit): 37.01 -> 61.84 (1.67x)
    # from these 4 x 128 calibration tokens (the per-layer allocation: 54.86, 1.48x; on the protocol's 32 x 512 the
    # servable model is the better one). 1.75x leaves 5% for numerical drift.
    assert math.isfinite(pruned_ppl) and dense_ppl < pruned_ppl < 1.75 * dense_ppl, (dense_ppl, pruned_ppl)
    pruner.save_pretrained(tmp_path / "out")  # a GGUF-loaded model saves as safetensors, in the DeciLM format
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "nemotron-nas"
    reloaded = AutoPrunedModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = pruner.tokenizer("The BBC reported that", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, pruner.model(ids).logits, rtol=1e-5, atol=1e-5)
