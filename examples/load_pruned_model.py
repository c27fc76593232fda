"""Load a checkpoint written by optimum_prune and generate with it.

python examples/load_pruned_model.py out/smollm2-np-20   (e.g. after prune_structured_numerical.py or `make demo`,
which saves to demo_output/)
"""

import json
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

import optimum_prune  # noqa: F401  (registers the `optimum_pruned_<base>` model types with the transformers Auto classes)
from optimum_prune import AutoPrunedModelForCausalLM

path = Path(sys.argv[1] if len(sys.argv) > 1 else "demo_output")
side_car = json.loads((path / "pruning_config.json").read_text())
print(f"optimum_prune {side_car['optimum_prune_version']}, history: {[h['method'] for h in side_car['history']]}")
print("loads with stock transformers alone:", side_car["loadable_with_stock_transformers"])

# Exact loader: any missing, unexpected or resized tensor is an error.
model = AutoPrunedModelForCausalLM.from_pretrained(path)
# Plain transformers works too once optimum_prune is imported (or always, for checkpoints with uniform layer shapes).
same_model = AutoModelForCausalLM.from_pretrained(path)
print("loaded as", type(model).__name__, "/", type(same_model).__name__)

tokenizer = AutoTokenizer.from_pretrained(path)
messages = [{"role": "user", "content": "Write one sentence about the history of the BBC."}]
prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
print(tokenizer.decode(out[0, inputs.input_ids.shape[1] :], skip_special_tokens=True))
