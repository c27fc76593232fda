"""Solution Path Pruning: the Bregman dynamics against a float64 reference, the path's order and cut, masked ≡
removed on every architecture, one search → a family of exactly reloadable models, and the bad-input contract."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
from testing_utils import ARCHS, calibration_ids, calibration_pixels, logits, tiny_model

from optimum_prune import AutoPrunedModelForCausalLM, AutoPruner, NumericalConfig, prune_, save_pruned_model
from optimum_prune.methods.spp import SolutionPath, SolutionPathError, SPPConfig, SPPRIAConfig, SPPSearchError
from optimum_prune.methods.spp.extract import POOLS
from optimum_prune.methods.spp.functional import (
    auto_nu,
    bregman_step_,
    init_state,
    reachable_z,
    removal_order,
    select_removed,
)
from optimum_prune.methods.spp.masks import SearchMasks, attach_masks
from optimum_prune.methods.spp.search import search_views
from optimum_prune.modeling.architectures import get_layers, get_spec

# A short search on the tiny models whose units enter over several steps (a few never): a real path, in 10 steps.
# (The released code's dynamics: the machinery tests need most units to enter; the default dynamics' ranking is
# tested on its own below.)
FAST = {
    "faithful_to": "code",
    "steps": 10,
    "batch_size": 1,
    "lr": 0.08,
    "lambda_": 0.7,
    "betas": (0.5, 0.9),
    "round_to": 1,
    "head_dim_multiple": 1,
    "compensate": False,
    "prune_attention": True,
}  # fmt: skip  (no refit: extraction without data; the attention cut too, which the machinery tests need)
FAST_DEFAULTS = {k: v for k, v in FAST.items() if k not in ("compensate", "prune_attention")}  # the extraction's own


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _reference_code(grads, lr, lam, kappa, betas, eps, interval, nu=None, plain_z=False):
    """The released code's dynamics (`faithful_to="code"`), written out with Python floats: AdamW on M,
    Z += s_t κ (M_{k+1} − Γ), Γ = max(Z − λ, 0); with `nu`, AdamW on ∇L + (M − Γ)/ν (the coupled loss's gradient);
    `plain_z` (`"coupled"`): Z += lr κ (M_{k+1} − Γ)."""
    n = len(grads[0])
    M, Z, G, m, v = [1.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    entry, record = [-1] * n, [0] * n
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        for i in range(n):
            gi = g[i] + ((M[i] - G[i]) / nu if nu else 0.0)
            m[i] = b1 * m[i] + (1 - b1) * gi
            v[i] = b2 * v[i] + (1 - b2) * gi**2
            s = lr / (1 - b1**t)
            M[i] -= s * m[i] / (math.sqrt(v[i]) / math.sqrt(1 - b2**t) + eps)
            Z[i] += (lr if plain_z else s) * kappa * (M[i] - G[i])
            G[i] = max(Z[i] - lam, 0.0)
            if G[i] != 0 and entry[i] < 0:
                entry[i] = t
            if t % interval == 0:
                record[i] += G[i] != 0
    return M, Z, G, entry, record


def _reference_paper(grads, lr, lam, kappa, nu):
    """Eq. 10: M ← M − κα(∇L + (M − Γ)/ν), Z ← Z + (α/ν)(M_k − Γ), Γ = κ·sign(Z)·max(|Z| − λ, 0)."""
    n = len(grads[0])
    M, Z, G, entry = [1.0] * n, [0.0] * n, [0.0] * n, [-1] * n
    for t, g in enumerate(grads, start=1):
        for i in range(n):
            c = M[i] - G[i]
            M[i] -= kappa * lr * (g[i] + c / nu)
            Z[i] += lr / nu * c
            G[i] = kappa * math.copysign(max(abs(Z[i]) - lam, 0.0), Z[i])
            if G[i] != 0 and entry[i] < 0:
                entry[i] = t
    return M, Z, G, entry


@pytest.mark.parametrize("faithful_to", ["coupled", "code", "code+coupling", "paper"])
def test_bregman_step_matches_float64_reference(faithful_to):
    coupling = faithful_to == "code+coupling"
    faithful_to = faithful_to.split("+")[0]
    g = torch.Generator().manual_seed(0)
    grads = (torch.randn(40, 6, generator=g, dtype=torch.float64) * 0.3 + torch.linspace(-1, 1, 6)).tolist()
    kw = {"lr": 0.05, "lambda_": 2.0, "kappa": 1.3, "betas": (0.9, 0.99), "eps": 1e-4, "interval": 5, "nu": 20.0}
    if faithful_to == "paper":
        kw.update(lr=0.5, lambda_=0.5)
    mask = torch.ones(6, dtype=torch.float64)
    state = init_state(mask, faithful_to)
    for grad in grads:
        g = torch.tensor(grad, dtype=torch.float64)
        bregman_step_(mask, g, state, faithful_to=faithful_to, coupling=coupling, **kw)
    if faithful_to in ("code", "coupled"):
        nu = kw["nu"] if coupling or faithful_to == "coupled" else None
        M, Z, G, entry, record = _reference_code(
            grads,
            kw["lr"],
            kw["lambda_"],
            kw["kappa"],
            kw["betas"],
            kw["eps"],
            5,
            nu,
            plain_z=faithful_to == "coupled",
        )
        assert state["record"].tolist() == record
    else:
        M, Z, G, entry = _reference_paper(grads, kw["lr"], kw["lambda_"], kw["kappa"], kw["nu"])
    torch.testing.assert_close(mask, torch.tensor(M, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state["z"], torch.tensor(Z, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state["gamma"], torch.tensor(G, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert state["entry"].tolist() == entry
    assert len(set(entry)) >= 3  # units enter at different steps (or never): the recorded order is exercised


def test_auto_nu_and_reachable_z():
    """ν = nu_scale / RMS of a kind's first-step mask gradients; `reachable_z` is the Z of a unit held at M = 1 (the
    step-by-step dynamics with zero loss gradient and no pull give the same)."""
    grads = [torch.tensor([3.0, -4.0]), torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])]
    assert auto_nu(grads, 2.0) == pytest.approx(2.0 / math.sqrt(25 / 10))
    with pytest.raises(ValueError, match="all zero"):
        auto_nu([torch.zeros(3)], 1.0)
    for mode in ("coupled", "code"):
        mask = torch.ones(1, dtype=torch.float64)
        state = init_state(mask, mode)
        for _ in range(7):
            mask.fill_(1.0)
            bregman_step_(mask, torch.zeros(1, dtype=torch.float64), state, faithful_to=mode, lr=0.05, lambda_=99.0,
                          nu=1e30, betas=(0.9, 0.99))  # fmt: skip
        assert float(state["z"]) == pytest.approx(reachable_z(mode, 7, 0.05, betas=(0.9, 0.99)), rel=1e-9)
    assert reachable_z("paper", 10, 0.5, nu=20.0) == pytest.approx(0.25)


@pytest.mark.parametrize(
    "kwargs",
    [{"lr": 0}, {"faithful_to": "both"}, {"pools": "x"}, {"head_dim_multiple": 0}, {"steps": 0},
     {"stop_at_density": 2}, {"statistic": "rank"}, {"attention_scale": "x"}, {"betas": (1.0, 0.9)}],
)  # fmt: skip
def test_bad_config_values_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SPPConfig(**kwargs)


def test_removal_order_entry_then_tie_break_then_never():
    entry = torch.tensor([5, 3, 3, -1, -1, 9])
    z = torch.tensor([9.0, 1.0, 2.0, 0.5, 0.7, 3.0])
    gamma = torch.tensor([1.0, 3.0, 0.1, 0.0, 0.0, 0.2])
    record = torch.tensor([1, 4, 4, 0, 0, 0])
    assert removal_order(entry, record, z, gamma).tolist() == [3, 4, 5, 0, 1, 2]
    assert removal_order(entry, record, z, gamma, tie_break="gamma").tolist()[-2:] == [2, 1]
    assert removal_order(entry, record, z, gamma, statistic="step_record").tolist() == [3, 4, 5, 0, 1, 2]


def test_select_removed_matches_the_target_through_ties_and_guards():
    order = torch.arange(10)
    costs = torch.tensor([3.0] * 10)
    groups = torch.tensor([0] * 5 + [1] * 5)
    removed = select_removed(order, costs, groups, caps=[2, 5], target=5 * 3.0)
    assert removed.tolist() == [True, True] + [False] * 3 + [True] * 3 + [False] * 2  # group 0 capped at 2
    assert select_removed(order, costs, groups, [5, 5], 7.0).sum() == 2  # 6 is closer to 7 than 9


@pytest.mark.parametrize("arch", ARCHS)
def test_binary_masks_are_the_extracted_model(arch):
    """The search masks at 0/1 (hooks on the stock model) give the logits of the physically sliced model."""
    model = tiny_model(arch)
    pruner = AutoPruner(copy.deepcopy(model), keep_teacher=False)
    report = pruner.prune(SPPConfig(pruning_ratio=0.3, **FAST), calibration=calibration_ids())
    assert report.info["pools"] and report.params_after < report.params_before
    config = SPPConfig(pruning_ratio=0.3, **FAST)
    spec = get_spec(model)
    from optimum_prune.methods.spp.extract import extract_keep

    keep, _ = extract_keep(pruner.solution_path, model, spec, config)
    views, units = search_views(model, spec, config)
    masks = SearchMasks(units)
    masks.set_binary_(keep)
    with attach_masks(views, spec, masks):
        masked = logits(model)
    torch.testing.assert_close(logits(pruner.model), masked, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen3", "opt", "gpt2"])
def test_folded_masks_are_the_masked_model(arch):
    """fold_masks=True: the extracted model computes what the search's masks (times 0/1 keep) computed."""
    from optimum_prune.methods.spp.extract import extract_keep

    model = tiny_model(arch)
    pruner = AutoPruner(copy.deepcopy(model), keep_teacher=False)
    pruner.prune(SPPConfig(pruning_ratio=0.3, fold_masks=True, **FAST), calibration=calibration_ids())
    spec, config = get_spec(model), SPPConfig(pruning_ratio=0.3, **FAST)
    keep, _ = extract_keep(pruner.solution_path, model, spec, config)
    views, units = search_views(model, spec, config)
    masks = SearchMasks(units)
    masks.set_binary_(keep)
    with torch.no_grad():
        for i, kind, p in masks.items():
            p.mul_(pruner.solution_path.stats[(i, kind)]["mask"])
    assert any(not torch.all(p == p.round()) for _, _, p in masks.items())  # real mask values, not 0/1
    with attach_masks(views, spec, masks):
        masked = logits(model)
    torch.testing.assert_close(logits(pruner.model), masked, rtol=1e-4, atol=1e-4)  # products in another order


@pytest.mark.parametrize("pools", ["separate", "per_kind", "cost_weighted"])
def test_pools_split_the_removed_parameters(pools):
    """Each pool loses the same fraction of its parameters (per_kind: q/k, v/o and MLP separately), and the pools
    together lose `pruning_ratio` of the attention + MLP parameters."""
    model = tiny_model("llama_gqa")
    report = AutoPruner(copy.deepcopy(model), keep_teacher=False).prune(
        SPPConfig(pruning_ratio=0.3, pools=pools, **FAST), calibration=calibration_ids()
    )
    info = report.info["pools"]
    assert set(info) == set(POOLS[pools])
    target = {p["target_fraction"] for p in info.values()}
    assert len(target) == 1 and 0.2 < target.pop() < 0.5  # one fraction for every pool
    for name, p in info.items():
        assert abs(p["selected_fraction"] - p["target_fraction"]) < 0.1, name
    assert report.measured == pytest.approx(0.3, abs=0.05)


def test_one_search_a_family_that_reloads_exactly(tmp_path):
    model = tiny_model("llama_gqa")
    dense = logits(model)
    pruner = AutoPruner(model, keep_teacher=False)
    path = pruner.search_solution_path(SPPConfig(**FAST), calibration=calibration_ids())
    torch.testing.assert_close(logits(model), dense, rtol=0, atol=0)  # the search changed nothing
    assert not any(p.requires_grad is False for p in model.parameters())
    saved = path.save_pretrained(tmp_path / "path")
    assert sorted(p.name for p in saved.iterdir()) == ["solution_path.json", "solution_path.safetensors"]
    assert sum(p.stat().st_size for p in saved.iterdir()) < 64_000  # statistics, not weights
    loaded = SolutionPath.from_pretrained(saved)
    assert loaded.steps == FAST["steps"] and loaded.entered_fraction() == path.entered_fraction() > 0.9
    entries = torch.cat([s["entry"] for s in loaded.stats.values()])
    assert len(entries.unique()) > 3  # units entered at different steps
    params = []
    for ratio in (0.1, 0.2, 0.3):
        member = copy.deepcopy(model)
        rep = prune_(member, SPPConfig(pruning_ratio=ratio, solution_path=str(saved), **FAST))  # no calibration
        assert abs(rep.measured - ratio) < 0.03 and rep.calibration is None and not rep.info["searched"]
        params.append(rep.params_after)
        save_pruned_model(member, tmp_path / f"out{ratio}")
        cfg = json.loads((tmp_path / f"out{ratio}" / "config.json").read_text())
        assert cfg["model_type"] == "optimum_pruned_llama" and any("qk_head_dim" in x for x in cfg["pruned_layers"])
        for impl in ("eager", "sdpa"):
            reloaded = AutoPrunedModelForCausalLM.from_pretrained(tmp_path / f"out{ratio}", attn_implementation=impl)
            torch.testing.assert_close(logits(reloaded), logits(member), rtol=0 if impl == "eager" else 1e-5,
                                       atol=0 if impl == "eager" else 1e-5)  # fmt: skip
    assert params[0] > params[1] > params[2]
    # search + extract in one call picks the same structure as extraction from the saved path
    once = copy.deepcopy(model)
    prune_(once, SPPConfig(pruning_ratio=0.2, **FAST), calibration_ids())
    torch.testing.assert_close(logits(once), logits(AutoPrunedModelForCausalLM.from_pretrained(tmp_path / "out0.2")))


def test_generation_with_cache_and_reduced_scale(tmp_path):
    model = tiny_model("qwen3")  # per-head q/k norms
    prune_(model, SPPConfig(pruning_ratio=0.3, attention_scale="reduced", **FAST), calibration_ids())
    attn = model.model.layers[0].self_attn
    assert attn.scaling == pytest.approx(attn.qk_head_dim**-0.5)
    ids = calibration_ids(1, 6, seed=5)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert int(model(out[:, :-1], use_cache=False).logits[0, -1].argmax()) == int(out[0, -1])
    save_pruned_model(model, tmp_path / "out")
    reloaded = AutoPrunedModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert reloaded.model.layers[0].self_attn.scaling == attn.scaling
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)


def test_mlp_only_uniform_family_member_loads_with_stock_transformers(tmp_path):
    model = tiny_model("llama")
    prune_(
        model,
        SPPConfig(pruning_ratio=0.2, allocation="uniform", **{**FAST, "prune_attention": False}),
        calibration_ids(),
    )
    save_pruned_model(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llama"


def test_bad_paths_ratios_and_configs_fail_before_anything_changes(tmp_path):
    model = tiny_model("llama")
    short_cfg = {**FAST, "steps": 8, "lambda_": 0.76}
    short = AutoPruner(model).search_solution_path(SPPConfig(**short_cfg), calibration_ids())
    assert short.entered_fraction() < 0.6
    where = str(short.save_pretrained(tmp_path / "short"))
    files = {p.name: p.read_bytes() for p in (tmp_path / "short").iterdir()}
    snap = _state(model)
    cases = [
        (SPPConfig(pruning_ratio=0.1, solution_path=where, **short_cfg), "below what this solution path covers"),
        (SPPConfig(pruning_ratio=0.1, solution_path=where, **FAST), "steps=10 but the solution path was searched"),
        (SPPConfig(pruning_ratio=0.95, solution_path=where, **short_cfg, extrapolate=True), "cannot be reached"),
        (SPPConfig(solution_path=str(tmp_path / "nowhere")), "not a saved solution path"),
        (SPPConfig(solution_path=where, prune_attention=False, prune_mlp=True, skip_layers=(0,)), None),
    ]
    for config, message in cases[:-1]:
        with pytest.raises((SolutionPathError, FileNotFoundError), match=message):
            prune_(model, config)
    with pytest.raises(SolutionPathError, match="other weights"):
        prune_(tiny_model("llama", seed=1), SPPConfig(pruning_ratio=0.5, solution_path=where))
    with pytest.raises(SolutionPathError, match="llama model with 3 layers"):
        prune_(tiny_model("opt"), SPPConfig(pruning_ratio=0.5, solution_path=where))
    mlp_path = AutoPruner(model).search_solution_path(
        SPPConfig(**{**FAST, "prune_attention": False}), calibration_ids()
    )
    with pytest.raises(SolutionPathError, match="no attention units"):
        prune_(model, SPPConfig(solution_path=str(mlp_path.save_pretrained(tmp_path / "mlp")), **FAST))
    assert all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())
    rep = prune_(model, SPPConfig(pruning_ratio=0.1, solution_path=where, extrapolate=True, **short_cfg))
    assert abs(rep.measured - 0.1) < 0.03  # units that never entered, ranked by Z
    assert {p.name: p.read_bytes() for p in (tmp_path / "short").iterdir()} == files


def test_nan_loss_stops_the_search_and_leaves_the_model_as_it_was():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[calibration_ids()[0, 0]] = float("nan")
    snap = _state(model)
    with pytest.raises(SPPSearchError, match="NaN|nan"):
        prune_(model, SPPConfig(pruning_ratio=0.3, **FAST), calibration_ids())
    state = model.state_dict()
    assert state.keys() == snap.keys() and all(
        torch.equal(
            state[k],
            v,
        )
        or torch.isnan(v).any()
        for k, v in snap.items()
    )
    assert all(p.requires_grad for p in model.parameters()) and not model.training
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_pruned_head_dims_refused_by_head_pruning_and_gguf_export():
    from optimum_prune.export.gguf import GGUFExportError, gguf_layout

    model = tiny_model("llama")
    prune_(model, SPPConfig(pruning_ratio=0.3, **FAST), calibration_ids())
    with pytest.raises(ValueError, match="pruned q/k or v/o head dimensions"):
        prune_(model, NumericalConfig(pruning_ratio=0.2, round_to=1), calibration_ids())
    prune_(model, NumericalConfig(pruning_ratio=0.1, round_to=1, prune_attention=False), calibration_ids())
    with pytest.raises(GGUFExportError, match="head dimensions"):
        gguf_layout(model)  # what export_gguf checks before it writes anything


def test_image_search_needs_a_classifier_and_labels():
    """The search trains on an image classifier's cross-entropy: with `search_labels="data"` on labelled images (also
    a seeded subset of a `CalibrationConfig`, labels matched to the images it picks), unlabelled images refused
    first; by default on classes drawn from the classifier itself (no labels needed). A backbone is refused first."""
    from testing_utils import calibration_for

    from optimum_prune import CalibrationConfig, SPPRIAConfig
    from optimum_prune.calibration.images import calibration_labels, image_calibration

    model = tiny_model("vit")
    examples = calibration_for("vit", labelled=True)
    subset = CalibrationConfig(dataset=examples, num_samples=4, seed=3)
    pixels, _ = image_calibration(model, subset)
    by_image = {p.sum().item(): e["labels"] for p, e in zip(calibration_for("vit"), examples)}
    assert calibration_labels(subset).tolist() == [by_image[p.sum().item()] for p in pixels]
    config = SPPConfig(**{**FAST, "steps": 8, "search_labels": "data"})
    assert AutoPruner(model).search_solution_path(config, calibration=subset).steps == 8
    unlabelled = calibration_for("vit")
    assert AutoPruner(model).search_solution_path(SPPConfig(**{**FAST, "steps": 8}), calibration=unlabelled).steps == 8
    snap = _state(model)
    for config in (SPPConfig(pruning_ratio=0.3, search_labels="data", **FAST), SPPRIAConfig(sparsity=0.5, steps=40)):
        with pytest.raises(ValueError, match="The images have no labels"):
            prune_(model, config, unlabelled)
    backbone = tiny_model("dinov2_backbone")
    backbone_snap = _state(backbone)
    for labels in ("data", "sampled", "dense"):
        with pytest.raises(ValueError, match="Dinov2Model has no classification head"):
            AutoPruner(backbone).search_solution_path(SPPConfig(search_labels=labels, **FAST), calibration=examples)
    assert all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, backbone_snap[k]) for k, v in backbone.state_dict().items())


# ------------------------------------------------------------------------------------------- ranking (issue 29)
def _self_sampled(model, n: int = 128, length: int = 32) -> torch.Tensor:
    """Text the model itself generates (temperature 1): on it the expected loss gradient at M = 1 is zero (score
    identity), as on a trained model's own data, so every live unit's removal costs loss and a dead one costs none."""
    torch.manual_seed(0)
    with torch.no_grad():
        return model.generate(calibration_ids(n, 1, seed=1), max_new_tokens=length - 1, do_sample=True, top_k=0,
                              top_p=1.0, temperature=1.0, pad_token_id=0)  # fmt: skip


def _planted(layer: int = 1, k: int = 8):
    """llama_gqa with dead units planted in `layer`: `k` MLP channels (down_proj columns zero), the first rotary QK
    pair (q and k rows j, j + d/2 zero in every head) and the first VO dimension (v rows zero)."""
    model = tiny_model("llama_gqa")
    att = model.model.layers[layer].self_attn
    d, cfg = att.head_dim, model.config
    with torch.no_grad():
        model.model.layers[layer].mlp.down_proj.weight[:, :k] = 0
        for proj, heads in ((att.q_proj, cfg.num_attention_heads), (att.k_proj, cfg.num_key_value_heads)):
            proj.weight.view(heads, d, -1)[:, [0, d // 2]] = 0
        att.v_proj.weight.view(cfg.num_key_value_heads, d, -1)[:, 0] = 0
    return model, {(layer, "mlp"): list(range(k)), (layer, "qk"): [0], (layer, "vo"): [0]}


def _positions(path: SolutionPath) -> dict[tuple[int, str], torch.Tensor]:
    """Every unit's place in its pool's removal order (0 = removed first); pools as `pools="separate"`."""
    out = {}
    for kinds in (("qk", "vo"), ("mlp",)):
        keys = [key for key in sorted(path.stats) if key[1] in kinds]
        st = {s: torch.cat([path.stats[key][s] for key in keys]) for s in ("entry", "record", "z", "gamma")}
        order = removal_order(st["entry"], st["record"], st["z"], st["gamma"])
        pos = torch.empty(order.numel(), dtype=torch.long)
        pos[order] = torch.arange(order.numel())
        for key, part in zip(keys, pos.split([path.stats[key]["entry"].numel() for key in keys])):
            out[key] = part
    return out


SHAPE = {"round_to": 1, "head_dim_multiple": 1}


def test_planted_dead_units_never_enter_and_are_removed_first():
    """The default (coupled) dynamics pull every mask towards Γ = 0: a dead unit has no loss gradient to resist,
    so it never enters and it goes first. (The authors' uncoupled dynamics rank it mid-path: the next test.)"""
    from optimum_prune.methods.spp.extract import extract_keep

    model, planted = _planted()
    path = AutoPruner(model).search_solution_path(SPPConfig(**SHAPE), calibration=_self_sampled(model))
    pos = _positions(path)
    for key, units in planted.items():
        assert (path.stats[key]["entry"][units] < 0).all(), key  # never entered
        assert path.entered_fraction(key[1]) > 0.3  # while other units of the kind did
    assert max(pos[(1, "qk")][0], pos[(1, "vo")][0]) <= 2  # the dead QK pair and VO dim open the attention order
    assert int(pos[(1, "mlp")][:8].max()) < 16  # the 8 dead channels among the first 16 of 288 removed
    keep, _ = extract_keep(path, model, get_spec(model), SPPConfig(pruning_ratio=0.1, prune_attention=True, **SHAPE))
    for (layer, kind), units in planted.items():
        assert not set(units) & set(keep[layer][kind]), (layer, kind)  # removed at 10%


def test_authors_code_dynamics_rank_dead_units_mid_path():
    """`faithful_to="code"` (the released optimizer, the coupling only logged): nothing pulls a mask down, so a dead
    unit keeps M = 1 and enters at ≈ λ/lr, with the crowd, neither first nor last (documented in docs/methods/spp.md)."""
    model, planted = _planted()
    old = {"faithful_to": "code", "steps": 300, "batch_size": 1, "lr": 1e-2, "lambda_": 2.0}  # the former default
    path = AutoPruner(model).search_solution_path(SPPConfig(**old, **SHAPE), calibration=_self_sampled(model))
    entries = torch.cat([s["entry"] for s in path.stats.values()])
    dead = path.stats[(1, "mlp")]["entry"][planted[(1, "mlp")]]
    assert (dead > 0).all() and (entries > dead.max()).any() and (entries[entries >= 0] < dead.min()).any()
    assert int(_positions(path)[(1, "mlp")][:8].min()) > 16  # not removed first


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def test_paths_from_disjoint_calibration_halves_agree():
    """Two searches on disjoint halves of the calibration data order the units alike (the former default's orders
    were noise: Spearman ≈ 0 on this model)."""
    model = tiny_model("llama_gqa")
    data = _self_sampled(model)
    a, b = (
        _positions(AutoPruner(model).search_solution_path(SPPConfig(**SHAPE), calibration=half))
        for half in (data[:64], data[64:])
    )
    for kinds, least in ((("qk", "vo"), 0.5), (("mlp",), 0.15)):
        keys = [k for k in sorted(a) if k[1] in kinds]
        rho = _spearman(torch.cat([a[k] for k in keys]), torch.cat([b[k] for k in keys]))
        assert rho > least, (kinds, rho)


def test_a_search_too_short_to_enter_anything_is_refused_before_it_runs():
    """The former SPP + RIA benchmark: 48 steps of the code's dynamics at lr 1e-2, λ 2 (a unit at M = 1 enters after
    ~200 steps) entered no weight, so its "path" was never used. Refused when the config is made, or, for an
    `epochs` search (steps known from the data) and a `"paper"` search with a measured ν, before the first step."""
    from optimum_prune import SPPRIAConfig

    with pytest.raises(ValueError, match="cannot enter any unit"):
        SPPRIAConfig(sparsity=0.5, faithful_to="code", steps=48, lr=1e-2, lambda_=2.0)
    with pytest.raises(ValueError, match="cannot enter any unit"):
        SPPConfig(steps=20)  # the default dynamics need ~λ/lr = 33 steps
    model = tiny_model("llama")
    snap = _state(model)
    short_epochs = SPPRIAConfig(sparsity=0.5, epochs=1, batch_size=2, lr=0.08, lambda_=0.4)  # 4 steps on 8 windows
    paper = SPPConfig(pruning_ratio=0.2, faithful_to="paper", steps=10, lr=1e-3, lambda_=1.0)  # ν measured: too short
    for config in (short_epochs, paper):
        with pytest.raises(ValueError, match="cannot enter any unit"):
            prune_(model, config, calibration_ids())
    assert all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())
    assert all(p.requires_grad for p in model.parameters()) and not any(m._forward_hooks for m in model.modules())


def _searched_model_and_refit_inputs(tmp_path):
    """A tiny GQA llama, its calibration ids, a saved path of a short search on them, and the dense model's float64
    inputs of every o_proj / down_proj on those ids (what the refit fits)."""
    model = tiny_model("llama_gqa")
    ids = calibration_ids()
    path = AutoPruner(model).search_solution_path(SPPConfig(**FAST), calibration=ids)
    where = str(path.save_pretrained(tmp_path / "path"))
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: inputs.__setitem__(n, a[0].detach().double()))
             for n, m in model.named_modules() if n.endswith(("o_proj", "down_proj"))]  # fmt: skip
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return model, ids, where, inputs


def test_compensation_is_the_least_squares_refit_of_the_kept_inputs(tmp_path):
    """compensate=True: o_proj on its kept v/o inputs and down_proj on its kept channels are the least-squares fit of
    the dense layer's output on the dense model's inputs (float64 lstsq, damping 0); extracting from a saved path
    then needs calibration, and says so before anything changes."""
    model, ids, where, inputs = _searched_model_and_refit_inputs(tmp_path)
    cfg = {**FAST, "pruning_ratio": 0.3, "solution_path": where}
    cfg.pop("compensate")
    refit, plain = copy.deepcopy(model), copy.deepcopy(model)
    plain_refit = {"compensation_damping": 0.0, "compensation_bias": False, "compensation_strength": 1.0}
    rep = prune_(refit, SPPConfig(**cfg, **plain_refit), ids)  # compensate=True: the default
    prune_(plain, SPPConfig(**cfg, compensate=False))
    assert rep.info["compensate_s"] > 0 and rep.info["compensation_residuals"]
    checked = 0
    for i, (layer, dense_layer) in enumerate(zip(refit.model.layers, model.model.layers)):
        att = layer.self_attn
        kept_vo = [j for j in range(12) if any(torch.equal(att.v_proj.weight[r], dense_layer.self_attn.v_proj.weight[j])
                                                for r in range(att.vo_head_dim))]  # fmt: skip
        for name, new, dense, cols in (
            ("o_proj", att.o_proj, dense_layer.self_attn.o_proj,
             (torch.arange(6)[:, None] * 12 + torch.tensor(kept_vo)[None]).reshape(-1)),
            ("down_proj", layer.mlp.down_proj, dense_layer.mlp.down_proj, None),
        ):  # fmt: skip
            if new.weight.shape == dense.weight.shape:
                continue  # nothing removed here
            X = inputs[f"model.layers.{i}.self_attn.o_proj" if name == "o_proj" else f"model.layers.{i}.mlp.down_proj"]
            X = X.reshape(-1, X.shape[-1])
            if cols is None:  # the kept channels: up_proj rows that survived
                up, dense_up = layer.mlp.up_proj.weight, dense_layer.mlp.up_proj.weight
                cols = torch.tensor([next(j for j in range(96) if torch.equal(dense_up[j], r)) for r in up])
            target = X @ dense.weight.double().T  # (N, d_out): the dense output
            ref = torch.linalg.lstsq(X[:, cols], target).solution.T  # (d_out, k)
            torch.testing.assert_close(new.weight.double(), ref, rtol=1e-4, atol=1e-5)
            assert not torch.allclose(plain.model.layers[i].get_submodule(
                "self_attn.o_proj" if name == "o_proj" else "mlp.down_proj").weight.double(), ref, atol=1e-3)  # fmt: skip
            checked += 1
    assert checked >= 2
    snap = _state(model)
    with pytest.raises(ValueError, match="calibration"):
        prune_(model, SPPConfig(**cfg, compensate=True))
    assert all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="fold_masks"):
        SPPConfig(compensate=True, fold_masks=True)


def test_np_channel_order_switches_where_nps_servable_default_does():
    """SPP's `channel_order="np"` owns its switch ratio (no method imports another); it is NP's servable one."""
    from optimum_prune.methods.numerical.config import LIGHT_RATIOS
    from optimum_prune.methods.spp.config import NP_ORDER_FLUCTUATION_BELOW

    assert NP_ORDER_FLUCTUATION_BELOW == LIGHT_RATIOS["servable"]
    for ratio in (NP_ORDER_FLUCTUATION_BELOW - 0.01, NP_ORDER_FLUCTUATION_BELOW):
        light = NumericalConfig(pruning_ratio=ratio, allocation="servable").resolved_scores == "fluctuation"
        assert light == (ratio < NP_ORDER_FLUCTUATION_BELOW)


@pytest.mark.parametrize("ratio", [0.2, 0.4])  # FLAP's fluctuation metric below NP's light ratio, the scores above
def test_np_channel_order_keeps_the_paths_widths_and_nps_channels(ratio, tmp_path):
    """channel_order="np": every layer keeps as many MLP channels as the path's cut, chosen by NP's scores of
    down_proj's inputs (float64 reference from the dense inputs), then refitted; it reloads exactly, and without
    the refit's Gram it is refused before anything changes."""
    from optimum_prune.functional.gram_scores import numerical_scores

    model, ids, where, inputs = _searched_model_and_refit_inputs(tmp_path)
    cfg = {**FAST, "pruning_ratio": ratio, "solution_path": where, "prune_attention": False}
    cfg.pop("compensate")
    by_path, by_np = copy.deepcopy(model), copy.deepcopy(model)
    prune_(by_path, SPPConfig(**cfg, channel_order="path"), ids)
    rep = prune_(by_np, SPPConfig(**cfg, channel_order="np"), ids)
    light = NumericalConfig(pruning_ratio=ratio, allocation="servable").resolved_scores == "fluctuation"
    assert light == (ratio < 0.25)
    changed = 0
    for i, (a, b, dense) in enumerate(zip(by_path.model.layers, by_np.model.layers, model.model.layers)):
        width = a.mlp.down_proj.in_features
        assert b.mlp.down_proj.in_features == width  # the path's allocation across the layers
        if width == dense.mlp.down_proj.in_features:
            continue
        X = inputs[f"model.layers.{i}.mlp.down_proj"].reshape(-1, dense.mlp.down_proj.in_features)
        W = dense.mlp.down_proj.weight.detach().double()
        if light:  # FLAP's metric: ‖W_:,j‖² · Var(x_j)
            score = W.pow(2).sum(0) * X.var(0, unbiased=False)
        else:
            score = numerical_scores(W, X.T @ X / X.shape[0], ratio)
        want = sorted(torch.sort(score, stable=True).indices[-width:].tolist())
        got = [next(j for j in range(W.shape[1]) if torch.equal(dense.mlp.up_proj.weight[j], r))
               for r in b.mlp.up_proj.weight]  # fmt: skip
        assert got == want
        changed += got != [next(j for j in range(W.shape[1]) if torch.equal(dense.mlp.up_proj.weight[j], r))
                           for r in a.mlp.up_proj.weight]  # fmt: skip
    assert changed >= 1 and rep.info["compensation_residuals"]  # another order than the path's, refitted
    save_pruned_model(by_np, tmp_path / "np_order")
    reloaded = AutoPrunedModelForCausalLM.from_pretrained(tmp_path / "np_order", attn_implementation="eager")
    torch.testing.assert_close(logits(reloaded), logits(by_np), rtol=0, atol=0)
    snap = _state(model)
    with pytest.raises(ValueError, match="compensate=True"):
        SPPConfig(**cfg, channel_order="np", compensate=False)
    with pytest.raises(ValueError, match="channel_order"):
        SPPConfig(**cfg, channel_order="score")
    assert all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("strength", [0.0, 0.5])
def test_compensation_with_bias_at_a_strength_is_the_shrunk_intercept_fit_and_reloads(strength, tmp_path):
    """compensation_bias / compensation_strength: the kept o_proj / down_proj inputs take the fraction s of the
    intercept least-squares fit's change (float64 lstsq on [X_K, 1], damping 0) and the new bias restores the dense
    layer's mean output (s = 0: FLAP's bias compensation, W_P μ_P); the biased model saves and reloads exactly."""
    model, ids, where, inputs = _searched_model_and_refit_inputs(tmp_path)
    cfg = {**FAST, "pruning_ratio": 0.3, "solution_path": where, "compensate": True, "compensation_damping": 0.0}
    pruned = copy.deepcopy(model)
    prune_(pruned, SPPConfig(**cfg, compensation_bias=True, compensation_strength=strength), ids)
    checked = 0
    for i, (layer, dense_layer) in enumerate(zip(pruned.model.layers, model.model.layers)):
        new, dense = layer.mlp.down_proj, dense_layer.mlp.down_proj
        if new.weight.shape == dense.weight.shape:
            continue
        up, dense_up = layer.mlp.up_proj.weight, dense_layer.mlp.up_proj.weight
        cols = torch.tensor([next(j for j in range(96) if torch.equal(dense_up[j], r)) for r in up])
        X = inputs[f"model.layers.{i}.mlp.down_proj"].reshape(-1, 96)
        W = dense.weight.double()
        target = X @ W.T
        design = torch.cat([X[:, cols], torch.ones(len(X), 1, dtype=X.dtype)], 1)
        full = torch.linalg.lstsq(design, target).solution.T[:, :-1]  # (d_out, k): the intercept fit's weights
        W_exp = W[:, cols] + strength * (full - W[:, cols])
        b_exp = (target - X[:, cols] @ W_exp.T).mean(0)  # restores the mean output
        torch.testing.assert_close(new.weight.double(), W_exp, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(new.bias.double(), b_exp, rtol=1e-4, atol=1e-5)
        if strength == 0:
            removed = torch.tensor([j for j in range(96) if j not in cols.tolist()])
            torch.testing.assert_close(new.bias.double(), W[:, removed] @ X[:, removed].mean(0), rtol=1e-4, atol=1e-6)
        checked += 1
    assert checked >= 1 and pruned.model.layers[0].self_attn.o_proj.bias is not None
    save_pruned_model(pruned, tmp_path / "out")
    reloaded = AutoPrunedModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    torch.testing.assert_close(logits(reloaded), logits(pruned), rtol=0, atol=0)
    with pytest.raises(ValueError, match="compensation_strength"):
        SPPConfig(compensation_strength=1.5)


@pytest.mark.parametrize("arch", ["llama", "vit"])
def test_defaults_follow_the_modality(arch, tmp_path):
    """The `None` defaults resolve per modality (each chosen on its selection split). The search: the drawn next
    tokens on a language model, the dense KL on an image model, with masks on the attention in both: the default
    search is exactly the explicit one (recorded in the path). The extraction from one saved path: on a language
    model the MLP channels only, in NP's order, the full refit without an intercept; on an image model every kind in
    the path's order, the full refit with an intercept: exactly the weights of those explicit settings, not the other
    modality's, and the report records the resolved settings."""
    from testing_utils import calibration_for

    text, image = (SPPConfig().for_architecture(SimpleNamespace(modality=m)) for m in ("text", "image"))
    resolved = ("prune_attention", "compensation_bias", "compensation_strength", "channel_order")
    assert [getattr(text, k) for k in resolved] == [False, False, 1.0, "np"]
    assert [getattr(image, k) for k in resolved] == [True, True, 1.0, "path"]
    assert (
        SPPConfig().for_architecture(SimpleNamespace(modality="image"), pairs=False).prune_attention is False
    )  # (no pair attention)
    assert SPPConfig(compensation_bias=True).refit_strength("text") == 0.5  # the intercept's strength on text
    assert SPPConfig(compensation_strength=0.25).refit_strength("image") == 0.25
    assert SPPConfig(compensate=False).order_of_channels("text") == "path"  # NP's order scores the refit's Gram
    assert SPPConfig(prune_mlp=False).cuts_attention("text")  # the attention alone
    assert (SPPConfig().labels_for("text"), SPPConfig().labels_for("image")) == ("sampled", "dense")
    assert SPPConfig(search_labels="data").labels_for("image") == "data"
    model = tiny_model(arch)
    data = calibration_for(arch, labelled=True)
    path = AutoPruner(model).search_solution_path(SPPConfig(**FAST_DEFAULTS), calibration=data)
    labels = "sampled" if arch == "llama" else "dense"
    assert path.meta["search"]["search_labels"] == labels and set(path.kinds) == {"qk", "vo", "mlp"}
    explicit = AutoPruner(model).search_solution_path(
        SPPConfig(**FAST_DEFAULTS, search_labels=labels, prune_attention=True), calibration=data
    )
    assert all(torch.equal(explicit.stats[key]["z"], st["z"]) for key, st in path.stats.items())
    where = str(path.save_pretrained(tmp_path))
    settings = {
        "text": {"prune_attention": False, "compensation_bias": False, "compensation_strength": 1.0,
                 "channel_order": "np"},
        "image": {"prune_attention": True, "compensation_bias": True, "compensation_strength": 1.0,
                  "channel_order": "path"},
    }  # fmt: skip
    states = {}
    for name, given in (("default", {}), *settings.items()):
        pruned = copy.deepcopy(model)
        cfg = SPPConfig(**FAST_DEFAULTS, pruning_ratio=0.3, solution_path=where, **given)
        report = prune_(pruned, cfg, data)
        states[name] = pruned.state_dict()
        if name == "default":
            mine = settings["text" if arch == "llama" else "image"]
            assert {k: report.config[k] for k in mine} == mine
            assert report.info["compensation_strength"] == 1.0
    mine, other = ("text", "image") if arch == "llama" else ("image", "text")
    assert states["default"].keys() == states[mine].keys()
    assert all(torch.equal(v, states[mine][k]) for k, v in states["default"].items())
    assert states["default"].keys() != states[other].keys() or not all(
        torch.equal(v, states[other][k]) for k, v in states["default"].items()
    )


def test_sampled_labels_follow_the_model_and_rank_planted_units_on_any_text():
    """search_labels="sampled": next tokens drawn from the dense model's own predictions (the empirical frequencies
    match its softmax), so a search on arbitrary text (random ids here) still puts the dead units first."""
    from optimum_prune.methods.spp.search_data import sampled_labels

    model, planted = _planted()
    context = calibration_ids(1, 5, seed=3).expand(3000, 5)
    labels = sampled_labels(model, context, batch_size=1000)
    assert (labels[:, 0] == -100).all()
    with torch.no_grad():
        probs = torch.softmax(model(context[:1]).logits[0, 2].float(), -1)
    freq = torch.bincount(labels[:, 3], minlength=probs.numel()).double() / labels.shape[0]
    assert 0.5 * float((freq - probs.double()).abs().sum()) < 0.1  # total variation to the model's distribution
    classifier, image = tiny_model("vit"), calibration_pixels(1, seed=2)
    drawn = sampled_labels(classifier, image.expand(2000, -1, -1, -1), batch_size=1000)  # one class per image
    with torch.no_grad():
        probs = torch.softmax(classifier(pixel_values=image).logits[0].float(), -1)
    freq = torch.bincount(drawn, minlength=probs.numel()).double() / drawn.numel()
    assert drawn.shape == (2000,) and 0.5 * float((freq - probs.double()).abs().sum()) < 0.1
    config = SPPConfig(search_labels="sampled", **SHAPE)
    path = AutoPruner(model).search_solution_path(config, calibration=calibration_ids(128, 32, seed=1))
    pos = _positions(path)
    assert max(pos[(1, "qk")][0], pos[(1, "vo")][0]) <= 2 and int(pos[(1, "mlp")][:8].max()) < 16
    with pytest.raises(ValueError, match="search_labels"):
        SPPConfig(search_labels="soft")


def test_teacher_kl_matches_a_float64_reference_and_vanishes_at_the_teacher():
    """search_labels="dense": the KL divergence from the teacher's top k outputs plus one bucket for the rest equals
    its direct float64 computation, and is 0 with a zero gradient when the model gives the teacher's logits."""
    from optimum_prune.methods.spp.search_data import teacher_kl

    torch.manual_seed(0)
    teacher, student = torch.randn(3, 5, 40, dtype=torch.float64), torch.randn(3, 5, 40, dtype=torch.float64)
    logp, ids = torch.log_softmax(teacher, -1).topk(6, -1)
    p, q = torch.softmax(teacher, -1), torch.softmax(student, -1)
    top_p, top_q = p.gather(-1, ids), q.gather(-1, ids)
    rest_p, rest_q = 1 - top_p.sum(-1), 1 - top_q.sum(-1)
    ref = ((top_p * (top_p / top_q).log()).sum(-1) + rest_p * (rest_p / rest_q).log()).mean()
    assert torch.allclose(teacher_kl(student, ids, logp).double(), ref, rtol=1e-5)
    full_logp, full_ids = torch.log_softmax(teacher, -1).topk(40, -1)  # every output kept: the plain KL
    plain = (p * (p.log() - q.log())).sum(-1).mean()
    assert torch.allclose(teacher_kl(student, full_ids, full_logp).double(), plain, rtol=1e-5)
    at_teacher = teacher.clone().requires_grad_(True)
    loss = teacher_kl(at_teacher, ids, logp)
    loss.backward()
    assert abs(loss.item()) < 1e-6 and float(at_teacher.grad.abs().max()) < 1e-6


@pytest.mark.parametrize(
    "arch, labels", [("llama", "dense"), ("vit", "dense"), ("vit", "sampled"), ("llama", "layers"), ("vit", "layers")]
)
def test_dense_labels_rank_planted_units_first(arch, labels):
    """search_labels="dense" / "layers" (and "sampled" on an image classifier) on arbitrary inputs (random ids,
    unlabelled random images): the loss only measures how far the masks move the model (its predictions, or each
    layer's output) from the dense one, so the planted dead units never enter (and on the language model, whose units
    all matter, they go first); ν, with a loss whose gradient is zero at `M = 1`, comes from the cross-entropy's
    gradient ("dense") or the probe's ("layers"); the model is unchanged."""
    if arch == "llama":
        model, planted = _planted()
        data = calibration_ids(128, 32, seed=1)
    else:
        model = tiny_model("vit")
        with torch.no_grad():
            model.vit.layers[1].mlp.fc2.weight[:, :8] = 0  # 8 dead MLP channels (fc2 columns)
        planted = {(1, "mlp"): list(range(8))}
        data = calibration_pixels(128, seed=1)
    snap = _state(model)
    path = AutoPruner(model).search_solution_path(SPPConfig(search_labels=labels, **SHAPE), calibration=data)
    assert all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())
    assert all(math.isfinite(v) and v > 0 for v in path.meta["nu"].values())
    for key, units in planted.items():
        assert (path.stats[key]["entry"][units] < 0).all(), key
        assert path.entered_fraction(key[1]) > 0.1
    if arch == "llama":
        pos = _positions(path)
        assert max(pos[(1, "qk")][0], pos[(1, "vo")][0]) <= 2 and int(pos[(1, "mlp")][:8].max()) < 16


@pytest.mark.parametrize("arch", ["llama_gqa", "vit"])
def test_layerwise_loss_matches_a_float64_reference_and_vanishes_at_the_dense_model(arch):
    """search_labels="layers": the loss equals its direct float64 computation (each layer masked alone, the others
    at 1, so its input is the dense one, against the dense model's output of that layer, per token, relative to the
    token's own update floored at the median token's), is 0 with a zero gradient at `M = 1`, and leaves the masks as they were."""
    from optimum_prune.methods.spp.search_data import LayerwiseLoss

    model = tiny_model(arch).double().eval()
    spec = get_spec(model)
    config = SPPConfig(**SHAPE, skip_layers=[0] if arch == "vit" else [])
    views, units = search_views(model, spec, config)
    masks = SearchMasks(units).double()
    inputs = {"pixel_values": calibration_pixels(2, seed=1).double()} if arch == "vit" else {
        "input_ids": calibration_ids(2, 12, seed=1), "labels": calibration_ids(2, 12, seed=1)}  # fmt: skip
    layers = get_layers(model, spec)
    plain = {k: v for k, v in inputs.items() if k != "labels"}

    def run(values):  # every layer's (input, output) with the mask values `values`
        seen = {}
        hooks = [layer.register_forward_hook(lambda m, a, kw, o, i=i: seen.__setitem__(i, (
            (a[0] if a else kw["hidden_states"]), o[0] if isinstance(o, tuple) else o)), with_kwargs=True)
            for i, layer in enumerate(layers)]  # fmt: skip
        with torch.no_grad():
            for (_, _, p), v in zip(masks.items(), values):
                p.copy_(v)
            with attach_masks(views, spec, masks):
                model.base_model(**plain)
        for h in hooks:
            h.remove()
        return seen

    ones = [torch.ones_like(p) for _, _, p in masks.items()]
    torch.manual_seed(0)
    values = [torch.rand_like(p) for _, _, p in masks.items()]
    dense = run(ones)
    terms = []
    for layer in sorted(units):
        alone = run([v if i == layer else o for (i, _, _), v, o in zip(masks.items(), values, ones)])
        x, y = dense[layer]
        update = (y - x).pow(2).sum(-1)
        terms.append(((alone[layer][1] - y).pow(2).sum(-1) / torch.maximum(update, update.median())).mean())
    reference = torch.stack(terms).mean()
    loss_fn = LayerwiseLoss(model, masks)
    with torch.no_grad():
        for (_, _, p), v in zip(masks.items(), values):
            p.copy_(v)
    with attach_masks(views, spec, masks), torch.enable_grad():
        loss = loss_fn(inputs)
        assert torch.allclose(loss.double(), reference, rtol=1e-6) and float(reference) > 1e-3
        assert all(torch.equal(p, v) for (_, _, p), v in zip(masks.items(), values))  # the dense pass put them back
        with torch.no_grad():
            for _, _, p in masks.items():
                p.fill_(1.0)
        at_one = loss_fn(inputs)
        grads = torch.autograd.grad(at_one, [p for _, _, p in masks.items()])
    assert abs(float(at_one)) < 1e-12 and max(float(g.abs().max()) for g in grads) < 1e-12
    assert sorted(loss_fn.layers) == sorted(units)


def test_search_windows_do_not_depend_on_how_the_calibration_was_sliced():
    """Every calibration window is cut into windows of about `search_seq_len` tokens: a (32, 512) tensor and its
    (64, 256) and (128, 128) reshapes give the same windows (the same tokens in the same order); a leading BOS is
    given to every piece; `None` and windows no longer than the search's are left as they are."""
    from optimum_prune.methods.spp.search_data import search_windows

    x = torch.arange(32 * 512).view(32, 512)
    for shape in ((32, 512), (64, 256), (128, 128)):
        assert torch.equal(search_windows(x.reshape(shape), 128), x.view(128, 128)), shape
    assert torch.equal(search_windows(x, None), x)
    assert torch.equal(search_windows(x[:, :500], 128), x[:, :500].reshape(128, 125))  # round(500 / 128) = 4 pieces
    assert torch.equal(search_windows(x[:, :130], 128), x[:, :130])  # one piece: as given
    with_bos = torch.cat([torch.full((4, 1), -1), x[:4, : 4 * 127]], dim=1)  # BOS + 508 tokens
    cut = search_windows(with_bos, 128, bos=-1)
    assert cut.shape == (16, 128) and (cut[:, 0] == -1).all()
    assert torch.equal(cut[:, 1:].reshape(4, -1), x[:4, : 4 * 127])
    assert torch.equal(search_windows(x[:4], 128, bos=-1), x[:4].view(16, 128))  # no BOS there: plain pieces


def test_one_search_whatever_the_calibration_slicing():
    """The search of a (4, 64) calibration and of its (16, 16) reshape is the same search (the same windows, labels
    drawn from the dense model, ν and path), of `steps` steps on windows of `search_seq_len` tokens; without the cut
    (`search_seq_len=None`) the search sees other windows and gives another path."""
    model = tiny_model("llama")
    ids = calibration_ids(4, 64, seed=2)
    config = SPPConfig(**{**FAST, "search_seq_len": 16, "search_labels": "sampled"})
    paths = [AutoPruner(model).search_solution_path(config, calibration=x) for x in (ids, ids.view(16, 16))]
    assert [p.meta["windows"] for p in paths] == [[16, 16], [16, 16]] and paths[0].steps == config.steps
    assert paths[0].meta["nu"] == paths[1].meta["nu"] and paths[0].meta["search_cpu_seconds"] > 0
    assert {"targets_seconds", "targets_cpu_seconds"} <= set(paths[0].meta)  # the windows and labels, timed apart
    for key, st in paths[0].stats.items():
        assert all(torch.equal(st[s], paths[1].stats[key][s]) for s in ("entry", "z", "mask")), key
    whole = AutoPruner(model).search_solution_path(SPPConfig(**{**config.search_settings(), "search_seq_len": None,
                                                                "round_to": 1, "head_dim_multiple": 1}), ids)  # fmt: skip
    assert whole.meta["windows"] == [4, 64] and whole.meta["nu"] != paths[0].meta["nu"]
    with pytest.raises(ValueError, match="search_seq_len"):
        SPPConfig(search_seq_len=1)
    assert SPPConfig().search_seq_len == 128 and SPPRIAConfig().search_seq_len is None


# ------------------------------------------------------------------------------------- thread counts (issue 67)
def test_auto_nu_does_not_depend_on_the_thread_count():
    """ν is the RMS of the mask gradients: a sum over a whole tensor of >= 32768 elements runs one partial sum per
    thread (its rounding then follows the thread count); `auto_nu` sums fixed rows and adds them exactly instead."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(331_776, generator=g), torch.randn(1000, generator=g), torch.randn(128, 4097, generator=g)]
    threads = torch.get_num_threads()
    try:
        nus = []
        for n in (1, 2):
            torch.set_num_threads(n)
            nus.append(auto_nu(grads, 1.0))
    finally:
        torch.set_num_threads(threads)
    assert nus[0] == nus[1]
    squares = math.fsum(x * x for t in grads for x in t.double().flatten().tolist())
    assert nus[0] == 1.0 / math.sqrt(squares / sum(t.numel() for t in grads))  # the exactly rounded sum


_THREADS_SEARCH = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from testing_utils import calibration_ids, tiny_model
from optimum_prune import AutoPruner
from optimum_prune.methods.spp import SPPConfig
from optimum_prune.methods.spp.extract import extract_keep
from optimum_prune.modeling.architectures import get_spec

torch.set_num_threads({threads})
model = tiny_model("llama_gqa")
shape = {{"round_to": 1, "head_dim_multiple": 1}}
path = AutoPruner(model).search_solution_path(SPPConfig(steps=60, **shape), calibration_ids(16, 61, seed=1))
widths = {{}}
for ratio in (0.1, 0.2, 0.3):
    keep, _ = extract_keep(path, model, get_spec(model), SPPConfig(pruning_ratio=ratio, prune_attention=True, **shape))
    widths[ratio] = {{f"{{i}}.{{k}}": len(v) for i, per in keep.items() for k, v in per.items()}}
entry = {{f"{{i}}.{{k}}": st["entry"].tolist() for (i, k), st in path.stats.items()}}
print(json.dumps({{"widths": widths, "entry": entry, "nu": path.meta["nu"]}}))
"""


def test_search_widths_do_not_depend_on_the_thread_count():
    """The search on one and on two threads (separate processes: OpenMP's settings are process-wide) enters every
    unit at the same step and gives the same widths at every ratio. The 61-token windows make the tiny model's
    gradients themselves depend on the thread count (eager attention's softmax backward, rows of 61, rounds by
    thread; measured ~1e-7 relative at the first step): the path must absorb that."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).parents[1])
    out = []
    for threads in (1, 2):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE", "TQDM_DISABLE": "1",
               "PYTHONPATH": os.pathsep.join([str(Path(tests).parent), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        code = _THREADS_SEARCH.format(tests=tests, threads=threads)
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert out[0]["entry"] == out[1]["entry"]
    assert out[0]["widths"] == out[1]["widths"]
    assert any(out[0]["widths"][r] for r in out[0]["widths"])  # something is cut
