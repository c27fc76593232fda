"""FISTA's fast paths give the same pruned weights as the straightforward ones (one dense pass + early-stopped
pruned passes vs a dense and a pruned pass per input group; lazy vs eager eigendecomposition)."""

import pytest
import torch
from testing_utils import calibration_ids, tiny_model

from optimum_prune import FISTAConfig, prune_
from optimum_prune.calibration.stats import CrossGramStats, GramStats
from optimum_prune.methods.fista import FISTAPruner
from optimum_prune.methods.fista.functional import fista_prune, shrink_refit, spectral_gram
from optimum_prune.methods.unstructured import input_groups
from optimum_prune.modeling.access import write_target
from optimum_prune.modeling.architectures import weight_oi


class _ReferencePruner(FISTAPruner):
    """The straightforward path: per input group, the dense copy and the pruned layer each run over every chunk
    (`run.paired_inputs`), and the eigendecomposition is computed up front."""

    def prune_layer(self, run, view, dense):
        cfg, opts = self.config, self.solver_options()
        fitted = []
        for gi, paths in enumerate(input_groups(view.spec).values()):
            targets = [t for t in self.targets if t.path in paths]
            if not targets:
                continue
            n = weight_oi(dense.get_submodule(paths[0])).shape[1]
            G, Gs, C = GramStats(n), GramStats(n), CrossGramStats(n)
            paired = cfg.intra_layer_correction and gi > 0
            xs_all = []
            for x, xs in run.paired_inputs(view.index, paths[0], dense, view.layer if paired else None):
                xs_all.append(xs.float().reshape(-1, n))
                G.update(x.float())
                Gs.update(xs.float())
                C.update(x.float(), xs.float())
            eig = spectral_gram(Gs.gram)
            for t in targets:
                W = (
                    weight_oi(dense.get_submodule(t.path))
                    .detach()
                    .float()[t.rows(dense.get_submodule(t.path).weight.shape[0])]
                )
                W0 = self._warm_start(W, Gs.gram)
                nm = cfg.nm
                if cfg.rounding_score == "wanda":  # |W*_ij| ||X*_j||
                    opts["rounding_scale"] = torch.linalg.vector_norm(torch.cat(xs_all), dim=0)
                W_best, _ = fista_prune(
                    W, G.gram, Gs.gram, C.gram, W0, cfg.sparsity if nm is None else None, nm, eig=eig, **opts
                )
                write_target(view, t, W_best)
                fitted.append((t, W, W_best))
        for t, W, W_best in fitted:  # the layer's re-fit shrunk toward the dense weights, once the layer is done
            write_target(view, t, shrink_refit(W, W_best, cfg.refit_strength))
        return {}


@pytest.mark.parametrize(
    "pattern, ridge, arch, rounding",
    [("unstructured", 0.0, "llama", "magnitude"), ("2:4", 0.0, "llama", "magnitude"), ("2:4", 0.1, "llama", "wanda"),
     ("unstructured", 0.0, "gemma3", "wanda"), ("unstructured", 0.0, "opt", "magnitude")],
)  # fmt: skip
def test_fast_path_equals_reference_path(pattern, ridge, arch, rounding, monkeypatch):
    ids = calibration_ids(4, 16)
    cfg = FISTAConfig(sparsity=0.5, pattern=pattern, K=5, max_outer=6, ridge=ridge, rounding_score=rounding)
    model = tiny_model(arch)
    reference = tiny_model(arch)
    report = prune_(model, cfg, ids)
    monkeypatch.setattr(FISTAPruner, "prune_layer", _ReferencePruner.prune_layer)
    prune_(reference, cfg, ids)
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)  # float32 sums in another order
        assert torch.equal(a == 0, b == 0), name
    rec = report.info["layers"][0]["self_attn.q_proj"]
    assert rec["seconds"] > 0 and rec["stats_seconds"] > 0 and rec["input_group"] == "qkv"
    # the pass's own timing (`SequentialPruner.pass_info`): the sum of this process's per-projection solves
    solves = [r["seconds"] for layer in report.info["layers"].values() for r in layer.values()]
    assert report.info["solve_seconds"] == pytest.approx(sum(solves)) and report.info["solve_seconds"] > 0


@pytest.mark.parametrize("arch, resumed", [("llama", True), ("gemma3", True), ("opt", False)])
def test_reused_passes_change_nothing(arch, resumed, monkeypatch):
    # the next layer's inputs from the dense pass, and down_proj's pruned pass run on the MLP's recorded inputs
    # (not the whole layer again): the same weights, bit for bit, as running everything afresh
    ids = calibration_ids(4, 16)
    cfg = FISTAConfig(sparsity=0.5, K=5, max_outer=6)
    resumes = []
    stats = FISTAPruner._pruned_stats

    def spy(self, run, i, layer, path, dense_x, resume, save):
        resumes.append(resume is not None)
        return stats(self, run, i, layer, path, dense_x, resume, save)

    monkeypatch.setattr(FISTAPruner, "_pruned_stats", spy)
    fast = tiny_model(arch)
    prune_(fast, cfg, ids)
    assert any(resumes) == resumed  # OPT's fc1 / fc2 sit in the decoder layer itself: nothing to resume from
    monkeypatch.setattr(FISTAPruner, "reuse_passes", False)
    monkeypatch.setattr(FISTAPruner, "take_dense_outputs", lambda self: None)
    resumes.clear()
    slow = tiny_model(arch)
    prune_(slow, cfg, ids)
    assert not any(resumes)
    for (name, a), (_, b) in zip(fast.named_parameters(), slow.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("arch, pattern", [("llama", "unstructured"), ("opt", "2:4")])
def test_refit_strength_shrinks_each_layer_toward_its_dense_weights(arch, pattern):
    # every projection is solved as with the full re-fit; once the layer is done its kept weights move toward the
    # dense ones (the layers read dense inputs, so the next layers' fits do not change either)
    ids = calibration_ids(4, 16)
    dense = tiny_model(arch)
    full = tiny_model(arch)
    prune_(full, FISTAConfig(sparsity=0.5, pattern=pattern, K=5, max_outer=6, refit_strength=1.0), ids)
    for strength in (0.0, 0.4):
        model = tiny_model(arch)
        report = prune_(
            model, FISTAConfig(sparsity=0.5, pattern=pattern, K=5, max_outer=6, refit_strength=strength), ids
        )
        assert report.measured == pytest.approx(0.5, abs=1e-3)
        changed = 0
        for (name, d), (_, f), (_, got) in zip(
            dense.named_parameters(), full.named_parameters(), model.named_parameters(), strict=True
        ):
            if torch.equal(d, f):  # not a target
                assert torch.equal(got, d), name
                continue
            changed += 1
            torch.testing.assert_close(got, shrink_refit(d, f, strength), rtol=1e-5, atol=1e-6, msg=name)
            assert torch.equal(got != 0, f != 0), name
        assert changed > 0


def test_paper_preset_is_one_argument_away():
    paper = FISTAConfig.paper(pattern="2:4", eps=1e-2)
    assert (paper.pattern, paper.sparsity, paper.eps) == ("2:4", 0.5, 1e-2)
    assert paper.ridge == 0.0 and paper.inter_layer == "dense" and paper.warm_start == "wanda"
    assert (paper.K, paper.T, paper.lam0, paper.xi) == (20, 3, 1e-5, 0.3)
    assert FISTAConfig.from_dict(paper.to_dict()) == paper
    # the default differs from the paper in the stop rule and the shrunk re-fit (benchmarks/results/unstructured_*)
    assert FISTAConfig().eps == 1e-2 and FISTAConfig.paper().eps == 1e-3
    assert FISTAConfig(eps=1e-3, refit_strength=1.0) == FISTAConfig.paper()
    with pytest.raises(ValueError, match="ridge"):
        FISTAConfig(ridge=-0.1)
    assert paper.refit_strength == 1.0
    with pytest.raises(ValueError, match=r"refit_strength.*\[0, 1\]"):
        FISTAConfig(refit_strength=1.5)
