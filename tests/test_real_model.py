"""The real SmolLM2-135M (GGUF, dequantized) pruned end to end on BBC text, small and fast."""

import json
import math

import pytest
from testing_utils import SMALL_DEMO

from optimum_prune import AutoPrunedModelForCausalLM
from optimum_prune.calibration.data import bbc_news_dir, load_texts, split_documents
from optimum_prune.evaluation import perplexity
from optimum_prune.samples import SMOLLM2_GGUF_FILE, smollm2_dir


def test_smollm2_numerical_pruning_end_to_end(smollm2_small_demo):
    """SmolLM2-135M (GGUF, dequantized) pruned by NP's default at 20% from 4 x 64 BBC calibration tokens (the demo at
    `SMALL_DEMO`, the pipeline the quickstart runs): the measured ratio, the servable shapes, a perplexity that rises
    but stays in bounds, a DeciLM folder that reloads to the same logits."""
    demo_dir, demo = smollm2_small_demo
    report = demo["report"]
    assert abs(report["measured"] - 0.2) < 0.02
    assert report["calibration"]["num_samples"] == SMALL_DEMO["num_samples"]
    # the default allocation on a llama model: every head kept, MLP widths in blocks of 256 (the DeciLM shapes)
    assert report["config"]["allocation"] == "servable"
    assert all(
        layer["num_attention_heads"] == 9 and layer["intermediate_size"] % 256 == 0 for layer in report["layers"]
    )
    dense_ppl, pruned_ppl = demo["dense"]["perplexity"], demo["pruned"]["perplexity"]
    # Measured: 61.63 -> 138.01 (2.24x) on the 1,024 held-out tokens, from these 256 calibration tokens (the
    # committed demo, 32 x 256: 1.47x). 2.5x leaves 10% for numerical drift.
    assert math.isfinite(pruned_ppl) and dense_ppl < pruned_ppl < 2.5 * dense_ppl, (dense_ppl, pruned_ppl)
    # a GGUF-loaded model saves as safetensors, in the DeciLM format, and reloads to the pruned model's logits
    assert (demo_dir / "model.safetensors").is_file() and (demo_dir / "tokenizer.json").is_file()
    assert json.loads((demo_dir / "config.json").read_text())["model_type"] == "nemotron-nas"
    assert demo["reload"]["max_abs_logit_diff"] <= 1e-5, demo["reload"]  # run_demo compares them (2 x 64 tokens)
    reloaded = AutoPrunedModelForCausalLM.from_pretrained(demo_dir)
    assert reloaded.num_parameters() == demo["pruned"]["parameters"]


def test_cli_and_demo_score_the_same_sample(smollm2_small_demo, tmp_path, capsys):
    """The demo and `optimum-prune prune` / `eval` with the same flags give the same model and the same perplexity:
    the held-out documents of the split in the same seeded order, so the token cap samples every BBC category."""
    from optimum_prune.cli import main

    demo_dir, demo = smollm2_small_demo  # run_demo(**SMALL_DEMO): the same flags as below
    flags = {k: str(v) for k, v in SMALL_DEMO.items()}
    gguf = str(smollm2_dir() / SMOLLM2_GGUF_FILE)
    split = ["--holdout-fraction", "0.2", "--split-seed", "0"]
    prune = ["prune", gguf, "--method", "numerical", "--ratio", flags["ratio"], "--calib", "bbc", *split,
             "--num-samples", flags["num_samples"], "--seq-len", flags["seq_len"], "-o", str(tmp_path / "cli")]  # fmt: skip
    assert main(prune) == 0
    capsys.readouterr()
    scores = {}
    scored = ["--seq-len", flags["eval_seq_len"], "--max-tokens", flags["eval_tokens"]]
    for name, path in (("demo", demo_dir), ("cli", tmp_path / "cli")):
        argv = ["eval", str(path), "--data", "bbc", *split, *scored]
        assert main(argv) == 0
        scores[name] = json.loads(capsys.readouterr().out)["perplexity"]
    assert scores["demo"] == pytest.approx(demo["pruned"]["perplexity"], rel=1e-6), scores
    assert scores["cli"] == pytest.approx(scores["demo"], rel=1e-4), scores
    # the sample mixes the categories: the first 1,024 tokens of the held-out articles in directory order (business
    # only) score differently
    docs = split_documents(load_texts(str(bbc_news_dir())), 0.2, seed=0, shuffle_held_out=False)[1]
    model = AutoPrunedModelForCausalLM.from_pretrained(demo_dir)
    unshuffled = perplexity(model, pruner_tokenizer(demo_dir), docs, seq_len=SMALL_DEMO["eval_seq_len"],
                            max_tokens=SMALL_DEMO["eval_tokens"])  # fmt: skip
    assert abs(unshuffled / scores["demo"] - 1) > 0.05, (unshuffled, scores)


def pruner_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
