"""Data-parallel calibration on torch.distributed: 2 CPU processes on gloo, started by torchrun, give the
single-process result (to float tolerance), through the API and the CLI; a rank that dies leaves no output, and the
run resumes from its checkpoint."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from scale_utils import assert_same_state, prune_and_save, saved_state
from testing_utils import calibration_ids
from transformers import LlamaConfig, LlamaForCausalLM

from optimum_prune import (
    AMPConfig,
    FISTAConfig,
    FLAPConfig,
    NumericalConfig,
    PruningConfig,
    SparseGPTConfig,
    save_pruned_model,
)
from optimum_prune.cli import main as cli_main
from optimum_prune.methods.sparsegpt.pruner import SparseGPTPruner

NP = {"pruning_ratio": 0.3, "round_to": 1}
# name: (config, low_memory); every kind of statistic: Grams, cross-Grams, moments, AMP's inputs (and squared norms:
# Wanda, through the CLI)
CASES = {
    "sparsegpt": (SparseGPTConfig(sparsity=0.5), True),
    "numerical": (NumericalConfig(**NP), True),
    "flap": (FLAPConfig(**NP), False),
    "fista": (FISTAConfig(sparsity=0.5, K=3, max_outer=2), False),
    "amp": (AMPConfig(sparsity=0.5, cg_steps=3, refit_steps=3), False),
}
ATOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _source(path: Path, tokenizer) -> Path:
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=72, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=12)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    save_pruned_model(model, path, tokenizer, model_card=False)
    return path


def _cli_args(src: Path, out: Path) -> list[str]:
    return ["prune", str(src), "--method", "wanda", "--ratio", "0.5", "--calib", "bbc", "--num-samples", "4",
            "--seq-len", "32", "--batch-size", "2", "--low-memory", "-o", str(out)]  # fmt: skip


def _torchrun(job: dict, tmp_path: Path, **env_vars: str) -> tuple[subprocess.CompletedProcess, str]:
    """`distributed_worker.py` on 2 CPU processes (gloo) started by torchrun; the process and its log's tail."""
    (tmp_path / "job.json").write_text(json.dumps(job))
    worker = Path(__file__).with_name("distributed_worker.py")
    env = {**os.environ, **env_vars, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                                               os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(worker), str(tmp_path / "job.json")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    return proc, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_two_processes_give_the_single_process_result(tmp_path, smollm2_tokenizer, monkeypatch):
    src = _source(tmp_path / "src", smollm2_tokenizer)
    out, ckpt = tmp_path / "dp", tmp_path / "run"
    job = {
        "src": str(src),
        "out": str(out),
        "cases": [{"name": n, "config": c.to_dict(), "low_memory": low} for n, (c, low) in CASES.items()],
        "cli": _cli_args(src, out / "cli"),
        "dying": SparseGPTConfig(sparsity=0.5).to_dict(),
        "checkpoint": str(ckpt),
    }
    proc, log = _torchrun(job, tmp_path)
    assert proc.returncode != 0, log  # rank 1 died in the last run: the launcher reports the failure
    ids = calibration_ids(8, 16)
    for name, (config, _) in CASES.items():
        assert (out / name / "config.json").is_file(), log
        report = prune_and_save(src, config, tmp_path / "single" / name, calibration=ids, batch_size=3)
        assert_same_state(saved_state(tmp_path / "single" / name), saved_state(out / name), atol=ATOL)
        if name == "amp":  # the solver and the refit saw every sample on both ranks
            dp = json.loads((out / "amp.json").read_text())["info"]["layers"]
            for i, layer in report.info["layers"].items():
                for key in ("curvature_mean", "lambda_"):
                    assert abs(dp[str(i)][key] - layer[key]) < 1e-9 * layer[key]
                assert abs(dp[str(i)]["refit_loss"][1] - layer["refit_loss"][1]) < 1e-9 * layer["refit_loss"][1]
    assert cli_main(_cli_args(src, tmp_path / "cli")) == 0
    assert_same_state(saved_state(tmp_path / "cli"), saved_state(out / "cli"), atol=ATOL)
    # the dying rank: no output where the model is expected, the finished blocks are in the checkpoint
    assert not (out / "dying").exists()
    finished = sorted(p.name for p in (ckpt / "stage0").glob("block*.json"))
    assert len(finished) >= 2, finished
    seen = []
    original = SparseGPTPruner.prune_layer
    monkeypatch.setattr(SparseGPTPruner, "prune_layer", lambda self, run, view, d: seen.append(view.index) or
                        original(self, run, view, d))  # fmt: skip
    cfg = PruningConfig.from_dict(job["dying"])
    prune_and_save(src, cfg, tmp_path / "resumed", low_memory=True, calibration=ids, batch_size=3, checkpoint_dir=ckpt)
    assert seen == list(range(len(finished), 4))
    assert_same_state(saved_state(tmp_path / "single" / "sparsegpt"), saved_state(tmp_path / "resumed"), atol=ATOL)


def test_rank_zero_alone_and_every_rank_can_save(tmp_path, smollm2_tokenizer):
    """`if rank == 0: pruner.save_pretrained(out)` (rank 0 used to wait in a barrier the others never reached, then
    exit 1) and the save on every rank both write the model, and the run ends cleanly."""
    src = _source(tmp_path / "src", smollm2_tokenizer)
    out = tmp_path / "dp"
    config = NumericalConfig(**NP)
    job = {"mode": "saves", "src": str(src), "out": str(out), "config": config.to_dict()}
    proc, log = _torchrun(job, tmp_path, OPTIMUM_PRUNE_DIST_TIMEOUT="120")  # a rank left waiting fails in 2 min
    assert proc.returncode == 0, log
    prune_and_save(src, config, tmp_path / "single", calibration=calibration_ids(8, 16), batch_size=3)
    for name in ("rank0", "all"):
        assert_same_state(saved_state(tmp_path / "single"), saved_state(out / name), atol=ATOL)


def test_jobs_are_balanced_over_the_ranks(monkeypatch):
    """FISTA's projections of one input group go to the ranks longest first, each to the least loaded one."""
    from optimum_prune.utils import distributed

    assert distributed.assign_ranks([576, 192, 192]) == [0, 0, 0]  # one process does everything
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    assert distributed.assign_ranks([576, 192, 192]) == [0, 1, 1]  # q | k, v
    assert distributed.assign_ranks([1536, 1536]) == [0, 1]  # gate | up
    assert distributed.assign_ranks([100, 300, 200, 200]) == [0, 0, 1, 1]  # 300 + 100 | 200 + 200
    assert distributed.assign_ranks([576]) == [0]
