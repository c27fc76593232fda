import copy
import math

import pytest
import torch
import torch.nn.functional as F

from optimum_prune.evaluation import perplexity, score_documents

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


def reference_document_nll(model, tokenizer, texts, seq_len, max_tokens=None):
    """Direct per-document sums: each target token's NLL added to the document whose text its first character is in,
    found by tokenizing the join one document prefix at a time (no offsets)."""
    joined = "\n\n".join(texts)
    ids = tokenizer(joined, return_tensors="pt").input_ids[0]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    enc = tokenizer(joined, return_offsets_mapping=True)
    ends, pos = [], 0
    for t in texts:
        pos += len(t)
        ends.append(pos)  # the separator after a document belongs to it
        pos += 2
    sums, counts = {}, {}
    with torch.no_grad():
        for i in range(ids.numel() // seq_len):
            window = ids[i * seq_len : (i + 1) * seq_len]
            nll = F.cross_entropy(model(window[None]).logits[0, :-1].double(), window[1:], reduction="none")
            for j, x in enumerate(nll.tolist()):
                start = enc["offset_mapping"][i * seq_len + j + 1][0]
                doc = next(k for k, e in enumerate(ends) if start <= e + 1)
                sums[doc] = sums.get(doc, 0.0) + x
                counts[doc] = counts.get(doc, 0) + 1
    return sums, counts


def test_document_scores_sum_to_the_perplexity(tiny_llama, smollm2_tokenizer):
    texts = [t for t in TEXTS if t] + ["A fifth document, short."]
    scores = score_documents(tiny_llama, smollm2_tokenizer, texts, seq_len=24, max_tokens=150)
    want_sums, want_counts = reference_document_nll(tiny_llama, smollm2_tokenizer, texts, seq_len=24, max_tokens=150)
    assert scores.unit == "document"
    assert scores.units == sorted(want_sums) and len(scores.units) >= 3  # windows span documents
    assert scores.tokens == [want_counts[d] for d in scores.units]
    assert scores.nll == pytest.approx([want_sums[d] for d in scores.units], rel=1e-5)
    assert sum(scores.tokens) == (150 // 24) * 23
    assert scores.perplexity == pytest.approx(math.exp(sum(scores.nll) / sum(scores.tokens)), rel=1e-12)
    assert scores.perplexity == perplexity(tiny_llama, smollm2_tokenizer, texts, seq_len=24, max_tokens=150)


def test_document_scores_without_offsets_fall_back_to_windows(tiny_llama, smollm2_tokenizer, monkeypatch):
    class NoOffsets:
        def __call__(self, text, return_offsets_mapping=False, **kw):
            if return_offsets_mapping:
                raise NotImplementedError("slow tokenizer")
            return smollm2_tokenizer(text, **kw)

    scores = score_documents(tiny_llama, NoOffsets(), TEXTS, seq_len=32)
    assert scores.unit == "window"
    assert scores.tokens == [31] * len(scores.tokens) and scores.units == list(range(len(scores.tokens)))
    assert scores.perplexity == perplexity(tiny_llama, smollm2_tokenizer, TEXTS, seq_len=32)
