"""The serving-shape search (`ServingConfig`): each variant's loss against float64 references, the knapsack against
brute force, KV-head merges removed ≡ zeroed, and whole prunes under each target that save, reload and meet it."""

import copy
import dataclasses
import itertools
import json

import pytest
import torch
from testing_utils import calibration_ids, logits, tiny_model

from optimum_prune import AutoPrunedModelForCausalLM, ServingConfig, prune_, save_pruned_model
from optimum_prune.evaluation.cost_model import NO_OP, Workload, analytic_cost_table
from optimum_prune.functional.assembly import choose_options, lagrangian_bound
from optimum_prune.functional.variants import adjacent_merges, merge_kv_weights, refit_loss, width_losses
from optimum_prune.methods.numerical.serving import ServingPruner, layer_options
from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view, weight_oi
from optimum_prune.modeling.surgery import apply_layer_plan_
from optimum_prune.plan import LayerPlan


def _wide(layers=4, seed=0, **kw):
    return tiny_model("llama_gqa", seed=seed, intermediate_size=768, num_hidden_layers=layers, **kw)


def _gram(a, b=None):
    b = a if b is None else b
    return a.T @ b / a.shape[0]


# ------------------------------------------------------------------------------------------------ the math
def test_refit_loss_is_the_least_squares_residual():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(400, 12, generator=g, dtype=torch.float64)
    Z = X @ torch.randn(12, 12, generator=g, dtype=torch.float64) * 0.3 + 0.1 * torch.randn(
        400, 12, generator=g, dtype=torch.float64
    )
    W = torch.randn(5, 12, generator=g, dtype=torch.float64)
    Y = X @ W.T
    sol = torch.linalg.lstsq(Z, Y).solution  # (12, 5)
    direct = ((Y - Z @ sol) ** 2).sum(1).mean()
    got = refit_loss(W, _gram(X), _gram(X, Z), _gram(Z), damping=0.0)
    assert got == pytest.approx(float(direct), rel=1e-8)
    # damped: the loss of the ridge around W that it describes
    gamma = 0.1 * _gram(Z).diagonal().mean()
    Wn = (
        W
        + torch.linalg.solve(
            _gram(Z) + gamma * torch.eye(12, dtype=torch.float64), (W @ _gram(X, Z) - W @ _gram(Z)).T
        ).T
    )
    assert refit_loss(W, _gram(X), _gram(X, Z), _gram(Z), damping=0.1) == pytest.approx(
        float(((Y - Z @ Wn.T) ** 2).sum(1).mean()), rel=1e-8
    )


def test_width_losses_are_the_refitted_removal_residuals():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(300, 10, generator=g, dtype=torch.float64) @ torch.randn(10, 10, generator=g, dtype=torch.float64)
    W = torch.randn(4, 10, generator=g, dtype=torch.float64)
    order = torch.randperm(10, generator=g)
    got = width_losses(W, _gram(X), order, [10, 7, 3, 0], damping=0.0)
    Y = X @ W.T
    assert got[10] == 0.0 and got[0] == pytest.approx(float((Y**2).sum(1).mean()), rel=1e-10)
    for w in (7, 3):
        keep = order[10 - w :]
        sol = torch.linalg.lstsq(X[:, keep], Y).solution
        assert got[w] == pytest.approx(float(((Y - X[:, keep] @ sol) ** 2).sum(1).mean()), rel=1e-7)


def test_merged_kv_weights_average_the_members():
    W = torch.arange(4 * 3 * 2, dtype=torch.float64).view(4 * 3, 2)  # 4 KV heads of 3 rows
    merged = merge_kv_weights(W, [[0, 2], [1, 3]], head_dim=3).view(4, 3, 2)
    heads = W.view(4, 3, 2)
    for a, b in ((0, 2), (1, 3)):
        torch.testing.assert_close(merged[a], (heads[a] + heads[b]) / 2)
        torch.testing.assert_close(merged[b], merged[a])
    assert adjacent_merges(4, 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="cannot be merged"):
        adjacent_merges(3, 2)


@pytest.mark.parametrize("seed", range(6))
def test_knapsack_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    groups = [[(float(c), float(e)) for c, e in torch.rand(int(torch.randint(1, 5, (1,), generator=g)), 2,
                                                          generator=g)] for _ in range(5)]  # fmt: skip
    budget = sum(min(c for c, _ in opts) for opts in groups) + 0.8
    best = min(
        (sum(groups[i][k][1] for i, k in enumerate(ch)), ch)
        for ch in itertools.product(*[range(len(o)) for o in groups])
        if sum(groups[i][k][0] for i, k in enumerate(ch)) <= budget
    )
    choice, info = choose_options(groups, budget, resolution=20000)
    assert info["cost"] <= budget + 1e-12
    assert info["error"] == pytest.approx(best[0], abs=2e-3 * max(best[0], 1))  # exact up to the cost grid
    assert lagrangian_bound(groups, budget) <= best[0] + 1e-9 and 0 <= info["gap"] < 1


def test_knapsack_refuses_a_budget_below_the_cheapest_assembly():
    with pytest.raises(ValueError, match="below the cheapest"):
        choose_options([[(2.0, 0.0), (1.0, 1.0)]], 0.5)


# ---------------------------------------------------------------------------------------- merges in models
def test_kv_merge_removed_equals_zeroed_with_regrouped_query_heads():
    model = tiny_model("llama", seed=3)  # MHA: 4 KV heads, one query head each
    spec = get_spec(model)
    merge = [[2, 0], [1, 3]]  # not adjacent: the query heads move
    zeroed, removed = copy.deepcopy(model), copy.deepcopy(model)
    for m, mode in ((zeroed, "zero"), (removed, "remove")):
        view = layer_view(get_layers(m, spec)[1], 1, spec, m.config)
        weights = {p: merge_kv_weights(weight_oi(view.module(p)).detach(), merge, view.head_dim)
                   for p in spec.qkv_paths[1:]}  # fmt: skip
        apply_layer_plan_(view, LayerPlan(merge_kv=merge, weights=weights), mode=mode)
    assert get_layers(removed, spec)[1].self_attn.k_proj.weight.shape[0] == 2 * view.head_dim
    assert get_layers(removed, spec)[1].self_attn.num_key_value_groups == 2
    torch.testing.assert_close(logits(removed), logits(zeroed), rtol=1e-5, atol=1e-5)
    assert (logits(removed) - logits(model)).abs().max() > 1e-4  # the merge changed something


def test_a_kv_merge_must_partition_the_kv_heads():
    model = tiny_model("llama", seed=3)
    spec = get_spec(model)
    view = layer_view(get_layers(model, spec)[0], 0, spec, model.config)
    with pytest.raises(ValueError, match="groups of one size"):
        apply_layer_plan_(view, LayerPlan(merge_kv=[[0, 1], [2]]), mode="remove")


def test_layer_options_stay_inside_what_the_readers_load():
    model = _wide()
    spec = get_spec(model)
    views = [layer_view(layer, i, spec, model.config) for i, layer in enumerate(get_layers(model, spec))]
    first = layer_options(views[0], ServingConfig())
    assert all(a != NO_OP for a, _ in first)  # layer 0 keeps its attention (vLLM, SGLang)
    later = layer_options(views[2], ServingConfig())
    assert (NO_OP, NO_OP) in later and all(a == NO_OP for a, m in later if m == NO_OP)  # no MLP only without attention
    assert {m for _, m in later if m != NO_OP} == {768, 512, 256}
    assert {a for a, _ in layer_options(views[2], ServingConfig(), kv=1)} == {1, NO_OP}
    assert layer_options(views[1], ServingConfig(skip_layers=(1,))) == [(2, 768)]
    assert layer_options(views[1], ServingConfig(skip_layers=(1,)), kv=1) == []  # a skipped layer keeps its 2
    assert {a for a, _ in layer_options(views[2], ServingConfig(kv_merge=False, remove_sublayers=False))} == {2}
    # llama.cpp aborts on a last layer with neither sublayer: kept there unless the reader is vLLM alone
    assert (NO_OP, NO_OP) not in layer_options(views[2], ServingConfig(), last=True)
    assert (NO_OP, NO_OP) not in layer_options(views[2], ServingConfig(reader="llama.cpp"), last=True)
    assert (NO_OP, NO_OP) in layer_options(views[2], ServingConfig(reader="vllm"), last=True)
    pruner = ServingPruner(ServingConfig())
    pruner.validate(model, spec)
    assert (NO_OP, NO_OP) not in pruner._options(views[-1]) and (NO_OP, NO_OP) in pruner._options(views[-2])


# ------------------------------------------------------------------------------------------- whole prunes
def _memory(rows, cfg, model):
    w = cfg.parsed_workload
    d = model.config.hidden_size
    total = 0
    for r in rows:
        h, kv, hd, m = r["num_attention_heads"], r["num_key_value_heads"], r["head_dim"], r["intermediate_size"]
        total += 2 * d * h * hd + 2 * d * kv * hd + 3 * d * m + 2 * kv * hd * w.batch * w.context
    return total * cfg.memory_dtype_bytes


def _layer0_attention(model, ids):
    out = {}
    attn = get_layers(model, get_spec(model))[0].self_attn

    def hook(module, args, output):
        out["y"] = output[0].detach().double()

    handle = attn.register_forward_hook(hook)
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    return out["y"]


def test_memory_target_merges_kv_heads_the_loss_it_predicts_is_measured_and_the_model_reloads(tmp_path):
    model = _wide(seed=2)
    dense = copy.deepcopy(model)
    ids = calibration_ids(8, 16)
    # decode at batch 64 and 4k context: the KV cache dominates; 0.06 GB leaves room for one KV head per layer only
    cfg = ServingConfig(memory_gb=0.06, workload="decode:64:4096", reader="llama.cpp", remove_sublayers=False,
                        error_scale="absolute")  # fmt: skip
    report = prune_(model, cfg, ids)
    assert [r["num_key_value_heads"] for r in report.layers] == [1, 1, 1, 1]
    assert _memory(report.layers, cfg, model) + 0 <= 0.06e9
    assembly = report.info["assembly"]
    assert assembly["target"] == "memory" and assembly["cost"] <= assembly["budget"] and 0 <= assembly["gap"] < 1
    # layer 0 sees the same inputs dense and pruned: the loss its merge was scored with is what its refit leaves
    predicted = report.info["variant_losses"][0]["attention"]["1"]
    measured = float(((_layer0_attention(dense, ids) - _layer0_attention(model, ids)) ** 2).sum(-1).mean())
    assert predicted == pytest.approx(measured, rel=2e-3)
    assert predicted < report.info["variant_losses"][0]["attention"]["no_op"]
    out = save_pruned_model(model, tmp_path / "out", format="deci")
    cfg_json = json.loads((out / "config.json").read_text())
    assert [b["attention"]["n_heads_in_group"] for b in cfg_json["block_configs"]] == [6, 6, 6, 6]
    reloaded = AutoPrunedModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)


def test_speed_target_on_an_analytic_table_is_met_by_the_prediction():
    model = _wide(layers=5)
    workload = Workload("decode", 16, 2048)
    table = analytic_cost_table(model.config, workload, bandwidth_gbs=20, tflops=0.5, sublayer_overhead_s=2e-6)
    dense_rows = [dict(r) for r in _rows(model)]
    cfg = ServingConfig(speedup=1.6, workload=workload.name, cost_table=table.to_dict())
    report = prune_(model, cfg, calibration_ids(8, 16))
    speedup = table.predict(dense_rows) / table.predict(report.layers)
    assert speedup >= 1.6 - 1e-9
    assert report.info["assembly"]["predicted_speedup"] == pytest.approx(speedup)
    assert len({r["num_key_value_heads"] for r in report.layers if r["num_attention_heads"]}) == 1  # reader="all"
    assert report.layers[0]["num_attention_heads"] > 0


def _rows(model):
    from optimum_prune.modeling.shapes import layer_table

    return layer_table(model, get_spec(model))


def test_parameter_target_removes_the_ratio():
    model = _wide()
    report = prune_(model, ServingConfig(pruning_ratio=0.3), calibration_ids(8, 16))
    assert 0.3 - 1e-9 <= report.measured <= 0.45
    assert report.info["components"]["allocation"] == "variants (params)"


def _mlp_widths(report):
    return [r["intermediate_size"] for r in report.layers]


def test_ranked_widths_without_attention_variants_are_nps_servable_allocation():
    from optimum_prune import NumericalConfig
    from optimum_prune.modeling.shapes import attention_mlp_params

    model = tiny_model("llama_gqa", seed=3, intermediate_size=1280, num_hidden_layers=5)
    ids = calibration_ids(8, 16)
    dense_params = attention_mlp_params(model, get_spec(model))
    np_model = copy.deepcopy(model)
    np_report = prune_(np_model, NumericalConfig(pruning_ratio=0.3, allocation="servable"), ids)
    assert len(set(_mlp_widths(np_report))) > 1  # the ranking across layers gives different widths
    removed = 1 - attention_mlp_params(np_model, get_spec(np_model)) / dense_params  # exactly a prefix of the ranking
    cfg = ServingConfig(pruning_ratio=removed - 1e-9, mlp_widths="ranked", kv_merge=False, remove_sublayers=False,
                        compensation_inputs="sequential")  # fmt: skip
    served = copy.deepcopy(model)
    report = prune_(served, cfg, ids)
    assert _mlp_widths(report) == _mlp_widths(np_report)
    assert report.info["assembly"]["mlp_widths"] == "ranked" and 0 < report.info["assembly"]["ranked_step"]
    for a, b in zip(get_layers(served, get_spec(served)), get_layers(np_model, get_spec(np_model))):
        assert a.mlp.gate_proj.weight.shape == b.mlp.gate_proj.weight.shape
    # the same kept channels: the gate / up rows are the dense ones, untouched by either refit
    for a, b in zip(get_layers(served, get_spec(served)), get_layers(np_model, get_spec(np_model))):
        torch.testing.assert_close(a.mlp.gate_proj.weight, b.mlp.gate_proj.weight, rtol=0, atol=0)
    # with the dense-input refit (the default) it is NP's servable model itself; the sequential one differs
    dense_refit = copy.deepcopy(model)
    prune_(dense_refit, dataclasses.replace(cfg, compensation_inputs=ServingConfig.compensation_inputs), ids)
    assert ServingConfig.compensation_inputs == "dense"
    torch.testing.assert_close(logits(dense_refit), logits(np_model), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits(served), logits(np_model), rtol=1e-4, atol=1e-4)


def test_ranked_widths_stay_on_the_ranking_beside_attention_variants():
    from optimum_prune.functional.allocation import channel_block_path

    model, ids = _wide(layers=5, seed=4), calibration_ids(8, 16)
    workload = Workload("prefill", 1, 512)
    table = analytic_cost_table(model.config, workload, bandwidth_gbs=20, tflops=0.5, sublayer_overhead_s=2e-6)
    cfg = ServingConfig(speedup=1.4, workload=workload.name, cost_table=table.to_dict(), mlp_widths="ranked",
                        error_scale="absolute")  # fmt: skip
    knap = prune_(copy.deepcopy(model), dataclasses.replace(cfg, mlp_widths="knapsack"), ids)
    report = prune_(model, cfg, ids)
    assert table.predict(_rows(_wide(layers=5, seed=4))) / table.predict(report.layers) >= 1.4 - 1e-9
    assembly = report.info["assembly"]
    # its widths are those of a prefix of NP's block ranking (layers left whole or removed whole aside)
    chan = [torch.tensor([float(s) for s in range(768)]) for _ in range(5)]  # any scores: only the path's form
    assert len(channel_block_path(chan, 256)) == assembly["ranked_steps"] == 5 * 2
    widths = [v["mlp"] for v in assembly["variants"]]
    assert all(w == "no_op" or w % 256 == 0 for w in widths)
    # a restriction of the knapsack's options: never a smaller summed error under the same losses and budget
    assert assembly["error"] >= knap.info["assembly"]["error"] * (1 - 1e-9)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (ServingConfig(speedup=1.3), "cost-model"),
        (ServingConfig(memory_gb=1e-6), "cannot be met"),
        (ServingConfig(speedup=1.3, workload="decode:1:2048", cost_table="TABLE"), "measured at decode:16:2048"),
    ],
    ids=["no-table", "unreachable", "other-workload"],
)
def test_bad_targets_are_refused_before_any_weight_changes(config, match, tmp_path):
    model = _wide()
    if config.cost_table == "TABLE":
        path = tmp_path / "table.json"
        analytic_cost_table(model.config, Workload("decode", 16, 2048), bandwidth_gbs=20, tflops=1).save(path)
        config = ServingConfig(speedup=1.3, workload="decode:1:2048", cost_table=str(path))
    before = logits(model)
    with pytest.raises(ValueError, match=match):
        prune_(model, config, calibration_ids(8, 16))
    torch.testing.assert_close(logits(model), before, rtol=0, atol=0)


def test_config_validates_and_round_trips():
    from optimum_prune import PruningConfig

    cfg = ServingConfig(speedup=1.4, cost_table="t.json", workload="prefill:1:512", reader="llama.cpp")
    assert PruningConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with_candidates = ServingConfig(candidates=["mlp_only", "mlp_only"])
    assert with_candidates.candidates == ("mlp_only",)
    assert PruningConfig.from_dict(json.loads(json.dumps(with_candidates.to_dict()))) == with_candidates
    old = {k: v for k, v in cfg.to_dict().items() if k != "candidates"} | {"config_version": 2}
    assert PruningConfig.from_dict(old).candidates == ()  # a file of version 2 runs as it ran
    assert cfg.compensation_inputs == "dense"  # the default since version 4; a file of version 3 ran sequential
    v3 = {k: v for k, v in cfg.to_dict().items() if k != "compensation_inputs"} | {"config_version": 3}
    assert PruningConfig.from_dict(v3) == dataclasses.replace(cfg, compensation_inputs="sequential")
    assert PruningConfig.from_dict(cfg.to_dict() | {"compensation_inputs": "sequential"}).compensation_inputs == (
        "sequential"
    )  # a field written in the file is read as written, whatever its version
    for bad, match in [
        ({"speedup": 1.2, "memory_gb": 3}, "one target"),
        ({"speedup": 0.9}, "must exceed 1"),
        ({"workload": "decode:16"}, "phase:batch:context"),
        ({"reader": "vllm-only"}, "reader"),
        ({"mlp_widths": "global"}, "mlp_widths"),
        ({"joint_probe_rounds": -1}, "joint_probe_rounds"),
        ({"joint_probe_rounds": 2, "error_scale": "residual"}, "end_to_end"),
        ({"candidates": ("uniform",)}, "candidates"),
        ({"candidates": "mlp_only"}, "tuple of names"),
        ({"candidates": ("mlp_only",), "error_scale": "absolute"}, "end_to_end"),
    ]:
        with pytest.raises(ValueError, match=match):
            ServingConfig(**bad)


@pytest.mark.parametrize("inputs", ["dense", "sequential"])
def test_a_run_stopped_in_the_refit_resumes_to_the_same_model(inputs, tmp_path, monkeypatch):
    from scale_utils import assert_same_state, prune_and_save, saved_state, write_checkpoint

    from optimum_prune import AutoPruner

    src = write_checkpoint(tmp_path / "src", intermediate_size=768, num_hidden_layers=5)
    # a memory target at a long context: KV merges and removed attention in the mix
    cfg = ServingConfig(memory_gb=0.04, workload="decode:32:4096", reader="llama.cpp", compensation_inputs=inputs)
    ids = calibration_ids(8, 16)
    report = prune_and_save(src, cfg, tmp_path / "ref", calibration=ids)
    kinds = {(r["num_attention_heads"] > 0, r["num_key_value_heads"]) for r in report.layers}
    assert len(kinds) > 1, kinds  # several variants
    calls, original = [], ServingPruner.refit_projection

    def crash(self, view, *args, **kwargs):
        calls.append(view.index)
        if view.index == 3:
            raise RuntimeError("stopped")
        return original(self, view, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(ServingPruner, "refit_projection", crash)
        with pytest.raises(RuntimeError, match="stopped"):
            AutoPruner.from_pretrained(src).prune(cfg, calibration=ids, checkpoint_dir=tmp_path / "ckpt")
    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(ServingPruner, "refit_projection", lambda self, view, *a, **k: (calls.append(view.index),
                  original(self, view, *a, **k))[1])  # fmt: skip
        prune_and_save(src, cfg, tmp_path / "resumed", calibration=ids, checkpoint_dir=tmp_path / "ckpt")
    assert calls and min(calls) == 3  # the finished blocks were not refitted again
    assert_same_state(saved_state(tmp_path / "ref"), saved_state(tmp_path / "resumed"), atol=1e-5)


def test_end_to_end_scale_makes_a_sublayers_removal_cost_its_measured_kl():
    model = _wide(seed=4)
    ids = calibration_ids(8, 16)
    report = prune_(copy.deepcopy(model), ServingConfig(pruning_ratio=0.3, error_scale="end_to_end",
                                                          probe_tokens=32), ids)  # fmt: skip
    spec = get_spec(model)
    probe = ids[:2]  # 32 tokens: the first two sequences
    with torch.no_grad():
        dense = torch.log_softmax(model(input_ids=probe).logits.double(), -1)
    for i in (1, 2):
        for kind, lp in (("attention", LayerPlan(keep_heads=[])), ("mlp", LayerPlan(keep_channels=[]))):
            cut = copy.deepcopy(model)
            apply_layer_plan_(layer_view(get_layers(cut, spec)[i], i, spec, cut.config), lp, mode="zero")
            with torch.no_grad():
                logp = torch.log_softmax(cut(input_ids=probe).logits.double(), -1)
            kl = float((dense.exp() * (dense - logp)).sum(-1).mean())
            assert report.info["variant_losses"][i][kind]["no_op"] == pytest.approx(kl, rel=1e-3), (i, kind)
    losses = report.info["variant_losses"][2]["mlp"]
    assert 0 < losses["512"] < losses["256"] < losses["no_op"]  # smaller cuts scaled alike


def _kl(model, probe, dense_logp):
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=probe).logits.double(), -1)
    return float((dense_logp.exp() * (dense_logp - logp)).sum(-1).mean())


def _speed_config(model, **kw):
    table = analytic_cost_table(model.config, Workload("decode", 16, 2048), bandwidth_gbs=20, tflops=0.5,
                                sublayer_overhead_s=2e-6)  # fmt: skip
    return ServingConfig(speedup=1.5, workload="decode:16:2048", cost_table=table.to_dict(), probe_tokens=32,
                         kv_merge=False, **kw)  # fmt: skip


def test_joint_probe_measures_the_attention_removals_together_and_changes_nothing_without_rounds():
    model = tiny_model("llama_gqa", seed=0, intermediate_size=768, num_hidden_layers=6)
    ids = calibration_ids(8, 16)
    plain = prune_(copy.deepcopy(model), _speed_config(model), ids)
    joint = prune_(copy.deepcopy(model), _speed_config(model, joint_probe_rounds=2), ids)
    assert "joint_probes" not in plain.info
    record = joint.info["joint_probes"]
    first = record["rounds"][0]
    assert first["variants"] == plain.info["assembly"]["variants"]  # round 0 is the plain solve
    assert first["attention_scale"] == 1.0
    losses = plain.info["variant_losses"]
    removed = [i for i, c in enumerate(first["variants"]) if c["attention"] == NO_OP]
    assert len(removed) >= 2
    # the measured KL is the whole model's with every removed attention removed at once (zeroed form)
    spec, probe = get_spec(model), ids[:2]
    with torch.no_grad():
        dense = torch.log_softmax(model(input_ids=probe).logits.double(), -1)
    cut = copy.deepcopy(model)
    for i in removed:
        apply_layer_plan_(layer_view(get_layers(cut, spec)[i], i, spec, cut.config), LayerPlan(keep_heads=[]), "zero")
    assert first["measured_removal_kl"] == pytest.approx(_kl(cut, probe, dense), rel=1e-3)
    assert first["predicted_removal_kl"] == pytest.approx(sum(losses[i]["attention"]["no_op"] for i in removed))
    others = sum(losses[i]["mlp"][str(c["mlp"])] + (0 if c["attention"] == NO_OP else
                 losses[i]["attention"][str(c["attention"])]) for i, c in enumerate(first["variants"]))  # fmt: skip
    assert first["estimate"] == pytest.approx(first["measured_removal_kl"] + others)
    kept = record["chosen"]
    assert record["rounds"][kept]["estimate"] == min(r["estimate"] for r in record["rounds"])
    assert joint.info["assembly"]["variants"] == record["rounds"][kept]["variants"]


def test_joint_probe_rounds_reprice_attention_removals_that_cost_more_together(monkeypatch):
    """A model whose attention removals compound (the measured KL grows with the number removed together): the
    next solve multiplies every attention-removal loss by the measured KL over the predicted one and removes fewer
    attention sublayers, paying with MLP width; the assembly with the lowest estimate is the one kept."""
    from optimum_prune.pipeline.passes import variants as variants_pass

    real = variants_pass._probe_kl

    def compounding(model, config, plans, ids, dense):
        out = real(model, config, plans, ids, dense)
        return {key: kl * (1 + 3 * max(len(plans[key]) - 1, 0)) for key, kl in out.items()}

    monkeypatch.setattr(variants_pass, "_probe_kl", compounding)
    model = tiny_model("llama_gqa", seed=0, intermediate_size=768, num_hidden_layers=6)
    report = prune_(copy.deepcopy(model), _speed_config(model, joint_probe_rounds=3), calibration_ids(8, 16))
    rounds = report.info["joint_probes"]["rounds"]
    assert len(rounds) >= 2 and rounds[1]["no_attention"] < rounds[0]["no_attention"]
    assert rounds[1]["mean_mlp_width"] < rounds[0]["mean_mlp_width"]
    for prev, nxt in zip(rounds, rounds[1:]):
        ratio = prev["measured_removal_kl"] / prev["predicted_removal_kl"]
        assert nxt["attention_scale"] == pytest.approx(min(max(ratio, 1e-2), 1e2), rel=1e-9)
        assert nxt["variants"] != prev["variants"]  # a repeated assembly ends the rounds
    kept = report.info["joint_probes"]["chosen"]
    assert rounds[kept]["estimate"] == min(r["estimate"] for r in rounds)
    assert report.info["assembly"]["variants"] == rounds[kept]["variants"]
    assert [r["num_attention_heads"] == 0 for r in report.layers] == [
        c["attention"] == NO_OP for c in rounds[kept]["variants"]
    ]


@pytest.mark.parametrize(
    ("arch", "inputs"),
    [("llama_gqa", "dense"), ("llama_gqa", "sequential"), ("mistral", "dense"), ("qwen2", "dense")],
)
def test_contract_on_models_the_format_holds(arch, inputs, tmp_path):
    """The contract suite's checks (tests/test_common.py) on models ServingConfig takes: removed = zeroed and a
    deterministic plan; the pruned model decodes with its cache, saves, reloads with both loaders to identical logits;
    the config round-trips and the saved one is the config as it ran."""
    from testing_utils import assert_cached_decoding_matches
    from transformers import AutoModelForCausalLM

    from optimum_prune import PruningConfig
    from optimum_prune.prune import _compute_plan

    def make():
        extra = {"layer_types": ["full_attention"] * 4} if arch == "qwen2" else {}  # (set per layer at init)
        return tiny_model(arch, seed=5, intermediate_size=768, num_hidden_layers=4, **extra)

    reader = "vllm" if arch == "qwen2" else "llama.cpp"  # (Qwen2's biases: vLLM, SGLang, MLX)
    cfg = ServingConfig(memory_gb=0.05, workload="decode:32:4096", reader=reader, compensation_inputs=inputs)
    ids = calibration_ids(8, 16)
    spec, plan = _compute_plan(make(), cfg, ids)
    assert plan.summary() == _compute_plan(make(), cfg, ids)[1].summary()
    # KV merges average k/v weights, so a model with k/v biases (Qwen2) is offered none
    assert any(lp.merge_kv for lp in plan.layers.values()) is (arch != "qwen2")
    zeroed, removed = make(), make()
    for m, mode in ((zeroed, "zero"), (removed, "remove")):
        for i, lp in plan.layers.items():
            apply_layer_plan_(layer_view(get_layers(m, spec)[i], i, spec, m.config), lp, mode=mode)
    assert sum(p.numel() for p in removed.parameters()) < sum(p.numel() for p in zeroed.parameters())
    torch.testing.assert_close(logits(removed), logits(zeroed), rtol=1e-5, atol=1e-5)
    model = make()
    report = prune_(model, cfg, ids)
    assert report.params_after < report.params_before
    assert_cached_decoding_matches(model)
    out = save_pruned_model(model, tmp_path / "out")  # format="auto": the DeciLM format
    assert json.loads((out / "config.json").read_text())["model_type"] == "nemotron-nas"
    for loader in (AutoPrunedModelForCausalLM, AutoModelForCausalLM):
        reloaded = loader.from_pretrained(out, attn_implementation="eager")
        torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)
    assert_cached_decoding_matches(reloaded)
    assert PruningConfig.from_dict(cfg.to_dict()) == cfg
    cfg.save_pretrained(tmp_path / "cfg")
    assert PruningConfig.from_pretrained(tmp_path / "cfg") == cfg
    assert PruningConfig.from_pretrained(out) == cfg.for_architecture(get_spec(model))


def test_qwen2_needs_the_vllm_reader():
    """Qwen2's q/k/v biases load in vLLM, SGLang and MLX only: any other reader is refused before a weight moves."""
    model = tiny_model("qwen2", intermediate_size=768)
    before = logits(model)
    with pytest.raises(ValueError, match="Pass reader='vllm'"):
        prune_(model, ServingConfig(memory_gb=0.05, workload="decode:32:4096"), calibration_ids(8, 16))
    torch.testing.assert_close(logits(model), before, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------- measured candidates
def _prefill_config(model, **kw):
    table = analytic_cost_table(model.config, Workload("prefill", 1, 512), bandwidth_gbs=20, tflops=0.5,
                                sublayer_overhead_s=2e-6)  # fmt: skip
    return ServingConfig(speedup=1.3, workload="prefill:1:512", cost_table=table.to_dict(), probe_tokens=32, **kw)


def test_candidates_are_refitted_measured_and_the_lowest_kl_kept(monkeypatch):
    """The solve and NP's servable allocation at the target are each refitted and measured as a whole: every
    recorded KL is that of the model the candidate prunes to (by hand, float64, on the probe sequences), the kept
    one is the lowest, and the MLP-only candidate is the first step of NP's ranking within the budget."""
    from optimum_prune.pipeline.passes import variants as variants_pass

    model = tiny_model("llama_gqa", seed=1, intermediate_size=1280, num_hidden_layers=5)
    ids = calibration_ids(8, 16)
    probe = ids[:2]
    with torch.no_grad():
        dense = torch.log_softmax(model(input_ids=probe).logits.double(), -1)
    plain_model = copy.deepcopy(model)
    plain = prune_(plain_model, _prefill_config(model), ids)
    assert "candidates" not in plain.info
    measured = copy.deepcopy(model)
    report = prune_(measured, _prefill_config(model, candidates=("mlp_only",)), ids)
    record = report.info["candidates"]
    assert set(record["probe_kl"]) == {"solve", "mlp_only"}
    assert record["assemblies"]["solve"]["variants"] == plain.info["assembly"]["variants"]
    assert record["probe_kl"]["solve"] == pytest.approx(_kl(plain_model, probe, dense), rel=1e-3)
    chosen = min(record["probe_kl"], key=lambda n: (record["probe_kl"][n], n != "solve"))
    assert record["chosen"] == chosen
    assert report.info["assembly"] == record["assemblies"][chosen]
    assert _kl(measured, probe, dense) == pytest.approx(record["probe_kl"][chosen], rel=1e-3)
    mlp_only = record["assemblies"]["mlp_only"]
    assert all(v["attention"] == model.config.num_key_value_heads for v in mlp_only["variants"])
    assert mlp_only["predicted_speedup"] >= 1.3 - 1e-9
    assert 0 < mlp_only["ranked_step"] <= mlp_only["ranked_steps"]

    # the MLP-only candidate kept (its KL made the lowest): the ranked solve without attention variants, i.e. NP's
    # servable allocation (test_ranked_widths_without_attention_variants_are_nps_servable_allocation) at the target
    real = variants_pass._probe_kl

    def favour(model, config, plans, ids, dense):
        measured = real(model, config, plans, ids, dense)
        return {key: kl + (1.0 if key == "solve" else 0.0) for key, kl in measured.items()}

    monkeypatch.setattr(variants_pass, "_probe_kl", favour)
    served = copy.deepcopy(model)
    kept = prune_(served, _prefill_config(model, candidates=("mlp_only",)), ids)
    assert kept.info["candidates"]["chosen"] == "mlp_only"
    assert _mlp_widths(kept) == [v["mlp"] for v in mlp_only["variants"]]
    assert all(r["num_attention_heads"] == model.config.num_attention_heads for r in kept.layers)
    assert _kl(served, probe, dense) == pytest.approx(record["probe_kl"]["mlp_only"], rel=1e-3)
    ranked = copy.deepcopy(model)
    ranked_report = prune_(ranked, _prefill_config(model, mlp_widths="ranked", kv_merge=False, remove_sublayers=False),
                           ids)  # fmt: skip
    assert _mlp_widths(ranked_report) == _mlp_widths(kept)
    torch.testing.assert_close(logits(served), logits(ranked), rtol=1e-5, atol=1e-5)


def test_candidates_refuse_a_checkpointed_run_before_any_weight_changes(tmp_path):
    from optimum_prune import AutoPruner

    model = _wide()
    before = logits(model)
    pruner = AutoPruner(model)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        pruner.prune(_prefill_config(model, candidates=("mlp_only",)), calibration=calibration_ids(8, 16),
                     checkpoint_dir=tmp_path / "ckpt")  # fmt: skip
    torch.testing.assert_close(logits(model), before, rtol=0, atol=0)
