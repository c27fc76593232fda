import pytest
import torch

from optimum_prune.calibration.data import bbc_news_dir, load_texts


@pytest.fixture(scope="session")
def docs():
    """40 BBC articles: enough for a few training windows of 32 tokens and a held-out part."""
    return load_texts(bbc_news_dir())[::50][:40]


@pytest.fixture(scope="session")
def learnable_docs():
    """10 short documents repeating one sentence: a random tiny model starts near uniform over the 49k-token
    vocabulary (perplexity ~5e4) and a few optimizer steps measurably fit it (also on the held-out documents)."""
    return [f"Document {i}. " + "the cat sat on the mat and the dog ate the bone. " * 12 for i in range(10)]


@pytest.fixture
def make_tiny(smollm2_tokenizer):
    """A fresh 2-layer random Llama over the SmolLM2 vocabulary (the tests mutate it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(seed: int = 0, **overrides):
        kwargs = {"vocab_size": len(smollm2_tokenizer), "hidden_size": 64, "intermediate_size": 128,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "max_position_embeddings": 256}  # fmt: skip
        config = LlamaConfig(**{**kwargs, **overrides})
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()

    return make


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits
