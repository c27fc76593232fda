"""The DeciLM format (`model_type: "nemotron-nas"`): what `save_pretrained` writes for per-layer shapes the serving
engines load, checked by readers we did not write: llama.cpp's own converter, and a float64 forward written from the
format's published semantics (`block_configs`), not from optimum-prune's modeling code."""

import json
import math
import string
import subprocess
import sys

import numpy as np
import pytest
import torch
from llamacpp_converter import convert
from safetensors.torch import load_file
from testing_utils import assert_cached_decoding_matches, calibration_ids, logits, tiny_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from optimum_prune import AutoPrunedModelForCausalLM, load_pruned_model, save_pruned_model
from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view
from optimum_prune.modeling.surgery import apply_layer_plan_
from optimum_prune.plan import LayerPlan

# One layer of each kind the format holds: (query heads kept, KV heads, MLP width) with 0 = the sublayer removed.
# Layer 0 full; 1: MLP narrowed; 2: no attention, narrow MLP; 3: the whole layer removed; 4: one KV head for all four
# query heads (n_heads_in_group 4) and a mid MLP.
LAYERS = [(4, 2, 768), (4, 2, 256), (0, 0, 512), (0, 0, 0), (4, 1, 512)]


def _byte_fallback_tokenizer():
    """A tiny SentencePiece-style BPE tokenizer (byte fallback), the kind llama.cpp's DeciLM converter reads for a
    vocabulary other than Llama 3's."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import LlamaTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))])}
    for c in ["▁", *string.ascii_letters, *string.digits, *".,;:!?'-"]:
        vocab.setdefault(c, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return LlamaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _deci_model(vocab_size: int = 128, tie: bool = False, base: str = "llama") -> LlamaForCausalLM:
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if base == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = config_cls(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=768, num_hidden_layers=len(LAYERS),
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rope_theta=50000.0,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.2 if p.dim() == 2 else 0.1)
    spec = get_spec(model)
    for i, (heads, kv, width) in enumerate(LAYERS):
        view = layer_view(get_layers(model, spec)[i], i, spec, model.config)
        plan = LayerPlan(
            keep_heads=list(range(heads)) if (heads, kv) != (4, 2) else None,
            keep_kv_heads=list(range(kv)) if (heads, kv) != (4, 2) else None,
            keep_channels=list(range(width)) if width != 768 else None,
        )
        apply_layer_plan_(view, plan)
    return model


def _reference_logits(directory, ids: torch.Tensor) -> torch.Tensor:
    """float64 logits from config.json + model.safetensors, per the format: layer `i` adds, unless its `no_op`,
    attention with all `num_attention_heads` query heads (`hidden / heads` wide, rotary `rotate_half` on q and k,
    `heads / n_heads_in_group` KV heads shared by consecutive query heads, causal softmax at `1 / sqrt(head_dim)`)
    after RMSNorm `input_layernorm`, then a SwiGLU MLP of width `int(2·ffn_mult·hidden/3)` rounded up to a multiple
    of 256 after RMSNorm `post_attention_layernorm`."""
    cfg = json.loads((directory / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(directory / "model.safetensors").items()}
    hidden, heads, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["rms_norm_eps"]
    d = hidden // heads

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(x):  # (B, h, T, d)
        t = torch.arange(x.shape[2], dtype=torch.float64)
        ang = t[:, None] * cfg["rope_theta"] ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin

    B, T = ids.shape
    x = w["model.embed_tokens.weight"][ids]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i, block in enumerate(cfg["block_configs"]):
        p = f"model.layers.{i}."
        if not block["attention"]["no_op"]:
            kv = heads // block["attention"]["n_heads_in_group"]
            h = rms(x, w[p + "input_layernorm.weight"])
            q, k, v = (h @ w[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
            if cfg["attention_bias"]:  # all four projections (o_proj's are zeros in a Qwen2 folder)
                q, k, v = (t + w[p + f"self_attn.{n}_proj.bias"] for t, n in zip((q, k, v), "qkv"))
            q = q.view(B, T, heads, d).transpose(1, 2)
            k, v = (t.view(B, T, kv, d).transpose(1, 2) for t in (k, v))
            q, k = rope(q), rope(k)
            k, v = (t.repeat_interleave(heads // kv, dim=1) for t in (k, v))
            a = ((q @ k.transpose(-1, -2)) / math.sqrt(d)).masked_fill(~causal, float("-inf")).softmax(-1)
            x = x + (a @ v).transpose(1, 2).reshape(B, T, hidden) @ w[p + "self_attn.o_proj.weight"].T
            if cfg["attention_bias"]:
                x = x + w[p + "self_attn.o_proj.bias"]
        if not block["ffn"]["no_op"]:
            width = int(2 * block["ffn"]["ffn_mult"] * hidden / 3)
            width += -width % 256
            gate, up, down = (w[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
            assert gate.shape == up.shape == (width, hidden) and down.shape == (hidden, width)
            h = rms(x, w[p + "post_attention_layernorm.weight"])
            x = x + (torch.nn.functional.silu(h @ gate.T) * (h @ up.T)) @ down.T
    x = rms(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T


def test_deci_directory_matches_the_formats_float64_reference_and_reloads_exactly(tmp_path):
    tie = True  # (the converter's test below has an untied head)
    model = _deci_model(tie=tie)
    out = save_pruned_model(model, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "nemotron-nas" and cfg["architectures"] == ["DeciLMForCausalLM"]
    assert cfg["auto_map"] == {"AutoConfig": "configuration_decilm.DeciLMConfig"}
    assert (out / "configuration_decilm.py").is_file() and cfg["tie_word_embeddings"] is tie
    blocks = [
        (b["attention"]["no_op"], b["attention"]["n_heads_in_group"], b["ffn"]["no_op"]) for b in cfg["block_configs"]
    ]
    assert blocks == [(False, 2, False), (False, 2, False), (True, None, False), (True, None, True), (False, 4, False)]
    assert [b["ffn"]["ffn_mult"] for b in cfg["block_configs"]] == [18.0, 6.0, 12.0, None, 12.0]
    assert set(cfg["block_configs"][0]["ffn"]) == {"no_op", "replace_with_linear", "sparsify", "ffn_mult"}  # MLX
    assert cfg["rope_theta"] == 50000.0 and cfg["rope_scaling"] is None and not cfg["attention_bias"]
    names = set(load_file(out / "model.safetensors"))
    assert not any(n.startswith(("model.layers.2.self_attn", "model.layers.2.input_layernorm")) for n in names)
    assert not any(n.startswith("model.layers.3.") for n in names)  # a removed sublayer has no tensor
    assert json.loads((out / "pruning_config.json").read_text())["format"] == "DeciLM (nemotron-nas)"

    ids = calibration_ids(2, 24, seed=7)
    ours = load_pruned_model(out, dtype=torch.float64, attn_implementation="eager")
    reference = _reference_logits(out, ids)
    assert reference.abs().max() > 1  # (transformers computes RMSNorm and the rotary tables in float32)
    torch.testing.assert_close(ours(input_ids=ids).logits, reference, rtol=0, atol=2e-5)
    for loader in (AutoPrunedModelForCausalLM, AutoModelForCausalLM):  # (stock, once optimum_prune is imported)
        reloaded = loader.from_pretrained(out, attn_implementation="eager")
        torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)
    assert_cached_decoding_matches(reloaded)


def test_qwen2_is_written_with_its_qkv_biases_and_a_zero_o_bias(tmp_path, caplog):
    model = _deci_model(base="qwen2")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)  # biases that matter
    with caplog.at_level("WARNING", logger="optimum_prune"):
        out = save_pruned_model(model, tmp_path / "out")
    assert "TensorRT-LLM" in caplog.text and "llama.cpp" in caplog.text
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "nemotron-nas" and cfg["attention_bias"] and not cfg["mlp_bias"]
    assert cfg["optimum_prune_base_model_type"] == "qwen2"
    w = load_file(out / "model.safetensors")
    attention = [i for i, b in enumerate(cfg["block_configs"]) if not b["attention"]["no_op"]]
    assert sorted(k for k in w if k.endswith(".bias")) == sorted(
        f"model.layers.{i}.self_attn.{n}_proj.bias" for i in attention for n in "qkvo"
    )
    assert all(not w[f"model.layers.{i}.self_attn.o_proj.bias"].any() for i in attention)
    ids = calibration_ids(2, 24, seed=7)
    ours = load_pruned_model(out, dtype=torch.float64, attn_implementation="eager")
    torch.testing.assert_close(ours(input_ids=ids).logits, _reference_logits(out, ids), rtol=0, atol=2e-5)
    for loader in (AutoPrunedModelForCausalLM, AutoModelForCausalLM):
        reloaded = loader.from_pretrained(out, attn_implementation="eager")
        torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)
    again = save_pruned_model(reloaded, tmp_path / "again")  # its o_proj biases are parameters now
    assert load_file(again / "model.safetensors").keys() == w.keys()
    without = _deci_model(base="qwen2")
    without.model.layers[1].mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(64))
    (tmp_path / "refused").mkdir()
    _refused(without, tmp_path / "refused", "biases other than qwen2's q/k/v ones")


def test_llama_cpp_converter_reads_the_deci_directory(tmp_path):
    """llama.cpp's own convert_hf_to_gguf.py (from the llama-cpp-python sdist, not our exporter) converts the saved
    directory; the file's per-layer shapes and every tensor are ours."""
    import gguf

    from optimum_prune.export.gguf import _tensors, gguf_layout

    tokenizer = _byte_fallback_tokenizer()
    model = _deci_model(vocab_size=len(tokenizer))
    out = save_pruned_model(model, tmp_path / "out", tokenizer)
    convert(out, tmp_path / "model.gguf")
    reader = gguf.GGUFReader(tmp_path / "model.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == "deci"
    assert fields["deci.attention.head_count"] == [4, 4, 0, 0, 4]
    assert fields["deci.attention.head_count_kv"] == [2, 2, 0, 0, 1]
    assert fields["deci.feed_forward_length"] == [768, 256, 512, 0, 512]
    assert fields["deci.attention.key_length"] == fields["deci.rope.dimension_count"] == 16
    assert fields["deci.rope.freq_base"] == 50000.0
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DECI, len(LAYERS))
    expected = {
        names.get_name(hf, try_suffixes=(".weight", ".bias")): t.float()
        for hf, t in _tensors(model, gguf_layout(model))  # our exporter's tensors, Q/K rows in llama.cpp's layout
    }
    found = {
        t.name: torch.from_numpy(t.data.copy()).reshape(tuple(reversed(t.shape.tolist()))) for t in reader.tensors
    }
    assert found.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(found[name], tensor, rtol=0, atol=0, msg=name)


def test_a_recovered_servable_model_stays_deployable(tmp_path):
    """LoRA recovery of a model in the format's per-layer shapes (no attention, no layer, one KV head for four query
    heads): merged, it saves the same `block_configs`, llama.cpp's converter reads the trained tensors, the format's
    float64 reference computes its logits and it reloads exactly."""
    import gguf

    from optimum_prune import AutoPruner, FinetuneConfig

    tokenizer = _byte_fallback_tokenizer()
    model = _deci_model(vocab_size=len(tokenizer))
    before = json.loads((save_pruned_model(model, tmp_path / "pruned", tokenizer) / "config.json").read_text())
    start = {k: v.clone() for k, v in model.state_dict().items()}
    docs = [f"Report {i}: the bank said that profits rose, and the shares fell. " * 6 for i in range(8)]
    pruner = AutoPruner(model, tokenizer, keep_teacher=False)
    config = FinetuneConfig(method="lora", token_budget=96, batch_size=2, seq_len=16, learning_rate=1e-2,
                            eval_max_tokens=32, eval_fraction=0.25)  # fmt: skip
    report = pruner.finetune(config, docs)
    assert report.merged and report.tokens_seen == 96
    trained = pruner.model
    assert trained.state_dict().keys() == start.keys()
    assert any(not torch.equal(trained.state_dict()[k], start[k]) for k in start)
    out = pruner.save_pretrained(tmp_path / "recovered")
    after = json.loads((out / "config.json").read_text())
    assert after["block_configs"] == before["block_configs"] and after["model_type"] == "nemotron-nas"
    ids = calibration_ids(2, 24, seed=7)
    with torch.no_grad():
        expected = trained.double()(input_ids=ids).logits
    trained.float()
    torch.testing.assert_close(_reference_logits(out, ids), expected, rtol=0, atol=2e-5)
    torch.testing.assert_close(logits(AutoPrunedModelForCausalLM.from_pretrained(out), ids), logits(trained, ids))
    convert(out, tmp_path / "model.gguf")
    reader = gguf.GGUFReader(tmp_path / "model.gguf")
    assert reader.fields["deci.attention.head_count_kv"].contents() == [2, 2, 0, 0, 1]
    saved = load_file(out / "model.safetensors")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DECI, len(LAYERS))
    found = {t.name: t for t in reader.tensors}
    for hf in ("model.layers.1.mlp.down_proj", "model.layers.2.mlp.up_proj", "model.layers.4.self_attn.o_proj"):
        t = found[names.get_name(f"{hf}.weight", try_suffixes=(".weight",))]
        got = torch.from_numpy(t.data.copy()).reshape(tuple(reversed(t.shape.tolist())))
        torch.testing.assert_close(got, saved[f"{hf}.weight"].float(), rtol=0, atol=0, msg=hf)  # the trained weights
        assert not torch.equal(saved[f"{hf}.weight"], start[f"{hf}.weight"])


@pytest.mark.parametrize("base", ["llama", "qwen2"])
def test_mlx_lm_runs_the_deci_directory(tmp_path, base):
    """MLX's own DeciLM model (mlx-lm's `nemotron-nas`, its CPU build) loads the directory and computes our logits
    (Qwen2's with its q/k/v biases and the zero o_proj bias)."""
    mx = pytest.importorskip("mlx.core", reason="mlx-lm has builds for Linux x86-64 and macOS only (the dev extra)")
    from mlx_lm.utils import load_model

    model = _deci_model(base=base)
    if base == "qwen2":
        with torch.no_grad():
            model.model.layers[0].self_attn.k_proj.bias.normal_(0.0, 0.5)
    out = save_pruned_model(model, tmp_path / "out")
    mlx_model, _ = load_model(out)
    ids = calibration_ids(2, 24, seed=7)
    got = torch.from_numpy(np.array(mlx_model(mx.array(ids.numpy())).astype(mx.float32)))
    torch.testing.assert_close(got, logits(model, ids), rtol=0, atol=1e-4)


def test_the_configuration_code_loads_without_optimum_prune(tmp_path):
    """What vLLM, SGLang and TensorRT-LLM do: AutoConfig with remote code, then attribute access to the blocks."""
    out = save_pruned_model(_deci_model(), tmp_path / "out")
    code = (
        "import sys; from transformers import AutoConfig; "
        f"c = AutoConfig.from_pretrained({str(out)!r}, trust_remote_code=True); "
        "assert 'optimum_prune' not in sys.modules; b = c.block_configs; "
        "print(c.model_type, b[2].attention.no_op, b[4].attention.n_heads_in_group, b[1].ffn.ffn_mult, "
        "hasattr(b[0].ffn, 'ffn_mult'), c.rope_theta, c.num_attention_heads)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["nemotron-nas", "True", "4", "6.0", "True", "50000.0", "4"]


def _refused(model, tmp_path, match):
    with pytest.raises(ValueError, match=match) as err:
        save_pruned_model(model, tmp_path / "out", format="deci")
    assert "allocation='servable'" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_shapes_the_format_cannot_hold_are_refused_before_writing(tmp_path):
    from optimum_prune import NumericalConfig, prune_

    model = tiny_model("llama")  # intermediate 96: not a multiple of 256
    prune_(model, NumericalConfig(pruning_ratio=0.3, compensation_bias=False), calibration_ids())
    _refused(model, tmp_path, "query heads")
    save_pruned_model(model, tmp_path / "auto")  # format="auto": optimum-prune's own per-layer format
    assert json.loads((tmp_path / "auto" / "config.json").read_text())["model_type"] == "optimum_pruned_llama"

    _refused(tiny_model("qwen3"), tmp_path, "q/k norms")
    model = _deci_model()
    layer = model.model.layers[1]
    layer.mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(64))
    _refused(model, tmp_path, "biases")
    model = _deci_model()
    apply_layer_plan_(
        layer_view(model.model.layers[1], 1, get_spec(model), model.config), LayerPlan(keep_channels=[0])
    )
    _refused(model, tmp_path, "multiple of 256")
    model = _deci_model()
    view = layer_view(model.model.layers[0], 0, get_spec(model), model.config)
    apply_layer_plan_(view, LayerPlan(keep_heads=[], keep_kv_heads=[]))
    _refused(model, tmp_path, "layer 0 has no attention")
    model = _deci_model()
    apply_layer_plan_(layer_view(model.model.layers[1], 1, get_spec(model), model.config), LayerPlan(keep_channels=[]))
    _refused(model, tmp_path, "keep attention but no MLP")


def test_reloading_triggers_no_deprecation_warning_of_ours(tmp_path):
    """The JSON keeps `torch_dtype` beside `dtype` for older readers; transformers reads every key of it back, and
    reading ours must not trip its "`torch_dtype` is deprecated" warning."""
    import logging

    from transformers import AutoConfig

    model = _deci_model()
    model.config.dtype = torch.float32  # as loaded with a dtype
    out = save_pruned_model(model, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    logging.Logger.warning_once.cache_clear()  # transformers warns once per process
    try:
        config = AutoConfig.from_pretrained(out)
        str(config)  # what transformers logs on load: every key of the JSON read back
        AutoPrunedModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    finally:
        logger.removeHandler(handler)
    assert config.torch_dtype == config.dtype == torch.float32
    assert not [r for r in records if "deprecated" in r], records


def test_the_command_line_reads_the_deci_directory_without_asking_for_remote_code(tmp_path):
    """`optimum-prune eval` in a fresh process (the parser loads no torch, the types register when a command loads
    transformers) reads a DeciLM directory with optimum-prune's own classes: no `trust_remote_code` prompt, which
    would wait forever on a terminal and fail without one."""
    tokenizer = _byte_fallback_tokenizer()
    out = save_pruned_model(_deci_model(vocab_size=len(tokenizer)), tmp_path / "out", tokenizer)
    (tmp_path / "text.txt").write_text("the bank said that profits rose. " * 40)
    argv = [sys.executable, "-m", "optimum_prune.cli", "eval", str(out), "--data", str(tmp_path / "text.txt")]
    result = subprocess.run([*argv, "--seq-len", "16"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0 and "custom code" not in result.stderr, result.stderr[-2000:]
    assert json.loads(result.stdout)["perplexity"] > 1


def test_merged_kv_heads_match_the_formats_float64_reference_and_llama_cpp_reads_them(tmp_path):
    """A KV-head merge (the serving search's variant: keys / values of KV heads averaged, query heads regrouped)
    written as `n_heads_in_group`: the float64 reference of the format computes what the zeroed form (every member
    holding the merged weights, the original grouping) computes, and llama.cpp's converter reads the KV-head counts."""
    from optimum_prune.functional.variants import merge_kv_weights
    from optimum_prune.modeling.architectures import weight_oi

    tokenizer = _byte_fallback_tokenizer()
    zeroed = _deci_model(vocab_size=len(tokenizer))
    spec = get_spec(zeroed)
    plans = {}
    for i in (0, 1):  # layer 1: merged in the other order, so its query heads move
        view = layer_view(get_layers(zeroed, spec)[i], i, spec, zeroed.config)
        merge = [[0, 1]] if i == 0 else [[1, 0]]
        weights = {p: merge_kv_weights(weight_oi(view.module(p)).detach(), merge, view.head_dim)
                   for p in spec.qkv_paths[1:]}  # fmt: skip
        plans[i] = LayerPlan(merge_kv=merge, weights=weights)
    removed = _deci_model(vocab_size=len(tokenizer))
    for model, mode in ((zeroed, "zero"), (removed, "remove")):
        for i, lp in plans.items():
            apply_layer_plan_(layer_view(get_layers(model, spec)[i], i, spec, model.config), lp, mode=mode)
    out = save_pruned_model(removed, tmp_path / "out", tokenizer)
    cfg = json.loads((out / "config.json").read_text())
    assert [b["attention"]["n_heads_in_group"] for b in cfg["block_configs"]][:2] == [4, 4]
    ids = calibration_ids(2, 24, seed=7)
    with torch.no_grad():
        expected = zeroed.double()(input_ids=ids).logits
    torch.testing.assert_close(_reference_logits(out, ids), expected, rtol=0, atol=2e-5)  # (float32 rotary tables)
    convert(out, tmp_path / "model.gguf")
    import gguf

    fields = {k: f.contents() for k, f in gguf.GGUFReader(tmp_path / "model.gguf").fields.items()}
    assert fields["deci.attention.head_count_kv"] == [1, 1, 0, 0, 1]
