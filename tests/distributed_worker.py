"""Worker of `tests/test_distributed.py`, started on every rank by `torchrun` (not a test module).

Runs the cases of a job file on this rank's share of the calibration samples: the Python API (rank 0 saves), the CLI
as `torchrun -m optimum_prune.cli prune ...` runs it, then a checkpointed run during which rank 1 dies. A job in mode
"saves" instead saves from rank 0 alone and from every rank.
"""

from __future__ import annotations

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(__file__))

from testing_utils import calibration_ids  # noqa: E402

from optimum_prune import AutoPruner, PruningConfig  # noqa: E402
from optimum_prune.cli import main as cli_main  # noqa: E402
from optimum_prune.pipeline.session import PruneSession  # noqa: E402
from optimum_prune.utils.distributed import init_from_env, rank  # noqa: E402


def _config(spec):
    return [PruningConfig.from_dict(c) for c in spec] if isinstance(spec, list) else PruningConfig.from_dict(spec)


def saves(job: dict) -> None:
    """The save on every rank (a rank that then waits for rank 0 in a barrier reads the complete directory), then
    the usual `if rank == 0: save` at the end of a torchrun script: rank 1 exits while rank 0 writes."""
    import torch
    import torch.distributed as dist

    from optimum_prune import AutoPrunedModelForCausalLM

    pruner = AutoPruner.from_pretrained(job["src"])
    pruner.prune(_config(job["config"]), calibration=calibration_ids(8, 16), batch_size=3)
    pruner.save_pretrained(os.path.join(job["out"], "all"), model_card=False)
    dist.barrier()
    reloaded = AutoPrunedModelForCausalLM.from_pretrained(os.path.join(job["out"], "all")).state_dict()
    for k, v in pruner.model.state_dict().items():
        assert torch.equal(reloaded[k], v), k
    if rank() == 0:
        pruner.save_pretrained(os.path.join(job["out"], "rank0"), model_card=False)


def main(job_file: str) -> None:
    with open(job_file, encoding="utf-8") as f:
        job = json.load(f)
    assert init_from_env(), "not started by torchrun with 2 processes"
    if job.get("mode") == "saves":
        return saves(job)
    ids = calibration_ids(8, 16)
    for case in job["cases"]:
        pruner = AutoPruner.from_pretrained(job["src"], low_memory=case["low_memory"])
        report = pruner.prune(_config(case["config"]), calibration=ids, batch_size=3)
        pruner.save_pretrained(os.path.join(job["out"], case["name"]), model_card=False)
        if rank() == 0:
            report.to_json_file(os.path.join(job["out"], case["name"] + ".json"))
    if job.get("mode") == "cases":  # the cases alone (tests/experts)
        return
    assert cli_main(job["cli"]) == 0
    if rank() == 1:  # dies right after finishing block 2: no exception, no cleanup
        finish = PruneSession.finish

        def dying(self, i, *args, **kwargs):
            finish(self, i, *args, **kwargs)
            if i == 2:
                os.kill(os.getpid(), signal.SIGKILL)

        PruneSession.finish = dying
    pruner = AutoPruner.from_pretrained(job["src"], low_memory=True)
    pruner.prune(_config(job["dying"]), calibration=ids, batch_size=3, checkpoint_dir=job["checkpoint"])
    pruner.save_pretrained(os.path.join(job["out"], "dying"))


if __name__ == "__main__":
    main(sys.argv[1])
