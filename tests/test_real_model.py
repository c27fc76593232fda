"""The real SmolLM2-135M (GGUF, dequantized) pruned end to end on BBC text, small and fast."""

import json
import math

import pytest
import torch

from optimum_prune import AutoPrunedModelForCausalLM, AutoPruner, CalibrationConfig, NumericalConfig
from optimum_prune.calibration.data import bbc_news_dir, load_texts, split_documents
from optimum_prune.evaluation import perplexity
from optimum_prune.samples import SMOLLM2_GGUF_FILE, smollm2_dir


def test_smollm2_numerical_pruning_end_to_end(tmp_path):
    pruner = AutoPruner.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF_FILE)
    calib_docs, eval_docs = split_documents(load_texts(str(bbc_news_dir())), 0.5, seed=0, shuffle_held_out=False)
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


def test_cli_and_demo_score_the_same_sample(tmp_path, capsys):
    """The demo and `optimum-prune prune` / `eval` with the same flags give the same model and the same perplexity:
    the held-out documents of the split in the same seeded order, so the token cap samples every BBC category."""
    from optimum_prune.cli import main
    from optimum_prune.cli.demo import run_demo

    flags = {"ratio": 0.2, "num_samples": 4, "seq_len": 64, "eval_seq_len": 128, "eval_tokens": 1024}
    demo = run_demo(
        output_dir=tmp_path / "demo", results_dir=None, bench_repeats=2, bench_new_tokens=2, max_new_tokens=2, **flags
    )
    gguf = str(smollm2_dir() / SMOLLM2_GGUF_FILE)
    split = ["--holdout-fraction", "0.2", "--split-seed", "0"]
    prune = ["prune", gguf, "--method", "numerical", "--ratio", "0.2", "--calib", "bbc", *split]
    assert main([*prune, "--num-samples", "4", "--seq-len", "64", "-o", str(tmp_path / "cli")]) == 0
    capsys.readouterr()
    scores = {}
    for name in ("demo", "cli"):
        argv = ["eval", str(tmp_path / name), "--data", "bbc", *split, "--seq-len", "128", "--max-tokens", "1024"]
        assert main(argv) == 0
        scores[name] = json.loads(capsys.readouterr().out)["perplexity"]
    assert scores["demo"] == pytest.approx(demo["pruned"]["perplexity"], rel=1e-6), scores
    assert scores["cli"] == pytest.approx(scores["demo"], rel=1e-4), scores
    # the sample mixes the categories: the first 1,024 tokens of the held-out articles in directory order (business
    # only) score differently
    docs = split_documents(load_texts(str(bbc_news_dir())), 0.2, seed=0, shuffle_held_out=False)[1]
    model = AutoPrunedModelForCausalLM.from_pretrained(tmp_path / "demo")
    unshuffled = perplexity(model, pruner_tokenizer(tmp_path / "demo"), docs, seq_len=128, max_tokens=1024)
    assert abs(unshuffled / scores["demo"] - 1) > 0.05, (unshuffled, scores)


def pruner_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
