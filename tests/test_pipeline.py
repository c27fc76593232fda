"""The pipeline's contract with the methods: configs resolved once and frozen while they run, plans executed in one
place, and the phase events an observer (the scale benchmark's profiler) receives."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
from scale_utils import write_checkpoint
from testing_utils import calibration_ids, tiny_model

from optimum_prune import AutoPruner, FLAPConfig, NumericalConfig, WandaConfig, prune_
from optimum_prune.methods.numerical.pruner import NumericalPruner
from optimum_prune.methods.unstructured import SequentialPruner
from optimum_prune.pipeline.session import NullSession, PruneSession
from optimum_prune.utils.phases import observe_phases

IDS = calibration_ids(8, 16)


@pytest.mark.parametrize("cls", [NumericalPruner, SequentialPruner])
def test_a_config_is_frozen_while_it_runs(cls, monkeypatch):
    """A hook that changes its config fails (and the model is left as it was); the config passed in is never
    changed."""
    name = "score_layer" if cls is NumericalPruner else "prune_layer"
    original = getattr(cls, name)

    def mutating(self, *args, **kwargs):
        self.config.seed = 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, mutating)
    model = tiny_model("llama_gqa")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = NumericalConfig(pruning_ratio=0.3, round_to=1) if cls is NumericalPruner else WandaConfig(sparsity=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError, match="frozen while it runs"):
        prune_(model, config, calibration=IDS)
    assert config.seed == 0
    assert all((model.state_dict()[k] == v).all() for k, v in before.items())


def test_the_resolved_config_is_recorded_and_the_given_one_untouched(tmp_path):
    config = NumericalConfig(pruning_ratio=0.3, round_to=1, allocation="auto")
    assert config.compensation_bias is None
    pruner = AutoPruner.from_pretrained(tiny_model("llama_gqa"))
    report = pruner.prune(config, calibration=IDS)
    assert config.allocation == "auto" and config.compensation_bias is None  # as passed
    assert report.config["allocation"] == "global"  # (MLP widths of 96: not the servable format)
    assert report.config["compensation_bias"] in (True, False)
    pruner.save_pretrained(tmp_path / "out", model_card=False)
    saved = json.loads((tmp_path / "out" / "pruning_config.json").read_text())
    record = saved if "history" not in saved else saved["history"][-1]
    assert json.dumps(record).count('"allocation": "global"') >= 1
    thawed = dataclasses.replace(config.frozen(), seed=3)
    thawed.seed = 4  # a replace of a frozen config is a config to change
    assert thawed.seed == 4


def test_a_frozen_config_deep_copies_unfrozen():
    import copy

    frozen = FLAPConfig(pruning_ratio=0.3).frozen()
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.pruning_ratio = 0.4
    thawed = copy.deepcopy(frozen)
    thawed.pruning_ratio = 0.4
    assert thawed.pruning_ratio == 0.4 and frozen.pruning_ratio == 0.3 and thawed != frozen


@pytest.mark.parametrize("low_memory", [False, True])
def test_plans_are_executed_by_the_session_only(low_memory, tmp_path, monkeypatch):
    """The runner hands each stage's plan to `session.apply`, the one place plans are executed (a low-memory run
    executed every block's plan when it finished it: nothing is left to apply)."""
    import optimum_prune.pipeline.session as session

    calls = []
    real = session.apply_plan_

    def counting(model, spec, plan):
        calls.append(sum(not lp.applied for lp in plan.layers.values()))
        return real(model, spec, plan)

    monkeypatch.setattr(session, "apply_plan_", counting)
    src = write_checkpoint(tmp_path / "src", num_hidden_layers=3)
    pruner = AutoPruner.from_pretrained(src, low_memory=low_memory)
    report = pruner.prune(NumericalConfig(pruning_ratio=0.3, round_to=1), calibration=IDS, batch_size=3)
    assert report.params_after < report.params_before
    assert len(calls) == 1 and (calls[0] == 0) == low_memory
    assert isinstance(NullSession(), NullSession) and hasattr(PruneSession, "apply")


def test_phase_observer_sees_each_block_of_each_pass(tmp_path):
    src = write_checkpoint(tmp_path / "src", num_hidden_layers=3)
    events = []
    pruner = AutoPruner.from_pretrained(src, low_memory=True)
    with observe_phases(lambda event, name, block: events.append((event, name, block))):
        pruner.prune(NumericalConfig(pruning_ratio=0.3, round_to=1), calibration=IDS, batch_size=3)
    starts = Counter((name, block) for event, name, block in events if event == "start")
    ends = Counter((name, block) for event, name, block in events if event == "end")
    assert starts == ends  # every phase closes, errors or not
    for i in range(3):
        for name in ("forward", "decide", "refit", "load block", "release block", "write block"):
            assert starts[(name, i)] >= 1, (name, i, sorted(starts))
    assert starts[("embed calibration", None)] >= 1 and starts[("measure", None)] == 0  # structured: no sparsity
    depth = 0
    for event, _, _ in events:  # nested, never interleaved
        depth += 1 if event == "start" else -1
        assert depth >= 0
    with observe_phases(lambda *a: events.append(a)):
        pass
    n = len(events)
    prune_(tiny_model("llama_gqa"), WandaConfig(sparsity=0.5), calibration=IDS)  # no observer: nothing recorded
    assert len(events) == n


def test_the_report_names_the_components_that_ran():
    report = prune_(tiny_model("llama_gqa"), NumericalConfig(pruning_ratio=0.3, round_to=1), calibration=IDS)
    c = report.info["components"]
    assert c == {"scores": "numerical", "standardized": True, "allocation": "global", "refit": "dense",
                 "refit_bias": False, "refit_strength": 1.0}, c  # fmt: skip
    light = prune_(tiny_model("llama_gqa"), FLAPConfig(pruning_ratio=0.2, round_to=1), calibration=IDS)
    assert light.info["components"]["refit"] == "bias" and light.info["components"]["allocation"] == "global"
