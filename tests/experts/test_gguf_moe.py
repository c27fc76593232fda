"""GGUF export of pruned MoE models to llama.cpp's own MoE architectures (qwen3moe, olmoe, llama with experts): the
file's keys and expert tensors, transformers' GGUF reader (qwen3moe), llama.cpp itself where llama-cpp-python is
installed, and the refusals."""

import gguf
import numpy as np
import pytest
import torch
from test_gguf_export import _fields, small_tokenizer  # noqa: F401  (the module-scoped tokenizer fixture)
from transformers import AutoModelForCausalLM

from experts.tiny import moe_ids, tiny_moe
from optimum_prune import ExpertConfig, export_gguf, prune_
from optimum_prune.export import GGUFExportError

CASES = [("qwen3_moe", "qwen3moe"), ("olmoe", "olmoe"), ("mixtral", "llama")]


def _pruned(model_type: str, tokenizer, **config):
    mha = {"num_key_value_heads": 4} if model_type == "olmoe" else {}  # llama.cpp's olmoe: one key head per head
    model = tiny_moe(model_type, dtype=torch.float32, vocab_size=len(tokenizer), **mha)
    prune_(model, ExpertConfig(expert_ratio=0.34, channel_ratio=0.25, round_to=8, **config), moe_ids(8, 16))
    return model


@torch.no_grad()
def _logits(model, ids):
    return model(input_ids=ids, use_cache=False).logits.float()


@pytest.mark.parametrize(("model_type", "arch"), CASES)
def test_expert_keys_and_tensors(model_type, arch, small_tokenizer, tmp_path):  # noqa: F811
    model = _pruned(model_type, small_tokenizer)
    export_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=small_tokenizer)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    fields = _fields(reader)
    assert fields["general.architecture"] == arch
    assert fields[f"{arch}.expert_count"] == 4 and fields[f"{arch}.expert_used_count"] == 2
    assert fields[f"{arch}.feed_forward_length"] == 16
    shapes = {t.name: [int(x) for x in t.shape] for t in reader.tensors}  # ggml order: innermost first
    assert shapes["blk.1.ffn_gate_inp.weight"] == [32, 4]
    assert shapes["blk.1.ffn_gate_exps.weight"] == shapes["blk.1.ffn_up_exps.weight"] == [32, 16, 4]
    assert shapes["blk.1.ffn_down_exps.weight"] == [16, 32, 4]
    gate = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_exps.weight")
    expected = model.model.layers[0].mlp.experts.gate_up_proj.detach()[:, :16]  # (E, I, H): each expert's gate rows
    np.testing.assert_array_equal(np.asarray(gate.data).reshape(4, 16, 32), expected.numpy())


def test_qwen3moe_reads_back_with_transformers(small_tokenizer, tmp_path):  # noqa: F811
    model = _pruned("qwen3_moe", small_tokenizer)
    ids = moe_ids(2, 12, seed=3)
    export_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=small_tokenizer)
    # transformers' GGUF reader does not map qwen3moe's expert_feed_forward_length (it keeps the config default)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", moe_intermediate_size=16).eval()
    assert loaded.config.num_experts == 4 and loaded.config.moe_intermediate_size == 16
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("model_type", "arch"), CASES)
def test_llama_cpp_gives_the_transformers_logits(model_type, arch, small_tokenizer, tmp_path):  # noqa: F811
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp checks need llama-cpp-python (the llamacpp extra)")
    model = _pruned(model_type, small_tokenizer)
    ids = moe_ids(1, 24, seed=4)
    export_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=small_tokenizer)
    llm = llama_cpp.Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=32, n_batch=32, n_ubatch=32, logits_all=True,
                          n_threads=1, verbose=False)  # fmt: skip
    llm.eval(ids[0].tolist())
    ours = torch.tensor(np.asarray(llm.scores[: ids.shape[1]]), dtype=torch.float32)
    torch.testing.assert_close(ours, _logits(model, ids)[0], rtol=1e-3, atol=1e-3)


def test_what_llama_cpp_cannot_run_is_refused_before_writing(small_tokenizer, tmp_path):  # noqa: F811
    per_layer = _pruned("mixtral", small_tokenizer, allocation="global")
    with pytest.raises(GGUFExportError, match="one expert count"):
        export_gguf(per_layer, tmp_path / "a.gguf", tokenizer=small_tokenizer)
    unnormalised = tiny_moe("qwen3_moe", dtype=torch.float32, vocab_size=len(small_tokenizer), norm_topk_prob=False)
    with pytest.raises(GGUFExportError, match="renormalises"):
        export_gguf(unnormalised, tmp_path / "b.gguf", tokenizer=small_tokenizer)
    with pytest.raises(GGUFExportError, match="one key head per query head"):
        export_gguf(tiny_moe("olmoe", dtype=torch.float32, vocab_size=len(small_tokenizer)), tmp_path / "d.gguf",
                    tokenizer=small_tokenizer)  # fmt: skip
    with pytest.raises(GGUFExportError, match="gpt_oss"):
        export_gguf(tiny_moe("gpt_oss", dtype=torch.float32), tmp_path / "c.gguf", tokenizer=small_tokenizer)
    assert not list(tmp_path.iterdir())
