"""The real SmolLM2-135M (GGUF, dequantized) pruned end to end on BBC text, small and fast."""

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
    # SmolLM2 has 3 KV groups of 3 query heads: heads go by whole groups
    assert all(layer["num_attention_heads"] == 3 * layer["num_key_value_heads"] for layer in report.layers)
    pruned_ppl = perplexity(pruner.model, pruner.tokenizer, eval_docs, seq_len=128, max_tokens=1024)
    # Re-measured with today's default at 20% (FLAP's metric, bias refit at half strength): 37.01 -> 54.86 (1.48x);
    # the former default (the numerical scores, full refit) gives 59.26 (1.60x) here. 1.56x leaves 5% for numerical
    # drift and fails if the default falls back to the former rule or anything worse.
    assert math.isfinite(pruned_ppl) and dense_ppl < pruned_ppl < 1.56 * dense_ppl, (dense_ppl, pruned_ppl)
    pruner.save_pretrained(tmp_path / "out")  # a GGUF-loaded model saves as safetensors
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()
    reloaded = AutoPrunedModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = pruner.tokenizer("The BBC reported that", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, pruner.model(ids).logits, rtol=1e-5, atol=1e-5)
