"""Bad input gets a clear error before any weight is touched; the model and existing files stay intact."""

import os
import stat
from pathlib import Path

import pytest
import torch
from testing_utils import calibration_ids, logits, tiny_model

from optimum_prune import (
    AutoPrunedModelForCausalLM,
    CalibrationConfig,
    FLAPConfig,
    NumericalConfig,
    UnsupportedArchitectureError,
    prune_,
    save_pruned_model,
)


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_untouched(model, snap):
    state = model.state_dict()
    assert state.keys() == snap.keys()
    for k, v in snap.items():
        assert torch.equal(state[k], v), k


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, float("nan"), "0.2"])
def test_ratio_outside_unit_interval(ratio):
    with pytest.raises(ValueError, match=r"pruning_ratio"):
        NumericalConfig(pruning_ratio=ratio)


def test_bad_option_values():
    with pytest.raises(ValueError, match="allocation"):
        NumericalConfig(allocation="random")
    with pytest.raises(ValueError, match="lambda_"):
        NumericalConfig(solver="newton")
    with pytest.raises(ValueError, match="min_heads_per_layer"):
        FLAPConfig(min_heads_per_layer=0)


def test_unsupported_architecture_lists_supported_types():
    from transformers import BertConfig, BertForMaskedLM

    model = BertForMaskedLM(
        BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37)
    )
    snap = _snapshot(model)
    with pytest.raises(UnsupportedArchitectureError, match=r"llama.*Nothing was changed|Supported model types"):
        prune_(model, NumericalConfig(), calibration_ids())
    _assert_untouched(model, snap)


def test_uniform_ratio_removing_every_head_fails_before_touching_weights():
    model = tiny_model("llama_gqa")  # 2 KV groups per layer
    snap = _snapshot(model)
    with pytest.raises(ValueError, match="every head"):
        prune_(model, NumericalConfig(pruning_ratio=0.9, allocation="uniform"), calibration_ids())
    _assert_untouched(model, snap)


def test_unreachable_global_ratio_fails_before_touching_weights():
    model = tiny_model("llama")
    snap = _snapshot(model)
    with pytest.raises(ValueError, match="cannot be reached"):
        prune_(model, NumericalConfig(pruning_ratio=0.95, min_mlp_channels_per_layer=64), calibration_ids())
    _assert_untouched(model, snap)


def test_gqa_group_mode_on_a_single_kv_head_model():
    model = tiny_model("gemma3")
    snap = _snapshot(model)
    with pytest.raises(ValueError, match="single KV head.*gqa_mode='query'"):
        prune_(model, NumericalConfig(gqa_mode="group"), calibration_ids())
    _assert_untouched(model, snap)


def test_nan_weights():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    snap = _snapshot(model)
    with pytest.raises(ValueError, match="NaN/Inf"):
        prune_(model, NumericalConfig(), calibration_ids())
    for k, v in snap.items():
        assert (
            torch.equal(
                model.state_dict()[k],
                v,
            )
            or torch.isnan(v).any()
        )


def test_missing_or_empty_or_short_calibration(smollm2_tokenizer, tmp_path):
    model = tiny_model("llama")
    snap = _snapshot(model)
    with pytest.raises(ValueError, match="needs calibration"):
        prune_(model, NumericalConfig())
    with pytest.raises(ValueError, match="tokenizer"):
        prune_(model, NumericalConfig(), CalibrationConfig(dataset=["some text"]))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("   \n")
    with pytest.raises(ValueError):
        prune_(model, NumericalConfig(), CalibrationConfig(dataset=str(empty)), smollm2_tokenizer)
    with pytest.raises(ValueError, match="tokens"):
        prune_(model, NumericalConfig(), CalibrationConfig(dataset=["too short"], seq_len=512), smollm2_tokenizer)
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    with pytest.raises(ValueError, match=r"no \*\.txt files \(it is empty\): put one document per \.txt file"):
        prune_(model, NumericalConfig(), CalibrationConfig(dataset=str(nothing)), smollm2_tokenizer)
    (nothing / "a.pdf").write_bytes(b"%PDF")
    with pytest.raises(ValueError, match=r"\(only \.pdf files\).*'bbc'"):
        prune_(model, NumericalConfig(), CalibrationConfig(dataset=str(nothing)), smollm2_tokenizer)
    _assert_untouched(model, snap)


def test_output_directory_exists_or_is_not_writable(tmp_path):
    model = tiny_model("llama")
    prune_(model, NumericalConfig(pruning_ratio=0.2), calibration_ids())
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match=r"not empty \(1 entry in the way: keep.txt\).*overwrite=True"):
        save_pruned_model(model, existing)
    assert os.listdir(existing) == ["keep.txt"]
    if os.geteuid() != 0:  # root ignores permission bits
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        with pytest.raises(PermissionError, match="writable"):
            save_pruned_model(model, locked / "out")
    with pytest.raises(PermissionError):
        save_pruned_model(model, "/proc/optimum_prune_test/out")


def test_failed_save_leaves_nothing_behind_and_overwrite_is_atomic(tmp_path):
    model = tiny_model("llama")
    prune_(model, NumericalConfig(pruning_ratio=0.2), calibration_ids())

    class BrokenTokenizer:
        def save_pretrained(self, path):
            raise OSError("disk full")

    target = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        save_pruned_model(model, target, BrokenTokenizer())
    assert os.listdir(tmp_path) == []  # no target, no temp dir
    save_pruned_model(model, target)
    before = sorted(os.listdir(target))
    with pytest.raises(OSError, match="disk full"):
        save_pruned_model(model, target, BrokenTokenizer(), overwrite=True)
    assert sorted(os.listdir(target)) == before and sorted(os.listdir(tmp_path)) == ["out"]
    save_pruned_model(model, target, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_save_into_an_existing_empty_directory(tmp_path):
    """`mkdir -p out` / `tempfile.TemporaryDirectory()` / a scheduler's scratch dir: written in place, atomically."""
    model = tiny_model("llama")
    prune_(model, NumericalConfig(pruning_ratio=0.2), calibration_ids())

    class BrokenTokenizer:
        def save_pretrained(self, path):
            raise OSError("disk full")

    target = tmp_path / "made_by_the_user"
    target.mkdir()
    inode = target.stat().st_ino
    with pytest.raises(OSError, match="disk full"):
        save_pruned_model(model, target, BrokenTokenizer())
    assert os.listdir(target) == [] and os.listdir(tmp_path) == ["made_by_the_user"]  # still empty, no temp dir
    assert save_pruned_model(model, target) == target
    assert target.stat().st_ino == inode  # the same directory, not a replacement
    assert sorted(os.listdir(tmp_path)) == ["made_by_the_user"]  # nothing left beside it
    assert {"config.json", "model.safetensors", "pruning_config.json"} <= set(os.listdir(target))
    assert not [name for name in os.listdir(target) if name.startswith(".")]  # no temp dir left inside
    reloaded = AutoPrunedModelForCausalLM.from_pretrained(target, attn_implementation="eager")
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)
    # now it is not empty: refused without overwrite, naming what is in the way (the first few, then a count)
    for i in range(6):
        (target / f"extra{i}.txt").write_text("x")
    n = len(os.listdir(target))
    with pytest.raises(
        FileExistsError,
        match=rf"not empty \({n} entries in the way: README.md, config.json, extra0.txt.* and {n - 5} more",
    ):
        save_pruned_model(model, target)
    save_pruned_model(model, target, overwrite=True)
    assert not [name for name in os.listdir(target) if name.startswith("extra")]
    with pytest.raises(NotADirectoryError, match="not a directory"):
        save_pruned_model(model, target / "config.json")


def test_save_into_an_empty_directory_of_a_read_only_parent(tmp_path, monkeypatch):
    """A scheduler's scratch directory whose parent the user cannot write: only the directory itself is used."""
    import optimum_prune.serialization as serialization

    model = tiny_model("llama")
    scheduler = tmp_path / "scheduler"
    scratch = scheduler / "job42"
    scratch.mkdir(parents=True)
    real_access = os.access
    monkeypatch.setattr(serialization.os, "access", lambda p, mode: Path(p) != scheduler and real_access(p, mode))
    with pytest.raises(PermissionError, match="scheduler is not writable"):
        save_pruned_model(model, scheduler / "job43")  # a new directory would need the parent
    save_pruned_model(model, scratch)
    assert "model.safetensors" in os.listdir(scratch) and os.listdir(scheduler) == ["job42"]
