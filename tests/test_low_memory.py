"""Low-memory mode (decoder blocks streamed from disk, one at a time) gives exactly the in-memory result."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from scale_utils import assert_same_state, prune_and_save, saved_state, write_checkpoint
from testing_utils import calibration_ids, logits, tiny_model
from transformers import AutoModelForCausalLM

from optimum_prune import (
    AMPConfig,
    AutoPrunedModelForCausalLM,
    AutoPruner,
    FISTAConfig,
    FLAPConfig,
    MagnitudeConfig,
    NumericalConfig,
    RIAConfig,
    SparseGPTConfig,
    SPPConfig,
    WandaConfig,
)
from optimum_prune.storage.memory import InsufficientMemoryError
from optimum_prune.storage.streaming import LayerStore, get_store

NP = {"pruning_ratio": 0.3, "round_to": 1}
CASES = [
    ("llama_gqa", WandaConfig(sparsity=0.5, pattern="2:4")),
    ("llama_gqa", SparseGPTConfig(sparsity=0.5)),
    ("llama_gqa", RIAConfig(sparsity=0.5, reconstruction=True)),
    ("llama_gqa", FISTAConfig(sparsity=0.5, K=3, max_outer=2)),
    ("llama_gqa", AMPConfig(sparsity=0.5, steps=2)),
    ("llama_gqa", MagnitudeConfig(pattern="unstructured", sparsity=0.5)),
    ("llama_gqa", NumericalConfig(**NP)),  # global ranking; Grams recomputed in a second streamed pass
    ("llama_gqa", NumericalConfig(**NP, compensation_inputs="sequential", compensation_bias=True)),
    ("llama_gqa", FLAPConfig(**NP)),
    ("llama_gqa", MagnitudeConfig(**NP)),
    ("llama_gqa", [AMPConfig(sparsity=0.5, steps=2), WandaConfig(sparsity=0.5, targets=["v_proj", "o_proj", "mlp"])]),
    ("llama_gqa", [NumericalConfig(pruning_ratio=0.2, round_to=1), SparseGPTConfig(sparsity=0.5)]),
    ("opt", NumericalConfig(**NP)),
    ("gpt2", FLAPConfig(**NP)),
    ("gemma3", WandaConfig(sparsity=0.5)),
]


def _name(case) -> str:
    arch, cfg = case
    return f"{arch}-" + ("+".join(c.method for c in cfg) if isinstance(cfg, list) else cfg.method)


@pytest.fixture
def one_block_at_a_time(monkeypatch):
    """Fails the test if a second block is loaded while another is resident; records the loads."""
    loads = []
    original = LayerStore.load

    def load(self, i, stage=None):
        others = set(self.loaded) - {i}
        assert not others, f"block {i} loaded while {others} are resident"
        loads.append(i)
        return original(self, i, stage)

    monkeypatch.setattr(LayerStore, "load", load)
    return loads


@pytest.mark.parametrize("case", CASES, ids=[_name(c) for c in CASES])
def test_low_memory_equals_in_memory(case, tmp_path_factory, tmp_path, one_block_at_a_time):
    arch, config = case
    src = write_checkpoint(tmp_path_factory.getbasetemp() / f"src-{arch}", arch)
    ids = calibration_ids(8, 16)
    prune_and_save(src, config, tmp_path / "mem", calibration=ids, batch_size=3)
    assert not one_block_at_a_time
    report = prune_and_save(src, config, tmp_path / "low", low_memory=True, calibration=ids, batch_size=3)
    assert one_block_at_a_time, "the low-memory run loaded no block"
    assert report.info["low_memory"] is True
    assert_same_state(saved_state(tmp_path / "mem"), saved_state(tmp_path / "low"))
    index = json.loads((tmp_path / "low" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 1 + len(report.layers)  # one shard per block + the rest


def test_low_memory_checkpoint_loads_like_any_other(tmp_path):
    """bf16 on disk stays bf16; the sharded output reloads (stock or ours) like the in-memory result."""
    src = write_checkpoint(tmp_path / "src", "llama_gqa", torch.bfloat16)
    ids = calibration_ids(8, 16)
    for name, cfg, loader in (
        ("flat", SparseGPTConfig(sparsity=0.5), AutoModelForCausalLM),
        ("shapes", NumericalConfig(**NP), AutoPrunedModelForCausalLM),
    ):
        prune_and_save(src, cfg, tmp_path / name, low_memory=True, calibration=ids, batch_size=4)
        prune_and_save(src, cfg, tmp_path / f"{name}-mem", calibration=ids, batch_size=4)
        reloaded = loader.from_pretrained(tmp_path / name, attn_implementation="eager")
        reference = loader.from_pretrained(tmp_path / f"{name}-mem", attn_implementation="eager")
        assert reloaded.dtype == torch.bfloat16
        torch.testing.assert_close(logits(reloaded), logits(reference), rtol=0, atol=0)
        assert (tmp_path / name / "pruning_config.json").is_file()


def test_activations_spill_to_disk_beyond_the_budget(tmp_path, caplog):
    src = write_checkpoint(tmp_path / "src")
    ids = calibration_ids(8, 16)
    cfg = SparseGPTConfig(sparsity=0.5)
    prune_and_save(src, cfg, tmp_path / "ref", calibration=ids, batch_size=2)
    with caplog.at_level(logging.WARNING, logger="optimum_prune"):
        report = prune_and_save(
            src, cfg, tmp_path / "low", low_memory=True, calibration=ids, batch_size=2, activation_memory="5KB"
        )
    spilled = report.info["activations"]
    assert spilled["spilled_chunks"] > 0 and spilled["spilled_bytes"] > 0
    assert "written to disk" in caplog.text and "exceed the in-memory budget" in caplog.text
    assert_same_state(saved_state(tmp_path / "ref"), saved_state(tmp_path / "low"))


def test_gguf_and_bin_sources_are_refused_with_what_to_do(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="Convert it once to safetensors"):
        AutoPruner.from_pretrained(tmp_path, gguf_file="model.gguf", low_memory=True)
    (tmp_path / "model.gguf").unlink()
    (tmp_path / "bin").mkdir()
    tiny_model("llama").config.save_pretrained(tmp_path / "bin")
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(FileNotFoundError, match=r"\.bin checkpoint cannot be memory-mapped"):
        AutoPruner.from_pretrained(tmp_path / "bin", low_memory=True)


def test_a_model_too_large_even_for_low_memory_fails_before_any_work(tmp_path, monkeypatch):
    src = write_checkpoint(tmp_path / "src")
    pruner = AutoPruner.from_pretrained(src, low_memory=True)
    monkeypatch.setattr("optimum_prune.storage.memory.available_memory", lambda: 1000)
    with pytest.raises(InsufficientMemoryError, match=r"needs at least .* GB .* would fit"):
        pruner.prune(SparseGPTConfig(), calibration=calibration_ids(4, 8))
    with pytest.raises(RuntimeError, match="low_memory=True"):  # and it says why it cannot run a forward
        pruner.model(input_ids=calibration_ids(1, 4))


def test_two_prune_calls_on_one_low_memory_model(tmp_path):
    """The second call starts from the blocks the first one wrote, as it would in memory."""
    src = write_checkpoint(tmp_path / "src")
    ids = calibration_ids(8, 16)
    states = []
    for low in (False, True):
        pruner = AutoPruner.from_pretrained(src, low_memory=low)
        pruner.prune(FLAPConfig(**NP), calibration=ids)
        pruner.prune(WandaConfig(sparsity=0.5), calibration=ids)
        pruner.save_pretrained(tmp_path / str(low), model_card=False)
        states.append(saved_state(tmp_path / str(low)))
    assert_same_state(*states)


def test_cli_low_memory_on_a_gguf_file_says_how_to_convert(tmp_path, capsys):
    from optimum_prune.cli import main

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    argv = ["prune", str(tmp_path / "m.gguf"), "--method", "magnitude", "--ratio", "0.2", "--low-memory", "-o"]
    assert main([*argv, str(tmp_path / "out")]) == 2
    assert "Convert it once to safetensors" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_spp_is_refused_in_low_memory_mode_before_any_work(tmp_path):
    src = write_checkpoint(tmp_path / "src")
    pruner = AutoPruner.from_pretrained(src, low_memory=True)
    with pytest.raises(ValueError, match=r"SPP reads every block's weights at once.*Load the model in memory"):
        pruner.prune(SPPConfig(pruning_ratio=0.2), calibration=calibration_ids(8, 16))
    assert not list(get_store(pruner.model).versions[0].keys())[1:]  # no block was written


def test_image_models_are_refused_in_low_memory_mode(tmp_path):
    src = write_checkpoint(tmp_path / "vit", arch="vit")
    with pytest.raises(ValueError, match=r"image model \(vit\).* load it without low_memory"):
        AutoPruner.from_pretrained(src, low_memory=True)


@pytest.mark.parametrize("low_memory", [False, True], ids=["in_memory", "low_memory"])
def test_a_device_this_machine_lacks_is_refused_before_any_work(tmp_path, low_memory, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (this machine has no GPU; so would CI)
    src = write_checkpoint(tmp_path / "src")
    pruner = AutoPruner.from_pretrained(src, low_memory=low_memory)
    ckpt = tmp_path / "run"
    with pytest.raises(ValueError, match=r"device='cuda', but this process sees no cuda device .* Nothing was"):
        pruner.prune(WandaConfig(sparsity=0.5), calibration=calibration_ids(4, 8), device="cuda", checkpoint_dir=ckpt)
    with pytest.raises(ValueError, match="is not a torch device"):
        pruner.prune(WandaConfig(sparsity=0.5), calibration=calibration_ids(4, 8), device="gpu0")
    assert not ckpt.exists()
    pruner.save_pretrained(tmp_path / "out", model_card=False)  # untouched: it saves the source's weights
    assert_same_state(saved_state(src), saved_state(tmp_path / "out"))
