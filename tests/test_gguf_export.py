"""GGUF export: files checked with `gguf.GGUFReader` and read back with transformers' own GGUF loader (no llama.cpp)."""

from __future__ import annotations

import json
import logging

import gguf
import numpy as np
import pytest
import torch
from testing_utils import tiny_model
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from optimum_prune import (
    AutoPruner,
    FLAPConfig,
    MagnitudeConfig,
    NumericalConfig,
    export_gguf,
    prune_,
    save_pruned_model,
)
from optimum_prune.cli import main
from optimum_prune.constants import PRUNING_CONFIG_NAME
from optimum_prune.export import GGUFExportError
from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view
from optimum_prune.modeling.shapes import layer_table

PROBES = [
    "Hello world! 3,141 reporters in 2024.",
    "naïve café — “quotes” 日本語 русский 🚀🦙",
    "def f(x):\n    return {'a': [1, 2]}\n\n\n\tpass   ",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def _model(arch: str, tokenizer, seed: int = 0, **overrides):
    return tiny_model(
        arch, seed, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, **overrides,
    )  # fmt: skip


def _ids(vocab: int, n: int = 4, length: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model, ids):
    return model(input_ids=ids, use_cache=False).logits.float()


def _fields(reader: gguf.GGUFReader) -> dict:
    out = {}
    for name, field in reader.fields.items():
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            if len(field.types) > 1 and field.types[1] == gguf.GGUFValueType.STRING:
                out[name] = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                out[name] = [field.parts[i].tolist()[0] for i in field.data]
        elif field.types and field.types[0] == gguf.GGUFValueType.STRING:
            out[name] = bytes(field.parts[field.data[0]]).decode("utf-8")
        elif field.types:
            out[name] = field.parts[field.data[0]].tolist()[0]
    return out


def _tensors(reader: gguf.GGUFReader) -> dict:
    return {t.name: t for t in reader.tensors}


def _unpermute(w: np.ndarray, head_dim: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K reordering."""
    n_head = w.shape[0] // head_dim
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def small_tokenizer():
    """A byte-level BPE tokenizer of ~400 tokens trained here (a 49k vocabulary makes every GGUF read slow)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(PROBES * 20 + ["The quick brown fox jumps over the lazy dog. " * 5], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


@pytest.fixture(scope="module")
def per_layer_llama(small_tokenizer):
    model = _model("llama_gqa", small_tokenizer)
    prune_(model, NumericalConfig(pruning_ratio=0.35, round_to=1), _ids(len(small_tokenizer)))
    shapes = layer_table(model, get_spec(model))
    assert len({(r["num_attention_heads"], r["intermediate_size"]) for r in shapes}) > 1, "not per-layer"
    return model


def test_per_layer_llama_is_deci_with_per_layer_arrays(per_layer_llama, small_tokenizer, tmp_path):
    model = per_layer_llama
    path = export_gguf(model, tmp_path / "sub" / "m.gguf", "f32", tokenizer=small_tokenizer)
    assert path == (tmp_path / "sub" / "m.gguf").absolute() and path.is_file()
    assert [p.name for p in path.parent.iterdir()] == ["m.gguf"]  # no temporary file left behind
    reader = gguf.GGUFReader(path)
    f, tensors = _fields(reader), _tensors(reader)
    shapes = layer_table(model, get_spec(model))
    assert f["general.architecture"] == "deci"
    assert f["deci.attention.head_count"] == [r["num_attention_heads"] for r in shapes]
    assert f["deci.attention.head_count_kv"] == [r["num_key_value_heads"] for r in shapes]
    assert f["deci.feed_forward_length"] == [r["intermediate_size"] for r in shapes]
    assert f["deci.attention.key_length"] == f["deci.rope.dimension_count"] == 12
    assert f["optimum_prune.method"] == "numerical"
    assert f["optimum_prune.pruning_ratio"] == pytest.approx(0.35)
    assert json.loads(f["optimum_prune.config"])["round_to"] == 1
    assert "output.weight" not in tensors  # tied embeddings
    spec = get_spec(model)
    for i, layer in enumerate(get_layers(model, spec)):
        view = layer_view(layer, i, spec, model.config)
        for hf, ours, permuted in (
            ("q_proj", "attn_q", True),
            ("k_proj", "attn_k", True),
            ("v_proj", "attn_v", False),
        ):
            w = getattr(layer.self_attn, hf).weight.detach().numpy()
            t = tensors[f"blk.{i}.{ours}.weight"]
            assert list(t.shape) == [w.shape[1], w.shape[0]]  # GGUF lists dimensions innermost first
            data = np.asarray(t.data).reshape(w.shape)
            if permuted:
                assert not np.array_equal(data, w)
                data = _unpermute(data, view.head_dim)
            np.testing.assert_array_equal(data, w)
        down = tensors[f"blk.{i}.ffn_down.weight"]
        assert list(down.shape) == [view.intermediate_size, 72]


def test_per_layer_qwen2_is_deci_with_permuted_biases(small_tokenizer, tmp_path):
    model = _model("qwen2", small_tokenizer)
    prune_(model, NumericalConfig(pruning_ratio=0.35, round_to=1), _ids(len(small_tokenizer)))
    shapes = layer_table(model, get_spec(model))
    assert len({str(r) for r in shapes}) > 1, "not per-layer"
    path = export_gguf(model, tmp_path / "q.gguf", "f32", tokenizer=small_tokenizer)
    reader = gguf.GGUFReader(path)
    f, tensors = _fields(reader), _tensors(reader)
    assert f["general.architecture"] == "deci"
    assert f["deci.attention.head_count"] == [r["num_attention_heads"] for r in shapes]
    for i, layer in enumerate(model.model.layers):
        for hf, ours in (("q_proj", "attn_q"), ("k_proj", "attn_k")):
            b = getattr(layer.self_attn, hf).bias.detach().numpy()
            np.testing.assert_array_equal(_unpermute(np.asarray(tensors[f"blk.{i}.{ours}.bias"].data), 16), b)
        np.testing.assert_array_equal(
            tensors[f"blk.{i}.attn_v.bias"].data, layer.self_attn.v_proj.bias.detach().numpy()
        )


@pytest.mark.parametrize(
    ("arch", "gguf_arch", "kwargs"),
    [
        ("llama_gqa", "llama", {"allocation": "uniform"}),
        ("mistral", "llama", {"allocation": "uniform"}),
        ("qwen2", "qwen2", {"allocation": "uniform", "prune_attention": False}),
        ("qwen3", "qwen3", {"allocation": "uniform", "prune_attention": False}),
    ],
)
def test_uniform_export_reads_back_with_transformers(arch, gguf_arch, kwargs, small_tokenizer, tmp_path):
    # transformers' GGUF loader derives qwen3's head_dim from its config default (128), not from the file
    model = _model(arch, small_tokenizer, **({"head_dim": 128} if arch == "qwen3" else {}))
    prune_(model, MagnitudeConfig(pruning_ratio=0.3, round_to=1, **kwargs))
    ids = _ids(len(small_tokenizer), 2, 12, seed=1)
    expected = _logits(model, ids)
    export_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=small_tokenizer)
    assert _fields(gguf.GGUFReader(tmp_path / "m.gguf"))["general.architecture"] == gguf_arch
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", attn_implementation="eager").eval()
    assert loaded.config.intermediate_size == model.model.layers[0].mlp.down_proj.in_features
    torch.testing.assert_close(_logits(loaded, ids), expected, rtol=1e-4, atol=1e-4)


def test_autopruner_parses_a_gguf_file_once_and_loads_what_transformers_loads(small_tokenizer, tmp_path, monkeypatch):
    """`AutoPruner.from_pretrained(dir, gguf_file=...)` reads the file's metadata once (transformers alone: once for
    the config, the weights and the tokenizer each), and gets the same weights and tokenizer as transformers'
    loaders; `gguf.GGUFReader` is itself again afterwards."""
    from optimum_prune import AutoPruner

    model = _model("llama_gqa", small_tokenizer)
    export_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=small_tokenizer)
    made, parsed = gguf.GGUFReader, []

    class Counting(made):
        def __init__(self, *args, **kwargs):
            parsed.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    pruner = AutoPruner.from_pretrained(tmp_path, gguf_file="m.gguf")
    assert len(parsed) == 1 and gguf.GGUFReader is Counting, parsed
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf")
    assert len(parsed) == 3  # transformers' own: the config and the weights
    ours, theirs = pruner.model.state_dict(), stock.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in PROBES:
        assert pruner.tokenizer(text)["input_ids"] == back(text)["input_ids"], text
    # loads in two threads at once: one parse each, and the reader is transformers' own again afterwards
    from concurrent.futures import ThreadPoolExecutor

    parsed.clear()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: AutoPruner.from_pretrained(tmp_path, gguf_file="m.gguf"), range(2)))
    assert len(parsed) == 2 and gguf.GGUFReader is Counting, parsed


@pytest.mark.parametrize("which", ["small", "smollm2"])
def test_tokenizer_is_complete_and_reads_back(which, small_tokenizer, smollm2_tokenizer, tmp_path):
    tok = small_tokenizer if which == "small" else smollm2_tokenizer
    model = _model("llama_gqa", tok)
    export_gguf(model, tmp_path / "m.gguf", "f16", tokenizer=tok)
    f = _fields(gguf.GGUFReader(tmp_path / "m.gguf"))
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    assert len(f["tokenizer.ggml.tokens"]) == len(tok)
    assert f["tokenizer.ggml.tokens"][tok.eos_token_id] == tok.eos_token
    assert f["tokenizer.ggml.token_type"][tok.eos_token_id] == gguf.TokenType.CONTROL
    assert f["tokenizer.ggml.token_type"][len(tok) - 1] == gguf.TokenType.NORMAL
    assert (
        f["tokenizer.ggml.bos_token_id"] == tok.bos_token_id and f["tokenizer.ggml.eos_token_id"] == tok.eos_token_id
    )
    assert f["tokenizer.ggml.add_bos_token"] is False  # neither tokenizer adds a BOS
    assert f.get("tokenizer.chat_template") == tok.chat_template
    assert len(f["tokenizer.ggml.merges"]) == len(json.loads(tok.backend_tokenizer.to_str())["model"]["merges"])
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in PROBES:
        assert back(text)["input_ids"] == tok(text)["input_ids"], text


def test_q8_0_leaves_unaligned_rows_f16_and_logs(per_layer_llama, small_tokenizer, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="optimum_prune.export.gguf"):
        path = export_gguf(per_layer_llama, tmp_path / "q.gguf", "q8_0", tokenizer=small_tokenizer)
    tensors = _tensors(gguf.GGUFReader(path))
    kinds = {n: t.tensor_type for n, t in tensors.items()}
    assert kinds["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16  # rows of 72 (hidden size)
    assert kinds["token_embd.weight"] == gguf.GGMLQuantizationType.F16
    assert kinds["output_norm.weight"] == gguf.GGMLQuantizationType.F32
    for i, layer in enumerate(per_layer_llama.model.layers):
        width = layer.mlp.down_proj.in_features
        expected = gguf.GGMLQuantizationType.Q8_0 if width % 32 == 0 else gguf.GGMLQuantizationType.F16
        assert kinds[f"blk.{i}.ffn_down.weight"] == expected
    assert "stay f16" in caplog.text and "blk.0.attn_q.weight" in caplog.text


def test_q8_0_quantizes_aligned_rows(small_tokenizer, tmp_path):
    model = _model("llama", small_tokenizer)  # hidden 64, MLP 96: every row a multiple of 32
    path = export_gguf(model, tmp_path / "q.gguf", "q8_0", tokenizer=small_tokenizer)
    tensors = _tensors(gguf.GGUFReader(path))
    weights = {"blk.1.ffn_down.weight": model.model.layers[1].mlp.down_proj.weight, "token_embd.weight": None}
    weights["token_embd.weight"] = model.model.embed_tokens.weight
    for name, t in tensors.items():
        if len(t.shape) == 2:
            assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0, name
    for name, w in weights.items():
        w = w.detach().numpy()
        back = gguf.quants.dequantize(np.asarray(tensors[name].data), gguf.GGMLQuantizationType.Q8_0).reshape(w.shape)
        step = np.abs(w).reshape(-1, 32).max(1) / 127  # q8_0: one scale per block of 32
        assert (np.abs(back - w).reshape(-1, 32) <= step[:, None] * 0.6 + 1e-6).all(), name


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_per_layer_qwen3_gemma3_refused_before_writing(arch, small_tokenizer, tmp_path):
    model = _model(arch, small_tokenizer)
    prune_(model, NumericalConfig(pruning_ratio=0.35, round_to=1), _ids(len(small_tokenizer)))
    with pytest.raises(GGUFExportError, match="allocation='uniform'"):
        export_gguf(model, tmp_path / "x" / "m.gguf", tokenizer=small_tokenizer)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("ratio", [0.1, 0.2])
@pytest.mark.parametrize("config_cls", [NumericalConfig, FLAPConfig])
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_default_config_exports_where_the_graph_has_no_output_bias(arch, config_cls, ratio, small_tokenizer, tmp_path):
    """NP's and FLAP's defaults add no o_proj / down_proj bias on Qwen3 / Gemma-3 (llama.cpp's graphs read none), so
    the default output exports, in the shape llama.cpp runs for them (`allocation="uniform"`; `round_to=1`: the
    default 64 leaves a 96-wide tiny MLP whole); the saved config records the resolved setting. Forcing the bias on
    is what the exporter refuses."""
    key = "compensation_bias" if config_cls is NumericalConfig else "bias_compensation"
    overrides = {"query_pre_attn_scalar": 16} if arch == "gemma3" else {}
    ids = _ids(len(small_tokenizer))
    model = _model(arch, small_tokenizer, **overrides)
    report = prune_(model, config_cls(pruning_ratio=ratio, allocation="uniform", round_to=1), ids)
    assert report.measured > 0.05 and report.config[key] is False
    assert not any(row["biases"] for row in layer_table(model, get_spec(model)))
    save_pruned_model(model, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / PRUNING_CONFIG_NAME).read_text())["history"][-1]["config"]
    assert saved[key] is False  # what the saved config records
    path = export_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=small_tokenizer)
    assert _fields(gguf.GGUFReader(path))["general.architecture"] == arch
    forced = _model(arch, small_tokenizer, **overrides)
    prune_(forced, config_cls(pruning_ratio=ratio, allocation="uniform", round_to=1, **{key: True}), ids)
    with pytest.raises(GGUFExportError, match="has no bias for"):
        export_gguf(forced, tmp_path / "f.gguf", tokenizer=small_tokenizer)


def test_default_bias_stays_where_the_graph_reads_one(small_tokenizer):
    """On Llama (llama.cpp's graph reads an o_proj / down_proj bias) FLAP keeps its bias compensation by default."""
    model = _model("llama_gqa", small_tokenizer)
    report = prune_(model, FLAPConfig(pruning_ratio=0.2, round_to=1), _ids(len(small_tokenizer)))
    assert report.config["bias_compensation"] is True
    assert all(row["biases"] for row in layer_table(model, get_spec(model)))


def test_gemma3_uniform_export(small_tokenizer, tmp_path):
    # GGUFReader checks only: transformers' GGUF loader does not read gemma3's sliding-window pattern back
    model = _model("gemma3", small_tokenizer, query_pre_attn_scalar=16)
    prune_(model, MagnitudeConfig(pruning_ratio=0.3, allocation="uniform", round_to=1))
    f = _fields(gguf.GGUFReader(export_gguf(model, tmp_path / "g.gguf", "f32", tokenizer=small_tokenizer)))
    assert f["general.architecture"] == "gemma3"
    assert f["gemma3.attention.sliding_window"] == 8
    assert f["gemma3.attention.sliding_window_pattern"] == [True, False, True]
    tensors = _tensors(gguf.GGUFReader(tmp_path / "g.gguf"))
    norm = model.model.layers[0].input_layernorm.weight.detach().numpy()
    np.testing.assert_allclose(tensors["blk.0.attn_norm.weight"].data, norm + 1.0)  # Gemma's (1 + w) folded in
    bad = _model("gemma3", small_tokenizer)  # query_pre_attn_scalar 256 != head_dim 16
    with pytest.raises(GGUFExportError, match="query_pre_attn_scalar"):
        export_gguf(bad, tmp_path / "b.gguf", tokenizer=small_tokenizer)


def test_refusals_leave_nothing_written(small_tokenizer, tmp_path):
    model = _model("llama", small_tokenizer)
    layer = model.model.layers[1]
    layer.mlp.gate_proj, layer.mlp.up_proj = nn.Linear(64, 0, bias=False), nn.Linear(64, 0, bias=False)
    layer.mlp.down_proj = nn.Linear(0, 64, bias=False)
    with pytest.raises(GGUFExportError, match="Layer 1 keeps attention but no MLP channel"):
        export_gguf(model, tmp_path / "m.gguf", tokenizer=small_tokenizer)
    from optimum_prune.evaluation.cost_model import NO_OP, assembled_model, layer_row_of

    c = model.config  # a last layer with neither sublayer: llama.cpp aborts on it
    empty_last = assembled_model(c, [layer_row_of(c, c.num_key_value_heads, 256), layer_row_of(c, NO_OP, NO_OP)])
    with pytest.raises(GGUFExportError, match="last layer has neither attention nor MLP"):
        export_gguf(empty_last, tmp_path / "m.gguf", tokenizer=small_tokenizer)
    first_without = assembled_model(c, [layer_row_of(c, NO_OP, 256), layer_row_of(c, c.num_key_value_heads, 256)])
    with pytest.raises(GGUFExportError, match="Layer 0 has no attention"):  # llama.cpp reads head sizes from it
        export_gguf(first_without, tmp_path / "m.gguf", tokenizer=small_tokenizer)
    opt = _model("opt", small_tokenizer)
    with pytest.raises(GGUFExportError, match="GGUF export supports"):
        export_gguf(opt, tmp_path / "m.gguf", tokenizer=small_tokenizer)
    with pytest.raises(GGUFExportError, match="tokenizer"):
        export_gguf(_model("llama", small_tokenizer), tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="outtype"):
        export_gguf(_model("llama", small_tokenizer), tmp_path / "m.gguf", "q4_k", tokenizer=small_tokenizer)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "m.gguf").write_bytes(b"keep me")
    with pytest.raises(FileExistsError):
        export_gguf(_model("llama", small_tokenizer), tmp_path / "m.gguf", tokenizer=small_tokenizer)
    assert (tmp_path / "m.gguf").read_bytes() == b"keep me"


def test_cli_and_directory_export(per_layer_llama, small_tokenizer, tmp_path, capsys):
    save_pruned_model(per_layer_llama, tmp_path / "pruned", small_tokenizer)
    assert main(["export-gguf", "--model", str(tmp_path / "pruned"), "--output", str(tmp_path / "o" / "m.gguf")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["output"] == str((tmp_path / "o" / "m.gguf").absolute()) and out["outtype"] == "f16"
    reader = gguf.GGUFReader(tmp_path / "o" / "m.gguf")
    assert _fields(reader)["general.architecture"] == "deci"
    assert _tensors(reader)["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert main(["export-gguf", "--model", str(tmp_path / "pruned"), "--output", str(tmp_path / "o" / "m.gguf")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["export-gguf", "--model", str(tmp_path / "nope"), "--output", str(tmp_path / "n.gguf")]) == 2


def test_auto_pruner_exports_with_the_tokenizer_it_holds(per_layer_llama, small_tokenizer, tmp_path):
    pruner = AutoPruner(per_layer_llama, small_tokenizer)
    path = pruner.export_gguf(tmp_path / "m.gguf", outtype="f32")
    direct = export_gguf(per_layer_llama, tmp_path / "direct.gguf", "f32", tokenizer=small_tokenizer)
    assert path.read_bytes() == direct.read_bytes()  # the same file as the function given the same tokenizer
    with pytest.raises(FileExistsError):
        pruner.export_gguf(tmp_path / "m.gguf")
    with pytest.raises(GGUFExportError, match="holds none"):
        AutoPruner(per_layer_llama).export_gguf(tmp_path / "none.gguf")
    assert not (tmp_path / "none.gguf").exists()


def _bpe_tokenizer(pre_tokenizer, byte_fallback: bool = False):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(byte_fallback=byte_fallback))
    tk.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(PROBES * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def test_pre_tokenizer_is_matched_by_definition_or_refused():
    from tokenizers import pre_tokenizers

    from optimum_prune.export.gguf_tokenizer import GGUFTokenizerError, tokenizer_metadata

    digits = _bpe_tokenizer(
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)])
    )
    assert tokenizer_metadata(digits, 300)["pre"] in ("smollm", "starcoder")
    with pytest.raises(GGUFTokenizerError, match="not one llama.cpp implements"):
        tokenizer_metadata(
            _bpe_tokenizer(pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.ByteLevel(False)])), 300
        )
    with pytest.raises(GGUFTokenizerError, match="no llama.cpp equivalent"):
        tokenizer_metadata(_bpe_tokenizer(pre_tokenizers.Whitespace()), 300)
    with pytest.raises(GGUFTokenizerError, match="byte-level BPE"):
        tokenizer_metadata(_bpe_tokenizer(pre_tokenizers.ByteLevel(False), byte_fallback=True), 300)
    with pytest.raises(GGUFTokenizerError, match="embedding has 10 rows"):
        tokenizer_metadata(digits, 10)


def test_spp_language_model_default_exports_per_layer(small_tokenizer, tmp_path):
    """SPP's language-model default cuts MLP channels only and refits without an intercept: its members keep every
    attention dimension and add no bias, so they export to llama.cpp's per-layer graph with the widths they have
    (pruned head dimensions, `prune_attention=True`, are refused: tests/methods/test_spp.py)."""
    from optimum_prune import SPPConfig

    model = _model("llama_gqa", small_tokenizer)
    search = {"faithful_to": "code", "steps": 10, "batch_size": 1, "lr": 0.08, "lambda_": 0.7, "betas": (0.5, 0.9)}
    prune_(model, SPPConfig(pruning_ratio=0.3, round_to=1, **search), _ids(len(small_tokenizer), 8, 16))
    shapes = layer_table(model, get_spec(model))
    assert len({r["intermediate_size"] for r in shapes}) > 1
    assert not any("qk_head_dim" in r or r["biases"] for r in shapes)
    f = _fields(gguf.GGUFReader(export_gguf(model, tmp_path / "spp.gguf", "f32", tokenizer=small_tokenizer)))
    assert f["general.architecture"] == "deci"
    assert f["deci.feed_forward_length"] == [r["intermediate_size"] for r in shapes]
