"""Helpers of the large-model tests (low-memory mode, resume, data parallelism): tiny checkpoints on disk."""

from __future__ import annotations

import glob
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from testing_utils import tiny_model

from optimum_prune import AutoPruner, save_pruned_model


def write_checkpoint(path: Path, arch: str = "llama_gqa", dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A tiny random model saved as a stock safetensors checkpoint (what low-memory mode reads)."""
    if not (path / "config.json").is_file():
        save_pruned_model(tiny_model(arch, **overrides).to(dtype), path, model_card=False)
    return path


def saved_state(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved checkpoint, whatever its sharding."""
    out: dict[str, torch.Tensor] = {}
    for f in glob.glob(str(directory / "*.safetensors")):
        out.update(load_file(f))
    return out


def prune_and_save(src: Path, config, out: Path, low_memory: bool = False, **prune_kwargs):
    """Load `src` (in memory or low-memory), prune, save to `out`; returns the report."""
    shutil.rmtree(out, ignore_errors=True)
    pruner = AutoPruner.from_pretrained(src, low_memory=low_memory)
    report = pruner.prune(config, **prune_kwargs)
    pruner.save_pretrained(out, model_card=False)
    return report


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)
        assert torch.equal(a[k] == 0, b[k] == 0) or atol > 0, k  # same masks
