"""Resumable runs: `prune_(..., checkpoint_dir=...)` records every finished block atomically.

Layout of a checkpoint directory:

    run.json                         what was run: the model's and the run's fingerprints (written once)
    stage<k>/block<i>.safetensors    block i as stage k left it (full tensor names: stock safetensors)
    stage<k>/block<i>.json           written after the tensors are on disk: block i of stage k is finished
                                     (its shapes, the structured decision, the report entries, the file's size)
    stage<k>/scores<i>.safetensors   a structured stage's ranking scores of block i (its first pass)
    stage<k>/complete.json           the stage's report data, once every block is finished

A stage is one `prune_` config (a recipe has one per structured config, then one for its unstructured pass). A
block is finished when its `.json` exists and its tensor file has the recorded size; the first damaged record of a
stage and every later one are redone. Files are written to a temporary name, flushed and renamed, so a kill leaves
either the old state or the new one. Only rank 0 of a process group writes here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..calibration.sequential import input_embedding_weight
from ..modeling.architectures import get_layers
from ..modeling.shapes import layer_table
from ..storage.streaming import get_store, read_tensors, write_safetensors
from ..utils.distributed import barrier, is_main_process, world_size
from ..utils.scratch import write_text_atomic
from ..version import __version__

__all__ = ["RunCheckpoint", "fingerprint_model", "jsonable", "run_fingerprint"]

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
FORMAT = 1
HASHED = 4096  # values of each sampled tensor that a model's fingerprint hashes


def jsonable(obj: Any) -> Any:
    """Report entries as JSON values (tensors become lists, numpy scalars numbers, tuples lists)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if hasattr(obj, "item") and callable(obj.item):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def _write_json(data: Any, path: Path) -> None:
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True))


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def fingerprint_model(model: nn.Module, sample: dict[str, torch.Tensor]) -> dict:
    """What identifies a model: its config, dtype, and a hash of the first bytes of a few of its tensors."""
    cfg = model.config.to_dict()
    for k in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_attn_implementation_autoset"):
        cfg.pop(k, None)
    h = hashlib.sha256()
    for name in sorted(sample):
        t = sample[name].detach().reshape(-1)[:HASHED].float().cpu()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    text = json.dumps(jsonable(cfg), sort_keys=True)
    return {
        "model_type": cfg.get("model_type"),
        "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "weights_sha256": h.hexdigest(),
        "dtype": str(next(iter(sample.values())).dtype) if sample else None,
    }


class RunCheckpoint:
    """A checkpoint directory of one run (see the module docstring).

    Args:
        directory (`str | os.PathLike`): created if absent; an existing one must hold the same run.
        fingerprint (`dict`): `{"model": ..., "run": ..., "processes": ...}` of this run; a difference in `model` or
            `run` with the recorded one is an error that says what differs (in `processes`: a warning).
    """

    def __init__(self, directory: str | os.PathLike, fingerprint: dict) -> None:
        self.directory = Path(directory).absolute()
        self.fingerprint = jsonable(fingerprint)
        self.writer = is_main_process()
        run_file = self.directory / RUN_FILE
        if self.writer:
            self._open(run_file)
        barrier()
        if not self.writer:
            self._check(run_file)

    def _open(self, run_file: Path) -> None:
        d = self.directory
        if d.exists() and not d.is_dir():
            raise NotADirectoryError(f"checkpoint_dir {d} is a file. Choose a directory.")
        if d.is_dir() and not run_file.is_file():
            entries = sorted(e.name for e in d.iterdir() if not e.name.startswith("."))
            if entries:
                raise FileExistsError(
                    f"checkpoint_dir {d} is not empty ({', '.join(entries[:4])}) and holds no optimum_prune run "
                    f"({RUN_FILE} is missing). Choose a new or empty directory."
                )
        if run_file.is_file():
            self._check(run_file)
            logger.info("Resuming the run recorded in %s", d)
            return
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PermissionError(f"Cannot create checkpoint_dir {d}: {e}. Choose a writable directory.") from e
        _write_json({"format": FORMAT, "optimum_prune_version": __version__, **self.fingerprint}, run_file)

    def _check(self, run_file: Path) -> None:
        try:
            recorded = _read_json(run_file)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"{run_file} is damaged ({e}); the checkpoint cannot be trusted. Delete {self.directory} to start over."
            ) from e
        diffs = [
            f"{part}.{key}: recorded {recorded.get(part, {}).get(key)!r}, now {value!r}"
            for part in ("model", "run", "processes")
            for key, value in self.fingerprint.get(part, {}).items()
            if recorded.get(part, {}).get(key) != value
        ]
        soft = [d for d in diffs if d.startswith("processes.")]
        if soft:  # e.g. resumed with fewer processes after a node died: same result to float tolerance
            logger.warning("checkpoint %s was started with other processes (%s); the blocks finished then are kept "
                           "(the result equals a single run's to float tolerance).", self.directory, "; ".join(soft))  # fmt: skip
        diffs = [d for d in diffs if d not in soft]
        if diffs:
            what = "model" if any(d.startswith("model.") for d in diffs) else "configuration or calibration data"
            raise ValueError(
                f"checkpoint_dir {self.directory} holds a run of a different {what} ({'; '.join(diffs[:3])}). Use a "
                f"new checkpoint directory for this run, or delete {self.directory} to start over."
            )

    # ------------------------------------------------------------------------------------------------- blocks
    def stage_dir(self, stage: int) -> Path:
        return self.directory / f"stage{stage}"

    def block_file(self, stage: int, i: int) -> Path:
        return self.stage_dir(stage) / f"block{i:05d}.safetensors"

    def finished(self, stage: int, num_layers: int) -> dict[int, dict]:
        """Records of the finished blocks of `stage`, up to (excluding) the first missing or damaged one (blocks are
        finished in order)."""
        out: dict[int, dict] = {}
        for i in range(num_layers):
            rec_path = self.stage_dir(stage) / f"block{i:05d}.json"
            if not rec_path.is_file():
                break
            try:
                rec = _read_json(rec_path)
                size = self.block_file(stage, i).stat().st_size if rec.get("bytes") is not None else None
                ok = rec.get("bytes") == size
            except (OSError, ValueError):
                ok = False
            if not ok:
                logger.warning(
                    "checkpoint %s: the record of block %d of stage %d is damaged; it and every later block of the "
                    "stage are redone.", self.directory, i, stage,
                )  # fmt: skip
                if self.writer:
                    for j in range(i, num_layers):
                        (self.stage_dir(stage) / f"block{j:05d}.json").unlink(missing_ok=True)
                break
            out[i] = rec
        return out

    def write_block(self, stage: int, i: int, tensors: dict[str, torch.Tensor] | None, record: dict) -> Path | None:
        """Write block `i` of `stage` (its tensors, `None` for a block the stage left unchanged; then its record);
        returns the tensor file."""
        path = self.block_file(stage, i)
        if self.writer:
            path.parent.mkdir(parents=True, exist_ok=True)
            if tensors is not None:
                write_safetensors(tensors, path)
            size = path.stat().st_size if tensors is not None else None
            _write_json(jsonable({**record, "bytes": size}), path.with_suffix(".json"))
        return path if tensors is not None else None

    def write_scores(self, stage: int, i: int, tensors: dict[str, torch.Tensor]) -> None:
        if self.writer:
            path = self.stage_dir(stage) / f"scores{i:05d}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors(tensors, path)

    def read_scores(self, stage: int, i: int) -> dict[str, torch.Tensor] | None:
        path = self.stage_dir(stage) / f"scores{i:05d}.safetensors"
        if not path.is_file():
            return None
        try:
            return read_tensors(path)
        except OSError:
            logger.warning("checkpoint: damaged scores of block %d (stage %d); they are computed again", i, stage)
            return None

    def complete(self, stage: int) -> dict | None:
        path = self.stage_dir(stage) / "complete.json"
        try:
            return _read_json(path) if path.is_file() else None
        except (OSError, ValueError):
            return None

    def mark_complete(self, stage: int, info: dict) -> None:
        if self.writer:
            self.stage_dir(stage).mkdir(parents=True, exist_ok=True)
            _write_json(jsonable(info), self.stage_dir(stage) / "complete.json")


def run_fingerprint(model, spec, configs, ids, batch_size, device) -> dict:
    """What a checkpoint is checked against: the model (its embeddings, first block's first weight and per-layer
    shapes), the run (its configs and calibration ids) and the processes (world size, device type)."""
    store = get_store(model)
    layer = get_layers(model, spec)[0]
    name = spec.linear_paths[0]
    if store is not None:
        store.load(0)
    try:
        sample = {"embeddings": input_embedding_weight(model), "block0": layer.get_submodule(name).weight}
        # the first values only: a copy of a whole memory-mapped embedding would make all its pages resident
        model_fp = fingerprint_model(model, {k: v.detach().reshape(-1)[:HASHED].clone() for k, v in sample.items()})
        model_fp["layers_sha256"] = hashlib.sha256(json.dumps(layer_table(model, spec)).encode()).hexdigest()
    finally:
        if store is not None:
            store.offload(0)
    run = {
        "configs": [c.to_dict() for c in configs],
        "calibration_sha256": None if ids is None else hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
        "calibration_shape": None if ids is None else list(ids.shape),
        "batch_size": None if ids is None else batch_size,
    }
    processes = {"world_size": world_size(), "device": None if device is None else torch.device(device).type}
    return {"model": model_fp, "run": run, "processes": processes}
