"""Resumable runs (`checkpoint_dir`) and faults: crashes, kills, damaged directories, failed saves."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from scale_utils import assert_same_state, prune_and_save, saved_state, write_checkpoint
from testing_utils import calibration_ids

from optimum_prune import (
    AMPConfig,
    AutoPruner,
    FISTAConfig,
    FLAPConfig,
    NumericalConfig,
    SparseGPTConfig,
    WandaConfig,
)
from optimum_prune.methods.amp.pruner import AMPPruner
from optimum_prune.methods.fista.pruner import FISTAPruner
from optimum_prune.methods.flap.pruner import FLAPPruner
from optimum_prune.methods.numerical.pruner import NumericalPruner
from optimum_prune.methods.sparsegpt.pruner import SparseGPTPruner
from optimum_prune.methods.unstructured import SequentialPruner

NP = {"pruning_ratio": 0.3, "round_to": 1}
IDS = calibration_ids(8, 16)
FAIL_AT = 3  # the injected failure hits block 3 of 5


class Crash(Exception):
    pass


def _index(args) -> int | None:
    views = [a for a in args if isinstance(getattr(a, "index", None), int)]
    return views[0].index if views else None


def _instrument(monkeypatch, cls, name, fail_at=None):
    """Count the blocks `cls.name` is called for, and raise `Crash` at block `fail_at`."""
    seen = []
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        i = _index(args)
        seen.append(i)
        if i == fail_at:
            raise Crash(f"{name} at block {i}")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, wrapper)
    return seen


# (config, where the failure is injected, low_memory): every kind of pass that finishes blocks, both modes
CASES = [
    (SparseGPTConfig(sparsity=0.5), SequentialPruner, "prune_layer", True),
    (SparseGPTConfig(sparsity=0.5), SequentialPruner, "prune_layer", False),
    (FISTAConfig(sparsity=0.5, K=3, max_outer=2), FISTAPruner, "prune_layer", False),  # dense inputs between blocks
    (NumericalConfig(**NP), NumericalPruner, "score_layer", True),  # first (ranking) pass
    (NumericalConfig(**NP), NumericalPruner, "finalize_layer", False),  # second (compensation) pass
    (NumericalConfig(**NP), NumericalPruner, "finalize_layer", True),
    (FLAPConfig(**NP), FLAPPruner, "finalize_layer", True),
    (NumericalConfig(**NP, compensation_inputs="sequential"), NumericalPruner, "refit_projection", True),
    # the dense model's hidden states carried alongside: a resumed run carries them through the finished blocks
    (AMPConfig(cg_steps=2, refit_steps=3, refit_target="model"), AMPPruner, "prune_layer", False),
    (AMPConfig(cg_steps=2, refit_steps=3, refit_target="model"), AMPPruner, "prune_layer", True),
    (
        [NumericalConfig(pruning_ratio=0.2, round_to=1), WandaConfig(sparsity=0.5)],
        SequentialPruner,
        "prune_layer",
        False,
    ),  # fmt: skip
]


@pytest.mark.parametrize(
    ("config", "cls", "name", "low_memory"), CASES, ids=[f"{c[1].__name__}.{c[2]}-low_memory={c[3]}" for c in CASES]
)
def test_rerun_after_a_crash_continues_and_gives_the_same_model(config, cls, name, low_memory, tmp_path, monkeypatch):
    src = write_checkpoint(tmp_path / "src", num_hidden_layers=5)
    ref = tmp_path / "ref"
    prune_and_save(src, config, ref, low_memory=low_memory, calibration=IDS, batch_size=3)
    ckpt = tmp_path / "run"
    with monkeypatch.context() as m:
        _instrument(m, cls, name, fail_at=FAIL_AT)
        pruner = AutoPruner.from_pretrained(src, low_memory=low_memory)
        with pytest.raises(Crash):
            pruner.prune(config, calibration=IDS, batch_size=3, checkpoint_dir=ckpt)
    with monkeypatch.context() as m:
        seen = _instrument(m, cls, name)
        prune_and_save(src, config, tmp_path / "resumed", low_memory, calibration=IDS, batch_size=3,
                       checkpoint_dir=ckpt)  # fmt: skip
    assert seen and min(seen) == FAIL_AT, seen  # the finished blocks were not redone
    # The sequential refit of the blocks after the crash reads the finished blocks as saved (heads and KV groups
    # removed), where the uninterrupted run computed them with those units zeroed: the same function, other float
    # rounding (matmuls of other shapes). Everything else resumes bit for bit.
    atol = 1e-5 if name == "refit_projection" else 0.0
    assert_same_state(saved_state(ref), saved_state(tmp_path / "resumed"), atol=atol)
    with monkeypatch.context() as m:  # a finished run: everything comes from the checkpoint
        seen = _instrument(m, cls, name)
        prune_and_save(src, config, tmp_path / "again", low_memory, calibration=IDS, batch_size=3,
                       checkpoint_dir=ckpt)  # fmt: skip
    assert not seen
    assert_same_state(saved_state(tmp_path / "resumed"), saved_state(tmp_path / "again"))


KILLED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from testing_utils import calibration_ids
from optimum_prune import AutoPruner, SparseGPTConfig
from optimum_prune.methods.sparsegpt.pruner import SparseGPTPruner
from optimum_prune.pipeline.session import PruneSession

finish = PruneSession.finish
def killing_finish(self, i, *a, **k):
    finish(self, i, *a, **k)
    if i == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # no exception handler, no cleanup: a real crash
PruneSession.finish = killing_finish
pruner = AutoPruner.from_pretrained({src!r}, low_memory=True)
pruner.prune(SparseGPTConfig(sparsity=0.5), calibration=calibration_ids(8, 16), batch_size=3, checkpoint_dir={ckpt!r})
"""


def test_a_killed_run_resumes_at_the_first_unfinished_block(tmp_path, monkeypatch):
    src = write_checkpoint(tmp_path / "src", num_hidden_layers=5)
    cfg = SparseGPTConfig(sparsity=0.5)
    prune_and_save(src, cfg, tmp_path / "ref", calibration=IDS, batch_size=3)
    ckpt = tmp_path / "run"
    code = KILLED.format(tests=str(Path(__file__).parent), src=str(src), ckpt=str(ckpt))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),  # bit-exact comparisons: the parent's thread count
    }
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert sorted(p.name for p in (ckpt / "stage0").glob("block*.json")) == [f"block0000{i}.json" for i in range(3)]
    seen = _instrument(monkeypatch, SparseGPTPruner, "prune_layer")
    prune_and_save(src, cfg, tmp_path / "resumed", low_memory=True, calibration=IDS, batch_size=3, checkpoint_dir=ckpt)
    assert seen == [3, 4]
    assert_same_state(saved_state(tmp_path / "ref"), saved_state(tmp_path / "resumed"))


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    src = write_checkpoint(tmp_path / "src")
    ckpt = tmp_path / "run"
    AutoPruner.from_pretrained(src).prune(WandaConfig(sparsity=0.5), calibration=IDS, checkpoint_dir=ckpt)
    with pytest.raises(ValueError, match=r"different configuration or calibration data .* delete"):
        AutoPruner.from_pretrained(src).prune(WandaConfig(sparsity=0.6), calibration=IDS, checkpoint_dir=ckpt)
    with pytest.raises(ValueError, match="different configuration or calibration data"):
        AutoPruner.from_pretrained(src).prune(WandaConfig(sparsity=0.5), calibration=IDS[:4], checkpoint_dir=ckpt)
    other = write_checkpoint(tmp_path / "other", arch="llama")
    with pytest.raises(ValueError, match=r"different model .* new checkpoint directory"):
        AutoPruner.from_pretrained(other).prune(WandaConfig(sparsity=0.5), calibration=IDS, checkpoint_dir=ckpt)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds no optimum_prune run"):
        AutoPruner.from_pretrained(src).prune(
            WandaConfig(sparsity=0.5), calibration=IDS, checkpoint_dir=tmp_path / "foreign"
        )
    (ckpt / "run.json").write_text("{truncated")
    with pytest.raises(ValueError, match="damaged .* Delete"):
        AutoPruner.from_pretrained(src).prune(WandaConfig(sparsity=0.5), calibration=IDS, checkpoint_dir=ckpt)


def test_a_damaged_block_record_is_redone_from_there(tmp_path, monkeypatch, caplog):
    src = write_checkpoint(tmp_path / "src", num_hidden_layers=5)
    cfg = SparseGPTConfig(sparsity=0.5)
    ckpt = tmp_path / "run"
    prune_and_save(src, cfg, tmp_path / "ref", calibration=IDS, checkpoint_dir=ckpt)
    block = ckpt / "stage0" / "block00002.safetensors"
    block.write_bytes(block.read_bytes()[:100])  # e.g. a disk that filled up behind our back
    seen = _instrument(monkeypatch, SparseGPTPruner, "prune_layer")
    prune_and_save(src, cfg, tmp_path / "redone", calibration=IDS, checkpoint_dir=ckpt)
    assert seen == [2, 3, 4]
    assert "damaged" in caplog.text
    assert_same_state(saved_state(tmp_path / "ref"), saved_state(tmp_path / "redone"))


@pytest.mark.parametrize("low_memory", [False, True], ids=["in_memory", "low_memory"])
def test_a_save_that_fails_midway_leaves_nothing_where_the_model_is_expected(tmp_path, monkeypatch, low_memory):
    src = write_checkpoint(tmp_path / "src")
    pruner = AutoPruner.from_pretrained(src, low_memory=low_memory)
    pruner.prune(NumericalConfig(**NP), calibration=IDS)
    import safetensors.torch

    from optimum_prune.storage import tensorfile

    calls = []

    def full(write, path):
        def fake(*args, **kwargs):
            calls.append(path(args))
            if len(calls) == 1:  # the temporary directory already holds the config / the first shard
                raise OSError(errno.ENOSPC, "No space left on device")
            return write(*args, **kwargs)

        return fake

    # transformers' save (in memory) and ours (low-memory: `write_tensors(path, tensors, ...)`)
    monkeypatch.setattr(
        "transformers.modeling_utils.safe_save_file", full(safetensors.torch.save_file, lambda a: a[1])
    )
    monkeypatch.setattr(
        "optimum_prune.storage.streaming.write_tensors", full(tensorfile.write_tensors, lambda a: a[0])
    )
    with pytest.raises(OSError, match="No space left"):
        pruner.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind
    monkeypatch.undo()
    pruner.save_pretrained(tmp_path / "out")  # the model is intact: saving again works
    assert (tmp_path / "out" / "config.json").is_file()


def test_low_memory_save_checks_the_free_space_first(tmp_path, monkeypatch):
    src = write_checkpoint(tmp_path / "src")
    pruner = AutoPruner.from_pretrained(src, low_memory=True)
    pruner.prune(WandaConfig(sparsity=0.5), calibration=IDS)
    usage = shutil._ntuple_diskusage(total=10**9, used=10**9 - 1000, free=1000)
    monkeypatch.setattr("optimum_prune.storage.sharded.shutil.disk_usage", lambda p: usage)
    with pytest.raises(OSError, match=r"Not enough disk space .* needs"):
        pruner.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_truncated_source_shard_is_a_clear_error(tmp_path):
    src = write_checkpoint(tmp_path / "src")
    shard = src / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(OSError, match="damaged or incomplete"):
        AutoPruner.from_pretrained(src, low_memory=True).prune(WandaConfig(sparsity=0.5), calibration=IDS)


KILLED_SAVE = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from testing_utils import calibration_ids
import optimum_prune.storage.sharded as sharded
from optimum_prune import AutoPruner, WandaConfig

pruner = AutoPruner.from_pretrained({src!r}, low_memory=True, offload_dir={scratch!r})
pruner.prune(WandaConfig(sparsity=0.5), calibration=calibration_ids(8, 16), activation_memory=1)  # spills
link = sharded._link_or_copy
def killing_link(*a):
    link(*a)
    os.kill(os.getpid(), signal.SIGKILL)  # mid-save: one shard in the temporary directory
sharded._link_or_copy = killing_link
pruner.save_pretrained({out!r})
"""


def test_a_save_killed_midway_leaves_no_model_and_its_remains_are_removed_by_the_next_run(tmp_path, caplog):
    src, scratch, out = write_checkpoint(tmp_path / "src"), tmp_path / "scratch", tmp_path / "out"
    code = KILLED_SAVE.format(tests=str(Path(__file__).parent), src=str(src), scratch=str(scratch), out=str(out))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),  # bit-exact comparisons: the parent's thread count
    }
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not out.exists()
    killed = [*tmp_path.glob(".out.*.tmp"), *scratch.iterdir()]
    left = sorted(p.name.lstrip(".").split(".")[0] for p in killed)
    assert left == ["optimum_prune_blocks", "out"], left  # a kill cannot clean up (the spilled activations were)
    caplog.set_level(logging.WARNING, logger="optimum_prune.utils.scratch")
    prune_and_save(src, WandaConfig(sparsity=0.5), tmp_path / "ref", calibration=calibration_ids(8, 16))
    pruner = AutoPruner.from_pretrained(src, low_memory=True, offload_dir=scratch)
    pruner.prune(WandaConfig(sparsity=0.5), calibration=calibration_ids(8, 16), activation_memory=1)
    pruner.save_pretrained(out, model_card=False)
    assert_same_state(saved_state(tmp_path / "ref"), saved_state(out))
    assert not [p for p in killed if p.exists()]
    assert caplog.text.count("left by an interrupted run") == 2, caplog.text


def test_scratch_directories_of_live_processes_are_kept(tmp_path):
    from optimum_prune.utils.scratch import make_scratch_dir

    mine = make_scratch_dir(tmp_path, "optimum_prune_blocks")
    live = tmp_path / mine.name.replace(f"-{os.getpid()}.", "-1.")  # process 1 (init) is alive
    live.mkdir()
    other_host = tmp_path / "optimum_prune_blocks.elsewhere-999999999.abcdefgh"  # cannot be checked from here
    other_host.mkdir()
    second = make_scratch_dir(tmp_path, "optimum_prune_blocks")
    assert mine.is_dir() and live.is_dir() and other_host.is_dir() and second != mine
