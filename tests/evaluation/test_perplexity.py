import copy
import math

import pytest
import torch
import torch.nn.functional as F

from optimum_prune.evaluation import perplexity

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "",
    "Pruning removes weights, heads or channels from a trained network while keeping its accuracy. " * 4,
    "Perplexity is the exponential of the mean negative log-likelihood per token.",
]


def reference_ppl(model, tokenizer, texts, seq_len, max_tokens=None):
    """Direct re-implementation: per-window mean cross-entropy, then exp of the mean over windows."""
    ids = tokenizer("\n\n".join(texts), return_tensors="pt").input_ids[0]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    losses = []
    with torch.no_grad():
        for i in range(ids.numel() // seq_len):
            window = ids[i * seq_len : (i + 1) * seq_len]
            logits = model(window[None]).logits[0]
            losses.append(F.cross_entropy(logits[:-1].double(), window[1:]).item())
    return math.exp(sum(losses) / len(losses)), len(losses)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_matches_reference(tiny_llama, smollm2_tokenizer, batch_size):
    expected, n_windows = reference_ppl(tiny_llama, smollm2_tokenizer, TEXTS, seq_len=32)
    assert n_windows >= 4
    got = perplexity(tiny_llama, smollm2_tokenizer, TEXTS, seq_len=32, batch_size=batch_size)
    assert got == pytest.approx(expected, rel=1e-5)
    assert 1.0 < got < 2 * len(smollm2_tokenizer)


def test_max_tokens_caps_windows(tiny_llama, smollm2_tokenizer):
    expected, n_windows = reference_ppl(tiny_llama, smollm2_tokenizer, TEXTS, seq_len=32, max_tokens=70)
    assert n_windows == 2  # the 6-token tail is dropped
    assert perplexity(tiny_llama, smollm2_tokenizer, TEXTS, seq_len=32, max_tokens=70) == pytest.approx(
        expected, rel=1e-5
    )


def test_uniform_logits_give_vocab_size(tiny_llama, smollm2_tokenizer):
    model = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # logits are all 0 -> uniform distribution
    assert perplexity(model, smollm2_tokenizer, TEXTS, seq_len=32) == pytest.approx(model.config.vocab_size, rel=1e-6)


def test_accepts_directory_source(tiny_llama, smollm2_tokenizer, tmp_path):
    docs = [t for t in TEXTS if t]
    for i, text in enumerate(docs):
        (tmp_path / f"{i:02d}.txt").write_text(text)
    from_dir = perplexity(tiny_llama, smollm2_tokenizer, tmp_path, seq_len=32)
    assert from_dir == perplexity(tiny_llama, smollm2_tokenizer, docs, seq_len=32)


def test_too_few_tokens(tiny_llama, smollm2_tokenizer):
    with pytest.raises(ValueError, match=r"at least seq_len=2048 tokens.*only \d+ tokens"):
        perplexity(tiny_llama, smollm2_tokenizer, TEXTS, seq_len=2048)
    with pytest.raises(ValueError, match="max_tokens"):
        perplexity(tiny_llama, smollm2_tokenizer, TEXTS, seq_len=32, max_tokens=31)
