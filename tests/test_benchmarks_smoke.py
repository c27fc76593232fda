"""Every benchmark script's entry point runs on a tiny random model and a few tokens of the real corpora, and writes a
results JSON that records the evaluation protocol and renders to its markdown: a library change that breaks a
benchmark fails `make test`. Scripts needing an optional dependency (llama.cpp, a GPU) skip, naming it, only when it
is absent."""

import copy
import importlib
import importlib.util
import itertools
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from optimum_prune import SPPConfig

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

TINY_EVAL = ["--eval-tokens", "64", "--eval-seq-len", "32"]


@pytest.fixture(autouse=True)
def _own_timing_lock(tmp_path, monkeypatch):
    """Smoke runs never wait for (or block) a real benchmark holding the machine's timing lock."""
    monkeypatch.setenv("OPTIMUM_PRUNE_TIMING_LOCK", str(tmp_path / "timing.lock"))


TINY_CALIB = ["--num-samples", "2", "--seq-len", "32"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_tokenizer, tiny_llama):
    """The conftest's tiny Llama (SmolLM2 vocabulary) saved with its tokenizer, as `--model` takes it."""
    path = tmp_path_factory.mktemp("bench") / "tiny-llama"
    tiny_llama.save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return path


def _corpora():
    if shutil.which("bible") is None:
        pytest.fail(
            "the third evaluation text needs Debian's bible-kjv: make install installs it (apt-get install bible-kjv)"
        )


NOT_PROTOCOL = (
    "amp_synthetic",
    "cost_model",
    "semi_structured",
    "structured_gpu",
    "scale",
    "np_switch",
)  # no text scored: synthetic data, speed, memory, or other results files read


def _run(script: str, argv: list[str], out: Path) -> dict:
    """Run `script` (from a tree that may have uncommitted changes: `--allow-dirty`) and check its markdown."""
    import render

    module = importlib.import_module(script)
    threads = torch.get_num_threads()
    dirty = [] if script in NOT_PROTOCOL else ["--allow-dirty"]
    try:
        rc = module.main([*argv, *dirty, "--output", str(out)])
    finally:
        torch.set_num_threads(threads)  # scripts may pin their own thread count
    assert rc in (None, 0) or isinstance(rc, dict), f"{script}.main returned {rc}"
    result = json.loads(out.read_text(encoding="utf-8"))
    assert result["renderer"] == script
    assert out.with_suffix(".md").read_text(encoding="utf-8") == render.render(result)
    return result


def _check_protocol(result: dict, split: str = "test", texts=("bbc", "python_docs", "kjv")):
    p = result["protocol"]
    assert p["split"] == split
    assert set(p["eval_texts"]) == set(texts)
    for name in texts:
        sets = p["corpora"][name]
        hashes = {sets[s]["sha256"] for s in ("calibration", "selection", "test")}
        assert len(hashes) == 3, f"{name}: the three document sets must differ"
        assert any(k.startswith(name + "@") and v > 0 for k, v in p["scored_tokens"].items())
    assert p["meets_min_scored_tokens"] is False  # a smoke run scores a few tokens and says so


def test_structured(tiny_dir, tmp_path):
    _corpora()
    argv = ["--model", str(tiny_dir), "--ratios", "0.3", "--calib-batch-size", "2", *TINY_CALIB, *TINY_EVAL]
    argv += ["--speed-repeats", "2", "--speed-warmup", "0", "--prompt-len", "8", "--new-tokens", "2"]
    result = _run("structured", argv, tmp_path / "structured.json")
    _check_protocol(result)
    assert {r["method"] for r in result["runs"]} == {"numerical", "flap", "magnitude"}
    for r in result["runs"]:
        assert set(r["ppl_texts"]) == {"bbc", "python_docs", "kjv"}
        assert len(r["speed"]["prefill_speedup_rounds"]) == 2
        assert r["speed"]["prefill_speedup_verdict"] in ("faster", "slower", "tie")
    assert result["settings"]["method_defaults"] is True
    # --global-allocation: the configuration of the runs made before each method ran at its library defaults
    argv = ["--model", str(tiny_dir), "--ratios", "0.3", "--calib-batch-size", "2", *TINY_CALIB, *TINY_EVAL]
    pinned = _run("structured", [*argv, "--methods", "numerical", "--no-speed", "--global-allocation"],
                  tmp_path / "global.json")  # fmt: skip
    assert pinned["settings"]["method_defaults"] is False
    assert [r["config"]["allocation"] for r in pinned["runs"]] == ["global"]


def test_structured_method_config_and_merge_refusal(tmp_path):
    """Each method at its library defaults (NP's `allocation="auto"`), or with `method_defaults=False` the forced
    per-layer allocation older runs used; `--merge` refuses parts made under the two settings."""
    import structured

    from optimum_prune import FLAPConfig, NumericalConfig

    assert structured.method_config("numerical", 0.2) == NumericalConfig(pruning_ratio=0.2)
    assert structured.method_config("numerical", 0.2, method_defaults=False).allocation == "global"
    assert structured.method_config("flap", 0.3) == FLAPConfig(pruning_ratio=0.3)
    part = {"settings": {"calibration_ids_sha256": "x", "eval_tokens": 8, "method_defaults": True},
            "dense": {"ppl": {"bbc": 1.0}}, "runs": []}  # fmt: skip
    old = {**part, "settings": {**part["settings"], "method_defaults": False}}
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, res in zip(paths, (part, old)):
        path.write_text(json.dumps(res))
    with pytest.raises(SystemExit, match="method_defaults"):
        structured.merge_results(paths, tmp_path / "merged.json")


def test_spp_np_config():
    """spp.py's NP row: NP's library default, or the per-layer allocation of the runs made before `"auto"`."""
    import spp

    from optimum_prune import NumericalConfig

    assert spp.np_config(0.2) == NumericalConfig(pruning_ratio=0.2)
    assert spp.np_config(0.2, global_allocation=True) == NumericalConfig(pruning_ratio=0.2, allocation="global")


def test_harness_split_is_by_document_seeded_and_disjoint():
    import harness

    docs = [f"document {i}" for i in range(103)]
    a, b = harness.split_corpus(docs, seed=0), harness.split_corpus(docs, seed=0)
    assert a == b
    assert harness.split_corpus(docs, seed=1) != a
    sets = [set(a[s]) for s in harness.SPLITS]
    assert sum(map(len, sets)) == len(docs) and set().union(*sets) == set(docs)
    assert [len(x) for x in sets] == [52, 26, 25]
    assert harness.documents_hash(a["test"]) != harness.documents_hash(a["selection"])
    with pytest.raises(ValueError, match="'selection' .* or 'test'"):
        harness.Protocol(split="calibration")


def test_harness_spread_and_tie():
    import harness

    s = harness.spread([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (s["median"], s["q1"], s["q3"], s["iqr"]) == (3.0, 2.0, 4.0, 2.0)
    assert harness.speed_verdict([1.3, 1.25, 1.35, 1.4]) == "faster"
    assert harness.speed_verdict([0.8, 0.85, 0.9]) == "slower"
    assert harness.speed_verdict([0.9, 1.2, 1.0, 1.1, 0.95]) == "tie"  # a median of 1.0x inside its spread
    r = harness.round_ratios([10.0, 10.0, 10.0, 10.0], [5.0, 12.5, 8.0, 10.0], "x")
    assert r["x_rounds"] == [2.0, 0.8, 1.25, 1.0] and r["x_verdict"] == "tie"
    assert harness.round_ratios([10.0, 10.0, 10.0], [5.0, 5.0, 4.0], "x")["x_verdict"] == "faster"


def test_protocol_runs_refuse_a_dirty_tree_and_say_when_allowed(monkeypatch, tmp_path):
    import harness

    dirty = {"commit": "abc1234def", "dirty": True, "dirty_paths": ["optimum_prune/x.py"]}
    monkeypatch.setattr(harness, "tree_state", lambda: dirty)
    args = harness.add_protocol_args(__import__("argparse").ArgumentParser()).parse_args(["--split", "selection"])
    with pytest.raises(harness.DirtyTreeError, match=r"optimum_prune/x\.py.*git commit.*git stash -u.*--allow-dirty"):
        harness.Protocol.from_args(args)
    args.allow_dirty = True
    harness.Protocol.from_args(args)  # runs, and the results say so:
    res = {**harness.environment([], "x.py"), "protocol": harness.Protocol(split="test").record(None), "renderer": "x"}
    assert res["versions"]["tree_dirty"] is True and res["date"].endswith("+00:00")
    line = harness.protocol_line(res)
    assert "commit abc1234def" in line and "uncommitted changes (`--allow-dirty`): not a protocol result" in line
    monkeypatch.setattr(harness, "tree_state", lambda: {**dirty, "dirty": False, "dirty_paths": []})
    harness.Protocol.from_args(args)
    clean = {**harness.environment([], "x.py"), "protocol": res["protocol"]}
    assert "not a protocol result" not in harness.protocol_line(clean)
    with pytest.raises(ValueError, match="UTC date, commit and tree state"):
        harness.write_results({"renderer": "x"}, tmp_path / "x.json")


def test_interval_cells_pair_only_the_same_documents():
    import harness

    docs = {"units": [0, 1, 2, 3], "nll": [300.0, 330.0, 290.0, 310.0], "tokens": [100, 100, 100, 100]}
    worse = {**docs, "nll": [x + 100 * 0.0198 for x in docs["nll"]]}  # +2% on every document
    assert harness.delta_cell(1.0, 1.0, worse, docs).endswith("[+2.0, +2.0] worse")
    assert harness.delta_cell(1.0, 1.0, docs, worse).endswith("better")
    other = {**docs, "units": [0, 1, 2, 4]}  # another document set: no paired interval
    assert harness.delta_cell(1.02, 1.0, worse, other) == "+2.0%"
    assert harness.ppl_cell(20.0) == "20.00" and harness.ppl_cell(None) == "–"
    low, high = (float(x) for x in harness.ppl_cell(21.65, docs).split("[")[1].rstrip("]").split(", "))
    assert 18.1 < low < 21.65 < high < 27.2  # exp(mean NLL 3.075), inside exp(2.9) ... exp(3.3) of the documents


@pytest.mark.skipif(not torch.cuda.is_available(), reason="2:4 sparse kernels need an NVIDIA GPU (none here)")
def test_semi_structured(tmp_path):
    argv = ["--shape", "tiny", "--tokens", "16", "--profile-tokens", "16", "--dtypes", "float16"]
    result = _run("semi_structured", [*argv, "--prefill", "16x1", "--rounds", "2"], tmp_path / "semi.json")
    (row,) = [r for r in result["layers"] if r["projection"] == "gate_proj"]
    assert row["variants"]["dense"]["graph_us"] > 0
    assert result["models"][0]["scenarios"][0]["models"]["dense"]["median_ms"] > 0


def test_semi_structured_tables():
    """The 2:4 tables from a results file of the shape a GPU run writes (this machine has no GPU to write one)."""
    import render

    timing = {"eager_us": 40.0, "graph_us": 10.0}
    row = {"shape": "llama-3.1-8b", "projection": "gate_proj", "out": 14336, "in": 4096, "tokens": 16,
           "dtype": "float16", "calls": 10, "variants": {
               "dense": timing, "cuSPARSELt": {"eager_us": 400.0, "graph_us": 8.0},
               "cuSPARSELt, raw op": {"eager_us": 200.0, "graph_us": 8.0, "alg_id": 0},
               "cuSPARSELt, searched": {"eager_us": 200.0, "graph_us": 5.0, "alg_id": 3},
               "CUTLASS": {"error": "RuntimeError: no kernel"}}}  # fmt: skip
    profile = {"shape": "llama-3.1-8b", "tokens": 16, "dtype": "float16", "variant": "cuSPARSELt",
               "host_us_per_call": 380.0, "device_us_per_call": 8.5,
               "kernels": {"sm90_sparse_gemm": {"us_per_call": 8.0, "launches_per_call": 1.0}}}  # fmt: skip
    speed = {"ms": [2.0, 2.0], "median_ms": 2.0, "speedup_spread": {"n": 2, "median": 0.5, "q1": 0.4, "q3": 0.6},
             "ideal": 1.6}  # fmt: skip
    model = {"shape": "llama-3.1-8b", "dtype": "float16",
             "models": {"2:4 cuSPARSELt": {"converted": 224, "max_abs_logit_diff": 0.01},
                        "2:4 CUTLASS": {"error": "RuntimeError: no kernel"}},
             "scenarios": [{"name": "prefill 512 x 1, CUDA graph", "rounds": 2,
                            "models": {"dense": {"median_ms": 1.0}, "2:4 cuSPARSELt": speed}},
                           {"name": "prefill 512 x 1, eager", "skipped": "time budget spent"}]}  # fmt: skip
    result = {"renderer": "semi_structured", "gpu": "GPU", "torch": "2.x", "date": "today", "cusparselt_version": 1,
              "budget_s": 10, "elapsed_s": 9, "layers": [row], "kernels": [profile], "models": [model], "skipped": []}  # fmt: skip
    md = render.render(result)
    assert "| llama-3.1-8b | gate_proj (14336 x 4096) | 16 | float16 | 10.0 / 40.0 | 1.25x / 0.10x |" in md
    assert "| 2.00x / 0.20x (alg 3) | failed |" in md
    assert "`sm90_sparse_gemm` 8.0 (1)" in md
    assert "| prefill 512 x 1, CUDA graph (2 rounds) | 1.00 | 0.50x [0.40, 0.60] / 1.60x (31%) |" in md
    assert "2:4 CUTLASS: RuntimeError: no kernel" in md


def test_amp_synthetic(tmp_path):
    argv = ["--d", "8", "--n", "6", "--k", "2", "--steps", "3", "--seeds", "0", "--scales", "1/sqrt(d)"]
    result = _run("amp_synthetic", argv, tmp_path / "amp_synthetic.json")
    b = result["scales"]["1/sqrt(d)"]["baselines"]
    assert 0 < b["wanda_fused"] < 10 and 0 < b["sparsegpt_fused"] < 10


def test_amp_regimes(tiny_dir, tmp_path):
    argv = ["--model", str(tiny_dir), "--layers", "1", *TINY_CALIB, "--cg-steps", "2", "--refit-steps", "3"]
    result = _run("amp_regimes", argv, tmp_path / "amp_regimes.json")
    assert result["protocol"]["calibration"][0]["corpus"] == "bbc"
    rec = result["layers"]["1"]
    assert rec["baselines"]["wanda"] > 0 and rec["scales"]["curvature_max"] > 0
    assert len(rec["cg"]) == 12 and all(r["|M∘W|·‖X‖ row"] > 0 for r in rec["cg"].values())
    assert all(r["after"] <= r["before"] for r in rec["refit"].values())


def test_fista_calibration_size(tiny_dir, tmp_path):
    argv = ["--model", str(tiny_dir), "--sizes", "2x16,4x16", "--eps", "1e-3", "--layer", "1", "--held-out", "2x16"]
    result = _run("fista_calibration_size", argv, tmp_path / "fista_size.json")
    assert result["protocol"]["split"] == "selection"
    assert set(result["runs"]) == {"q_proj", "gate_proj", "down_proj"}
    run = result["runs"]["q_proj"]["4x16 eps=0.001"]
    assert run["outer_steps"] >= 1 and run["calibration_error"][-1] <= run["calibration_error"][0]


def test_fista_generalization(tiny_dir, tmp_path):
    _corpora()
    argv = ["--model", str(tiny_dir), "--layers", "1", "--num-samples", "2", "--seq-len", "16", "--eval-samples", "2"]
    argv += ["--variants", "paper"]
    result = _run("fista_generalization", argv, tmp_path / "fista_gen.json")
    run = result["runs"]["q_proj L1|2:4"]
    assert set(run["errors"]["FISTA paper"]) == {"calibration", "held-out BBC", "OOD", "OOD prose"}


def test_np_allocation(tiny_dir, tmp_path):
    _corpora()
    argv = ["--model", str(tiny_dir), "--variants", "flap", "flap_bias", "np_paper", "np_unit_owl", "--ratios", "0.3"]
    argv += [*TINY_CALIB, *TINY_EVAL, "--stats-cache", str(tmp_path / "stats")]
    result = _run("np_allocation", argv, tmp_path / "np.json")
    _check_protocol(result, split="selection")
    assert {r["variant"] for r in result["runs"]} == {"flap", "flap_bias", "np_paper", "np_unit_owl"}
    assert next(r for r in result["runs"] if r["variant"] == "flap_bias")["config"]["bias_compensation"] is True
    assert all(r["bbc"] > 0 and r["pydocs"] > 0 and r["kjv"] > 0 for r in result["runs"])


SWITCH_GRIDS = {  # the committed selection-split grids each allocation's light-ratio switch was placed by
    "global": ["np_light_grid_smollm2_selection.json:np_fluct_bias_s0.5:np_unit",
               "np_light_grid_gemma3_selection.json:np_fluct_s0.5:np_unit"],
    "servable": ["np_light_grid_smollm2_servable_selection.json:np_servable_fluct:np_servable_num"],
}  # fmt: skip


@pytest.mark.parametrize("allocation", sorted(SWITCH_GRIDS))
def test_np_switch(allocation, tmp_path):
    """`np_switch.py` on the committed grids: the library's light ratio for each allocation is the first grid ratio at
    which the light rule is worse (pooled over the models), so moving `LIGHT_RATIOS` without a new grid fails here."""
    import np_switch

    from optimum_prune.methods.numerical.config import LIGHT_RATIOS

    grids = [str(BENCH / "results" / g) for g in SWITCH_GRIDS[allocation]]
    argv = ["--allocation", allocation, *(a for g in grids for a in ("--grid", g))]
    result = _run("np_switch", argv, tmp_path / "switch.json")
    rows, first = np_switch.table(result)
    assert first == LIGHT_RATIOS[allocation] and len(rows) >= 5
    assert all(cells[-1].verdict != "worse" for ratio, cells in rows if ratio < first)  # a tie keeps the light rule


def test_structured_gpu(tmp_path):
    """The GPU plan on the tiny shape, on the CPU (every row eager): NP, servable and uniform shapes against dense, each
    speedup beside its ideal; a spent time budget stops cleanly, with the results file written."""
    argv = ["--device", "cpu", "--tiny", "--rounds", "2", "--dtype", "float32", "--ratios", "0.5"]
    result = _run("structured_gpu", argv, tmp_path / "gpu.json")
    (group,) = result["groups"]
    assert set(group["models"]) == {"dense", "NP 50%", "servable 50%", "uniform 50%"}
    assert group["models"]["NP 50%"]["removed"] == pytest.approx(0.5, abs=0.02)
    assert group["models"]["servable 50%"]["removed"] == pytest.approx(0.5, abs=0.02)
    assert [(s["kind"], s["mode"]) for s in group["scenarios"]] == [("prefill", "eager"), ("decode", "eager")]
    for sc in group["scenarios"]:
        for label in ("NP 50%", "servable 50%", "uniform 50%"):
            entry = sc["models"][label]
            assert len(entry["speedup_rounds"]) == 2 and entry["ideal"] > 1.3
    assert "| prefill 8 x 1, eager (2 rounds) |" in (tmp_path / "gpu.md").read_text()
    spent = _run("structured_gpu", [*argv, "--budget-s", "0"], tmp_path / "spent.json")
    assert spent["groups"] == [] and spent["skipped"] == ["tiny, 50% (round_to 8)"]


def test_alignment(tiny_dir, tmp_path):
    _corpora()
    argv = ["--model", str(tiny_dir), "--methods", "magnitude", "flap", "--round-to", "1", "8", *TINY_CALIB]
    argv += [*TINY_EVAL, "--repeats", "2", "--prompt-len", "8", "--speed-all", "flap", "--workdir", str(tmp_path)]
    result = _run("alignment", argv, tmp_path / "alignment.json")
    _check_protocol(result)
    assert len(result["runs"]) == 4
    flap = [r for r in result["runs"] if r["method"] == "flap"]
    assert all(len(r["torch_prefill_speedup_rounds"]) == 2 for r in flap)
    assert {r["ppl_kjv"] > 0 for r in result["runs"]} == {True}
    if importlib.util.find_spec("llama_cpp") is None:
        assert "llama.cpp speed not measured" in result["partial"]


def test_deploy(tiny_dir, tmp_path):
    pytest.importorskip(
        "llama_cpp", reason="deploy.py runs the exported GGUF files in llama.cpp (the `llamacpp` extra)"
    )
    _corpora()
    argv = ["--model", str(tiny_dir), "--ratios", "0.3", "--allocations", "global", *TINY_CALIB, *TINY_EVAL]
    argv += ["--repeats", "1", "--prompt-len", "8", "--new-tokens", "2", "--workdir", str(tmp_path)]
    result = _run("deploy", argv, tmp_path / "deploy.json")
    _check_protocol(result)
    assert set(result["models"]) == {"dense", "NP 30% per-layer"}


def test_spp(tiny_dir, tmp_path):
    _corpora()
    argv = ["--model", str(tiny_dir), "--ratios", "0.3", "--num-samples", "2", "--calib-seq-len", "32", *TINY_EVAL]
    argv += ["--search-steps", "10", "--search-lr", "0.08", "--search-lambda", "0.7", "--spp-round-to", "1"]
    argv += ["--search-samples", "4", "--search-seq-len", "32", "--search-batch-size", "2"]
    argv += ["--head-dim-multiple", "1", "--ria-search-steps", "10", "--lora-steps", "1", "--lora-batch-size", "1"]
    argv += ["--lora-seq-len", "16", "--speed-repeats", "1", "--ablation-ratios", "0.3"]
    base = list(argv)
    argv += [
        "--workdir",
        str(tmp_path),
        "--phases",
        "quality",
        "recovery",
        "unstructured",
        "ablation",
        "speed",
        "--extra-spp-rows",
        "spp_bias_s0.5",
        "spp_full_refit",
        "spp_former_default",
    ]
    result = _run("spp", argv, tmp_path / "spp.json")
    _check_protocol(result)
    default, former = result["rows"]["spp@0.3"], result["rows"]["spp_former_default@0.3"]
    assert (default["config"]["prune_attention"], default["config"]["channel_order"]) == (False, "np")
    assert default["kept"]["attention"] == 1.0 and former["kept"]["attention"] < 1.0  # the former cut every kind
    assert (former["config"]["channel_order"], former["config"]["compensation_strength"]) == ("path", 0.5)
    assert result["rows"]["spp_bias_s0.5@0.3"]["config"]["compensation_strength"] == 0.5
    full = result["rows"]["spp_full_refit@0.3"]["config"]
    assert full["compensation_strength"] == 1.0 and full["compensation_bias"] is False
    assert {"prune_norefit_s", "refit_s", "kept"} <= set(result["rows"]["spp@0.3"])  # extraction cost, widths
    assert set(result["rows"]) == {
        "spp@0.3",
        "np@0.3",
        "flap@0.3",
        "spp_random@0.3",
        "spp_bias_s0.5@0.3",
        "spp_full_refit@0.3",
        "spp_former_default@0.3",
    } | ({"spp_norefit@0.3"} if SPPConfig().compensate else {"spp_refit@0.3"})
    assert all(set(r["lora"]) >= {"bbc", "python", "kjv"} for r in result["rows"].values())
    assert set(result["unstructured"]) == {"spp_ria", "ria", "wanda"}
    assert "random@0.3" in result["ablation"] and "0.3" in result["speed"]
    # a screen of a search setting: its own path, only the SPP row; searched on the calibration ids (2 x 32) cut into
    # windows of 16 tokens; compared with the first run's SPP and NP rows (`--reference`)
    screen = _run("spp", [*base, "--workdir", str(tmp_path / "nu"), "--phases", "quality", "--rows", "spp",
                          "--search-nu-scale", "2", "--search-labels", "layers", "--search-view", "--search-window",
                          "16", "--reference", str(tmp_path / "spp.json")], tmp_path / "nu.json")  # fmt: skip
    assert set(screen["rows"]) == {"spp@0.3"} and screen["search"]["settings"]["nu_scale"] == 2.0
    assert screen["search"]["settings"]["search_labels"] == "layers"
    assert set(screen["reference"]["rows"]) == {"spp@0.3", "np@0.3"} and screen["reference"]["file"] == "spp.json"
    report = (tmp_path / "nu.md").read_text(encoding="utf-8")
    assert "| 0.3 | SPP (reference) |" in report and "| 0.3 | NP (reference) |" in report
    assert screen["search"]["windows"] == [4, 16] and screen["search"]["calibration"] == [2, 32]
    assert set(screen["rows"]["spp@0.3"]["kept"]) == {"attention", "mlp"}
    # the MLP-only extractions and the diagnostic (the path's order at NP's per-layer widths) from the first path
    # NP at its former default allocation (`--global-allocation`: how the runs before "auto" were made)
    # (and a reference with SPP rows only: its SPP against this run's NP, per text and in geometric mean)
    pinned = _run("spp", [*base, "--workdir", str(tmp_path / "global"), "--phases", "quality", "--rows", "np",
                          "--global-allocation", "--reference", str(tmp_path / "nu.json")], tmp_path / "global.json")  # fmt: skip
    assert pinned["rows"]["np@0.3"]["config"]["allocation"] == "global" and pinned["args"]["global_allocation"]
    report = (tmp_path / "global.md").read_text(encoding="utf-8")
    assert 'allocation="global"' in report
    ref_rows = [line.split(" | ") for line in report.splitlines() if line.startswith("| 0.3 | SPP (reference) |")]
    assert len(ref_rows) == 2 and all("%" in cells[-1] for cells in ref_rows)  # per text (its last Δ), geomean
    mlp = _run("spp", [*base, "--workdir", str(tmp_path), "--phases", "quality", "--rows", "np", "spp", "spp_mlp",
                       "spp_mlp_refit", "spp_np_widths", "--extra-spp-rows", "spp_mlp", "spp_mlp_refit"],
               tmp_path / "mlp.json")  # fmt: skip
    rows = mlp["rows"]
    assert set(rows) == {"np@0.3", "spp@0.3", "spp_mlp@0.3", "spp_mlp_refit@0.3", "spp_np_widths@0.3"}
    # the default: the widths of the path's MLP-only cut (NP's channels within them)
    assert rows["spp@0.3"]["layers"] == rows["spp_mlp_refit@0.3"]["layers"]
    assert rows["spp_np_widths@0.3"]["config"]["channel_order"] == "path"
    assert all(rows[k]["kept"]["attention"] == 1.0 for k in rows if k.startswith("spp"))  # attention kept whole
    assert rows["spp_mlp_refit@0.3"]["config"]["compensation_bias"] is False
    from optimum_prune import AutoPrunedModelForCausalLM

    ref = AutoPrunedModelForCausalLM.from_pretrained(tmp_path / "models" / "np@0.3")
    widths = [layer.mlp.down_proj.in_features for layer in ref.model.layers]
    dense_width = json.loads((tiny_dir / "config.json").read_text())["intermediate_size"]
    assert [w[2] for w in rows["spp_np_widths@0.3"]["layers"]] == widths and min(widths) < dense_width


def test_unstructured(tiny_dir, tmp_path):
    _corpora()
    argv = ["--model", str(tiny_dir), *TINY_CALIB, "--calib-batch-size", "2", *TINY_EVAL]
    argv += ["--methods", "wanda,fista", "--patterns", "2:4", "--fista-opt", "K=5"]
    argv += ["--sweep", "0.3", "--sweep-methods", "wanda", "--weights-dir", str(tmp_path / "w")]
    result = _run("unstructured", argv, tmp_path / "unstructured.json")
    _check_protocol(result)
    assert result["status"] == "complete" and len(result["runs"]) == 3  # wanda, fista at 2:4; wanda at 30%
    assert all(
        r["ppl"] == r["ppl_texts"]["bbc"] and r["ppl_ood"] == r["ppl_texts"]["python_docs"] for r in result["runs"]
    )
    # without SparseGPT in the run, the Δ columns and the selection criterion compare with FISTA's default
    md = (tmp_path / "unstructured.md").read_text(encoding="utf-8")
    assert "Δ vs FISTA (default) [95%]" in md and "| 2:4 | Wanda | " in md.split("(the selection criterion)")[1]
    # scoring again from the saved weights gives the same perplexities
    again = _run("unstructured", [*argv, "--from-weights"], tmp_path / "again.json")
    assert [r["ppl"] for r in again["runs"]] == [r["ppl"] for r in result["runs"]]


def test_attention(tiny_dir, tmp_path):
    _corpora()
    argv = ["--model", str(tiny_dir), *TINY_CALIB, *TINY_EVAL, "--steps", "2", "--attn", "wanda,amp"]
    argv += ["--mlp", "dense,wanda", "--error-layers", "1", "--rhos", "0.5", "--cache-dir", str(tmp_path / "c")]
    result = _run("attention", argv, tmp_path / "attention.json")
    _check_protocol(result)
    assert set(result["rows"]) == {"wanda|dense", "amp|dense", "wanda|wanda", "amp|wanda"}
    assert all(r["ppl_kjv"] > 0 for r in result["rows"].values())
    speed = _run(
        "attention", [*argv, "--speed", "--speed-layers", "1", "--speed-steps", "1"], tmp_path / "attention.json"
    )
    assert speed["speed"] and speed["rows"] == result["rows"]
    argv = [*argv[: argv.index("--attn")], "--attn", "amp_model", "--mlp", "wanda_rest_pass", "--error-layers", ""]
    argv += ["--cache-dir", str(tmp_path / "c"), "--resume"]
    recipe = _run("attention", argv, tmp_path / "attention.json")["rows"]["amp_model|wanda_rest_pass"]
    assert all("rel_attention_error_model_refit" in e for e in recipe["amp_layers"].values())
    again = _run("attention", argv[:-1], tmp_path / "again.json")["rows"]["amp_model|wanda_rest_pass"]
    assert again["amp_layers"] == recipe["amp_layers"] and again["ppl_bbc"] == recipe["ppl_bbc"]  # from the cache


def test_recovery(tiny_dir, tmp_path):
    _corpora()
    pytest.importorskip("lm_eval", reason="recovery.py scores the BBC topic task with lm-eval (the `eval` extra)")
    argv = ["--model", str(tiny_dir), "--methods", "np30", "flap30", "fista24", "--num-samples", "2"]
    argv += ["--calib-seq-len", "32"]
    argv += ["--fista-max-outer", "1", "--steps", "1", "--batch-size", "1", "--seq-len", "16", "--lora-r", "2"]
    argv += [*TINY_EVAL, "--zero-shot-limit", "2"]
    import recovery

    assert "np30_global" not in recovery.DEFAULT_METHODS  # NP's default of 26 Nov, only on request
    assert recovery.METHODS["np30_global"][1](None).allocation == "global"
    result = _run("recovery", argv, tmp_path / "recovery.json")
    _check_protocol(result)
    assert result["status"] == "Complete."
    for row in result["rows"].values():
        assert {"pruned", "lora", "lora_kd"} <= set(row)
        assert row["lora"]["ppl_kjv"] > 0 and row["lora"]["bbc_topic_n"] == 2
    # the report's paired comparisons: distillation against LoRA alone, NP against FLAP at each recovery
    report = (tmp_path / "recovery.md").read_text(encoding="utf-8")
    kd = report.split("LoRA + KD against LoRA alone")[1].split("\n\n")[1].splitlines()
    assert "Δ vs LoRA [95%]" in kd[0] and [r.split(" | ")[1] for r in kd[2:]] == ["LoRA + KD"] * 3
    vs_flap = report.split("against FLAP 30% after the same recovery")[1].split("\n\n")[1].splitlines()
    assert [r.split(" | ")[1] for r in vs_flap[2:]] == ["none", "LoRA", "LoRA + KD"]
    assert all(r.startswith("| Numerical Pruning 30% |") and "%" in r.split(" | ")[3] for r in vs_flap[2:])


def test_scale(tiny_dir, tmp_path):
    runs = ["acct-mem-wanda", "acct-wanda", "acct-numerical"]
    argv = ["--model", str(tiny_dir), "--runs", *runs, "--work-dir", str(tmp_path), "--nice", "0"]
    result = _run("scale", argv, tmp_path / "scale.json")
    assert result["protocol"]["calibration"][0]["corpus"] == "bbc"
    for name in runs:
        r = result["runs"][name]
        assert r["vmhwm"] >= r["peak_sampled"]["RssAnon"] > 0 and r["seconds"]["prune"] > 0 and 0 < r["measured"] < 1
        assert "VmSwap" in r["peak_sampled"] and set(r["machine_swap_used"]) == {"start", "peak"}
    np_passes = result["runs"]["acct-numerical"]["progress"]["passes"]
    assert [p["blocks"] for p in np_passes[:2]] == [2, 2]  # scored, then refitted and written, block by block
    assert result["runs"]["acct-wanda"]["digest"] == result["runs"]["acct-mem-wanda"]["digest"]  # identical
    # a run that never finished is recorded from its log and the parent's samples of /proc
    shutil.copytree(tiny_dir, tmp_path / "acct")  # where the run's model would be: a salvage leaves it there
    again = ["--runs", "acct-numerical", "--work-dir", str(tmp_path), "--salvage"]
    salvaged = _run("scale", again, tmp_path / "salvaged.json")
    assert (tmp_path / "acct" / "config.json").is_file()
    run, done = salvaged["runs"]["acct-numerical"], result["runs"]["acct-numerical"]
    assert run["partial"] and run["samples"]["count"] >= 1 and run["vmhwm"] > 0
    assert [(b["pass"], b["block"]) for b in run["progress"]["blocks"]] == [
        (b["pass"], b["block"]) for b in done["progress"]["blocks"]
    ]


@pytest.fixture(scope="module")
def tiny_vision(tmp_path_factory):
    """A tiny random DINOv2 classifier (5 labels, 16 px) and 120 random 16 px images, as vision.py takes them."""
    import numpy as np
    from testing_utils import tiny_model

    root = tmp_path_factory.mktemp("vision")
    tiny_model("dinov2").save_pretrained(root / "model")
    gen = np.random.default_rng(0)
    images = gen.integers(0, 256, size=(120, 16, 16, 3), dtype=np.uint8)
    np.savez(root / "images.npz", images=images, labels=gen.integers(0, 5, size=120))
    return root


def test_vision(tiny_vision, tmp_path):
    argv = ["--model", str(tiny_vision / "model"), "--images", str(tiny_vision / "images.npz"), "--size", "16"]
    argv += ["--methods", "magnitude", "flap", "spp", "spp_norefit", "--ratios", "0.3", "--calibration", "4"]
    argv += ["--test", "8"]
    argv += ["--spp-steps", "40", "--spp-batch", "2", "--spp-images", "6"]  # the search: the whole calibration split
    argv += ["--ft-images", "4", "--ft-steps", "1", "--ft-batch", "2", "--cache-dir", str(tmp_path / "cache")]
    out = tmp_path / "vision.json"
    result = _run("vision", [*argv, "--ft-lr", "1e-5", "1e-3"], out)
    assert set(result["runs"]) == {"dense", "magnitude_0.3", "flap_0.3", "spp_0.3", "spp_norefit_0.3"}
    assert result["spp_search"]["steps"] == 40 and result["runs"]["spp_0.3"]["extract_s"] >= 0
    assert "on 6 calibration images" in out.with_suffix(".md").read_text()
    # an extraction variant: the same path and widths, without the refit of the output projections
    assert result["runs"]["spp_norefit_0.3"]["layers"] == result["runs"]["spp_0.3"]["layers"]
    run = result["runs"]["flap_0.3"]  # a rate sweep: one fine-tune of the same pruned model per rate
    assert set(run["accuracy_after_ft_by_lr"]) == {"1e-05", "0.001"}
    assert run["accuracy_after_ft"] == run["accuracy_after_ft_by_lr"]["1e-05"]
    assert "after FT (lr 0.001)" in out.with_suffix(".md").read_text()
    # the search on the KL divergence from the dense classifier: its own path
    dense = _run("vision", [*argv, "--methods", "spp", "--spp-search-labels", "dense"], tmp_path / "dense.json")
    assert dense["spp_search"]["settings"]["search_labels"] == "dense"
    assert "KL divergence from the dense classifier" in (tmp_path / "dense.md").read_text()
    assert result["vision_protocol"]["split"] == "test"
    assert {k: v["images"] for k, v in result["vision_protocol"]["sets"].items()} == {
        "test": 24,
        "calibration": 6,
        "train": 78,
        "selection": 12,
    }
    timed = _run("vision", [*argv, "--timing", "--timing-batch", "2", "--repeats", "2"], out)
    assert set(timed["timing"]["speedup"]) == {"dense", "magnitude_0.3", "flap_0.3", "spp_0.3", "spp_norefit_0.3"}


def test_spp_seeds(tiny_dir, tmp_path):
    """Two draws: one searched here, one from a saved path, compared with a copy of itself (the thread check); both
    splits written, every row paired with NP's on the same draw."""
    _corpora()
    argv = ["--model", str(tiny_dir), "--ratios", "0.3", "--num-samples", "4", "--seq-len", "32", *TINY_EVAL,
            "--search-steps", "10", "--search-lr", "0.08", "--search-lambda", "0.7", "--search-batch-size", "2",
            "--spp-round-to", "1", "--head-dim-multiple", "1", "--splits", "selection", "test",
            "--workdir", str(tmp_path / "work")]  # fmt: skip
    first = _run("spp_seeds", [*argv, "--calib-seeds", "0"], tmp_path / "seeds.json")
    saved = tmp_path / "work" / "path_seed0"
    shutil.copytree(saved, tmp_path / "copy")
    result = _run("spp_seeds", [*argv, "--calib-seeds", "0", "1", "--paths", f"0={saved}", "--thread-paths",
                                f"0={tmp_path / 'copy'}"], tmp_path / "seeds.json")  # fmt: skip
    _check_protocol(result)
    assert set(result["rows"]) == {f"{m}@0.3@seed{s}" for m in ("spp", "np") for s in (0, 1)}
    assert first["rows"]["spp@0.3@seed0"]["ppl"] == result["rows"]["spp@0.3@seed0"]["ppl"]  # resumed, not redone
    assert result["paths"]["0"]["calibration_sha256"] != result["paths"]["1"]["calibration_sha256"]
    t = result["threads"]["0"]
    assert t["tensors_differ"] == [] and t["entry_steps_differ"] == 0 and all(t["widths_identical"].values())
    selection = json.loads((tmp_path / "seeds_selection.json").read_text(encoding="utf-8"))
    _check_protocol(selection, split="selection")
    assert set(selection["rows"]) == set(result["rows"])
    report = (tmp_path / "seeds.md").read_text(encoding="utf-8")
    assert "| 0.3 | SPP (default) | 1 |" in report and "Δ geometric mean" in report and "Screen:" not in report
    # a screened extraction: its rows beside the default's, the screen table, its label kept by a later plain run
    screened = _run("spp_seeds", [*argv, "--calib-seeds", "0", "1", "--paths", f"0={saved}", "--variants", "spp",
                                  "spp_s0.5"], tmp_path / "seeds.json")  # fmt: skip
    assert screened["rows"]["spp_s0.5@0.3@seed1"]["config"]["compensation_strength"] == 0.5
    plain = _run("spp_seeds", [*argv, "--calib-seeds", "0", "--paths", f"0={saved}"], tmp_path / "seeds.json")
    assert plain["protocol"] == screened["protocol"]  # it scored nothing: the texts' record and both draws kept
    assert len(plain["protocol"]["calibration"]) == 2
    report = (tmp_path / "seeds.md").read_text(encoding="utf-8")
    assert "Screen: over the 2 (ratio, draw) cells" in report and "| SPP, refit at half strength | " in report


def test_every_script_has_a_smoke_test():
    scripts = {p.stem for p in BENCH.glob("*.py") if not p.name.startswith("_")} - {"harness", "render"}
    missing = sorted(s for s in scripts if f"test_{s}" not in globals())
    assert not missing, f"benchmark scripts without a smoke test here: {missing}"


def test_moe(tiny_dir, tmp_path):
    """The test bed (the tiny Llama as a Mixtral of 8 experts) is built, saved, reloaded, and pruned by every row."""
    _corpora()
    argv = ["--model", str(tiny_dir), "--testbed", str(tmp_path / "testbed"), *TINY_CALIB, *TINY_EVAL,
            "--router-steps", "3", "--router-mse-steps", "2", "--rows", "reap", "random", "channels", "mixed",
            "--ratios", "0.5", "--round-to", "4"]  # fmt: skip
    gguf = importlib.util.find_spec("llama_cpp") is not None  # the llama.cpp check runs where it is installed
    if gguf:
        argv += ["--gguf", "reap", "--gguf-dir", str(tmp_path / "gguf")]
    result = _run("moe", argv, tmp_path / "moe.json")
    _check_protocol(result)
    assert (tmp_path / "testbed" / "config.json").is_file()
    assert result["testbed"]["all_experts_max_logit_gap"] < 1e-3
    names = [(r["name"], r["ratio"]) for r in result["rows"]]
    assert names == [("dense", None), ("moe", None)] + [(n, 0.5) for n in ("reap", "random", "channels", "mixed")]
    full = result["rows"][1]["expert_params"]
    for r in result["rows"][2:]:
        assert abs(1 - r["expert_params"] / full - 0.5) < 0.1, r["name"]  # the mixed row's widths are rounded
    if gguf:
        reap = result["rows"][2]["llama_cpp"]
        assert reap["arch"] == "llama" and all(abs(reap[t] / result["rows"][2]["ppl"][t] - 1) < 1e-3 for t in reap
                                               if t in result["rows"][2]["ppl"])  # fmt: skip


def test_moe_testbed_router_targets():
    """The router's targets: the exhaustive search finds a planted set, and the greedy search used where the sets are
    too many to try (16 experts, top-8) finds almost all of them and stays near the exhaustive optimum."""
    import _moe_testbed as bed

    g = torch.Generator().manual_seed(0)
    f = torch.randn(300, 8, 12, generator=g)
    planted = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(300)])  # (N, 4)
    y = f.gather(1, planted[..., None].expand(-1, -1, 12)).sum(1)
    assert torch.equal(bed._best_sets(f, y, 4).sort(-1).values, planted.sort(-1).values)
    hits = (bed._greedy_sets(f, y, 4).sort(-1).values == planted.sort(-1).values).all(-1).float().mean()
    assert hits > 0.9  # a local search: it misses a few

    noisy = y + 0.5 * torch.randn(y.shape, generator=g)

    def err(sets):
        return (noisy - f.gather(1, sets[..., None].expand(-1, -1, 12)).sum(1)).pow(2).sum(-1).mean()

    exact, greedy = bed._best_sets(f, noisy, 4), bed._greedy_sets(f, noisy, 4)
    assert err(exact) <= err(greedy) < 1.25 * err(exact)  # random 12-dim outputs: a local optimum 14% above
    assert err(greedy) < 0.9 * err(bed._greedy_sets(f, noisy, 4, swaps=0))  # the swaps improve the greedy choice
    assert all(len(set(row.tolist())) == 4 for row in greedy)
    wide = torch.randn(50, 16, 12, generator=g)
    target = wide[:, :8].sum(1)  # C(16, 8) = 12,870 sets: above `exhaustive`, the greedy search answers
    assert torch.equal(bed._best_sets(wide, target, 8, exhaustive=100), bed._greedy_sets(wide, target, 8))


def test_moe_testbed_balanced_targets():
    """The balanced targets: every expert within the band, at an error no larger than a brute-force reference's (the
    least total error over every assignment in the band, on a problem small enough to enumerate), and the same sets
    as the unconstrained search when that is already balanced; the greedy search takes prices too."""
    import _moe_testbed as bed

    g = torch.Generator().manual_seed(1)
    f = torch.randn(6, 3, 4, generator=g, dtype=torch.float64)
    f[:, 0] += 1.0
    y = f[:, 0] + f[:, 1] + 0.3 * torch.randn(6, 4, generator=g, dtype=torch.float64)  # every token wants 0 and 1
    combos = torch.tensor(list(itertools.combinations(range(3), 2)))
    err = bed._set_errors(f, y, combos)  # (6, 3)
    band = 1 / 6 + 1e-9  # top-2 of 3: an even share is 2/3; each expert serves 3, 4 or 5 of the 6 tokens
    feasible = []
    for pick in itertools.product(range(3), repeat=6):  # every assignment of a set to each token
        share = torch.bincount(combos[list(pick)].flatten(), minlength=3) / 6
        if (share - 2 / 3).abs().max() <= band:
            feasible.append(float(err[range(6), list(pick)].sum()))
    sets = bed._balanced_sets(f, y, 2, band)
    share = torch.bincount(sets.flatten(), minlength=3) / 6
    assert (share - 2 / 3).abs().max() <= band
    total = float((y - f.gather(1, sets[..., None].expand(-1, -1, 4)).sum(1)).pow(2).sum())
    assert total <= min(feasible) * 1.05, (total, min(feasible))  # Lagrangian: optimal here, or within 5%
    assert float(err.min(1).values.sum()) < total  # the band costs error: unconstrained, every token takes 0 and 1
    even = torch.tensor([[0, 1], [1, 2], [0, 2]] * 2)
    z = f.gather(1, even[..., None].expand(-1, -1, 4)).sum(1)  # already balanced: nothing moves
    assert torch.equal(bed._balanced_sets(f, z, 2, 0.01), even)
    priced = bed._greedy_sets(f, y, 2, price=torch.tensor([1e6, 0.0, 0.0], dtype=torch.float64))
    assert not (priced == 0).any()  # an expert priced out of every set


def test_moe_testbed_load_balancing_spreads_the_routing():
    """Where one expert's output is part of every token's best set, the router without the load-balancing loss sends
    every token there; with it, that expert's share of the tokens drops."""
    import _moe_testbed as bed

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    x[:, -1] = 1.0  # a constant direction (hidden states have one): the bias-free router can prefer an expert
    f = torch.randn(512, 4, 6, generator=g) * 0.3
    f[:, 0] = 1.0  # expert 0: a constant output every token needs
    y = f[:, 0] + f[torch.arange(512), 1 + (x[:, 0] > 0).long()]  # plus expert 1 or 2, by the input's sign
    settings = {"lr": 0.05, "batch": 128, "steps": 60, "mse_steps": 20, "seed": 0}
    shares = []
    for balance in (0.0, 1.0):
        W = torch.zeros(4, 8)
        fit = bed.train_router(W, x, f, y, 2, {**settings, "balance": balance})
        shares.append(fit["max_expert_share"])
    assert shares[0] > 0.95 and shares[1] < shares[0] - 0.1, shares


def test_cost_model(tmp_path):
    argv = ["--tiny", "--workloads", "decode:2:32", "--rounds", "2", "--warmup", "0", "--layers", "2", "--fit", "3",
            "--tables", str(tmp_path / "tables")]  # fmt: skip
    result = _run("cost_model", argv, tmp_path / "cost.json")
    rec = result["workloads"]["decode:2:32"]
    assert set(rec["checked"]) >= {"dense", "mixed"} and all(c["measured_s"] > 0 for c in rec["checked"].values())
    assert (tmp_path / "tables" / "cost_table_decode_2_32.json").is_file()
    assert (tmp_path / "tables" / "cost_table_decode_2_32_fit.json").is_file()
    assert set(rec["fitted"]["checked"]) == set(rec["checked"]) and len(rec["fitted"]["fit_measured_s"]) == 3
    assert result["runtime"].startswith("transformers")
    saved = json.loads((tmp_path / "tables" / "cost_table_decode_2_32.json").read_text(encoding="utf-8"))
    saved["info"]["runtime"] = "llama.cpp (llama-cpp-python 0.3.36), f16"  # a table timed in the other runtime
    (tmp_path / "tables" / "cost_table_decode_2_32.json").write_text(json.dumps(saved), encoding="utf-8")
    with pytest.raises(SystemExit, match="was timed in llama.cpp"):  # never reused for transformers
        importlib.import_module("cost_model").main([*argv, "--reuse-tables", "--output", str(tmp_path / "c2.json")])
    cost_model = importlib.import_module("cost_model")
    assert cost_model.parse_args([]).output.endswith("cost_model_smollm2.json")
    assert cost_model.parse_args(["--runtime", "llama.cpp"]).output.endswith("cost_model_smollm2_llamacpp.json")


def test_cost_model_in_llamacpp(tmp_path):
    """The same check timed in llama.cpp (the llamacpp extra): table, named assemblies and the refit's assemblies
    all timed there, the runtime named in the results."""
    pytest.importorskip("llama_cpp", reason="the llamacpp extra (llama-cpp-python) times the steps")
    argv = ["--tiny", "--runtime", "llama.cpp", "--workloads", "decode:2:16", "--rounds", "1", "--warmup", "0",
            "--layers", "2", "--fit", "2", "--decode-tokens", "2"]  # fmt: skip
    result = _run("cost_model", argv, tmp_path / "cost.json")
    assert result["runtime"].startswith("llama.cpp") and "2 decode step(s)" in result["runtime"]
    rec = result["workloads"]["decode:2:16"]
    assert rec["table"]["info"]["runtime"] == result["runtime"]
    assert set(rec["checked"]) >= {"dense", "mixed"} and all(c["measured_s"] > 0 for c in rec["checked"].values())
    assert len(rec["fitted"]["fit_measured_s"]) == 2 and all(s > 0 for s in rec["fitted"]["fit_measured_s"])


def _wide_model_and_tables(tiny_llama, tokenizer, tmp_path, workloads):
    """A tiny Llama with MLP widths in the format's steps of 256 saved in `tmp_path / "wide"`, and the bytes / FLOP
    cost table of each workload (no output head) in `tmp_path / "t"`, as serving.py reads them."""
    import dataclasses

    from transformers import LlamaForCausalLM

    from optimum_prune.evaluation.cost_model import analytic_cost_table

    _corpora()
    config = copy.deepcopy(tiny_llama.config)
    config.intermediate_size, config.num_hidden_layers = 512, 3
    wide = tmp_path / "wide"
    LlamaForCausalLM(config).save_pretrained(wide)
    tokenizer.save_pretrained(wide)
    (tmp_path / "t").mkdir()
    for w in workloads:
        table = analytic_cost_table(config, w, bandwidth_gbs=10.0, tflops=0.1)
        path = tmp_path / "t" / f"cost_table_{w.phase}_{w.batch}_{w.context}.json"
        dataclasses.replace(table, fixed_s=0.0).save(path)
    return wide


def test_serving(tiny_llama, smollm2_tokenizer, tmp_path):
    """A speed-targeted model and two baselines on a tiny wide Llama (MLP widths in the format's steps of 256):
    pruned, scored, timed against dense; a rerun resumes; the table prints every timed model.

    The cost table is the bytes / FLOP model with no output head: a table timed here would put most of a step in
    the tiny model's 49k-token head, and whether 1.05x is reachable would then depend on this machine's noise."""
    from optimum_prune.evaluation.cost_model import Workload

    wide = _wide_model_and_tables(tiny_llama, smollm2_tokenizer, tmp_path, [Workload("decode", 2, 32)])
    argv = ["--model", str(wide), "--workloads", "decode:2:32", "--targets", "decode:2:32=1.05",
            "--mlp-widths", "knapsack", "ranked", "--ratios", "0.3", "--allocations", "servable", "global", "--num-samples", "4", "--seq-len", "32",
            *TINY_EVAL, "--rounds", "2", "--warmup", "0", "--tables", str(tmp_path / "t"),
            "--workdir", str(tmp_path / "work")]  # fmt: skip
    result = _run("serving", argv, tmp_path / "serving.json")
    _check_protocol(result)
    served = {f"serving@decode:2:32@1.05@{w}" for w in ("knapsack", "ranked")}
    names = {"dense", *served, "np_servable@0.3", "np_global@0.3"}
    assert set(result["models"]) == names
    assert set(result["speed"]["decode:2:32"]) == names - {"dense"}
    assert all(s["speedup"] > 0 for s in result["speed"]["decode:2:32"].values())
    assert all(result["models"][n]["assembly"]["predicted_speedup"] >= 1.05 for n in served)
    assert result["models"]["serving@decode:2:32@1.05@ranked"]["config"]["mlp_widths"] == "ranked"
    again = _run("serving", argv, tmp_path / "serving.json")
    assert again["models"]["np_global@0.3"]["ppl"] == result["models"]["np_global@0.3"]["ppl"]  # resumed
    assert again["protocol"] == result["protocol"]  # a rerun that scores nothing keeps what the texts were
    report = (tmp_path / "serving.md").read_text(encoding="utf-8")
    assert "## decode:2:32" in report and "serving, 1.05x at decode:2:32, end_to_end |" in report
    assert "serving, 1.05x at decode:2:32, end_to_end, ranked widths |" in report
    assert "| 1.05x at decode:2:32 |" in report and "Mean over the 1 target of the log geometric mean" in report
    import serving  # the refit that is not its config version's default is named (sequential from version 4)

    cfg = result["models"]["serving@decode:2:32@1.05@knapsack"]["config"]
    for version, inputs, named in ((4, "sequential", ", sequential refit"), (3, "dense", ", dense-input refit"),
                                   (4, "dense", None), (3, "sequential", None)):  # fmt: skip
        label = serving._label("x", {"kind": "serving", "config": {**cfg, "config_version": version,
                                                                     "compensation_inputs": inputs}})  # fmt: skip
        assert label.endswith(named) if named else "refit" not in label, (version, inputs, label)


def test_serving_llamacpp(tiny_llama, smollm2_tokenizer, tmp_path):
    """The models of a serving run (a batch-1 decode and a prefill): converted by llama.cpp's own converter, their
    llama.cpp perplexity beside transformers' on the same tokens, each timed against dense in llama.cpp, and a llama.cpp
    cost table measured and checked against them; a rerun resumes."""
    pytest.importorskip("llama_cpp", reason="serving_llamacpp.py times the models in llama.cpp (the `llamacpp` extra)")
    from optimum_prune.evaluation.cost_model import Workload

    workloads = [Workload("decode", 1, 32), Workload("prefill", 1, 16), Workload("decode", 2, 32)]
    timed = ["decode:1:32", "prefill:1:16", "decode:2:32"]
    wide = _wide_model_and_tables(tiny_llama, smollm2_tokenizer, tmp_path, workloads)
    argv = ["--model", str(wide), "--workloads", *timed, "--targets", "decode:1:32=1.05",
            "--ratios", "0.3", "--allocations", "servable", "--num-samples", "4", "--seq-len", "32", *TINY_EVAL,
            "--rounds", "1", "--warmup", "0", "--tables", str(tmp_path / "t"), "--workdir", str(tmp_path / "work")]  # fmt: skip
    serving = _run("serving", argv, tmp_path / "serving.json")
    argv = ["--serving", str(tmp_path / "serving.json"), "--check-tokens", "64", "--window", "32", "--rounds", "2",
            "--warmup", "0", "--table-layers", "2", "--tables", str(tmp_path / "lt"), "--workdir", str(tmp_path / "g"),
            "--fit", "3", "--decode-tokens", "2"]  # fmt: skip
    checked = _run("serving_llamacpp", [*argv, "--skip-timing"], tmp_path / "llamacpp.json")  # conversions only
    assert all("ppl" in e and not e["speed"] for e in checked["models"].values()) and "tables" not in checked
    result = _run("serving_llamacpp", argv, tmp_path / "llamacpp.json")
    assert set(result["models"]) == set(serving["models"]) and result["workloads"] == timed
    assert {t["workload"]["batch"] for t in result["tables"].values()} == {1, 2}
    assert {t["workload"]["phase"] for t in result["tables"].values()} == {"decode", "prefill"}
    assert all(t["info"]["fit"]["assemblies"] == 3 for t in result["tables_fitted"].values())
    assert "2 decode step(s) per timing" in result["runtime"]
    for name, entry in result["models"].items():
        assert entry["ppl"] == checked["models"][name]["ppl"]  # the conversion checks are not run again
        for ppl in entry["ppl"].values():  # the converted file computes what transformers computes
            assert ppl["llama_cpp"] == pytest.approx(ppl["transformers"], rel=2e-3), name
        if name != "dense":
            assert set(entry["speed"]) == set(timed)
            for s in entry["speed"].values():
                assert s["speedup"] > 0 and len(s["speedup_rounds"]) == 2 and s["predicted_s"] > 0
                assert s["fit_predicted_s"] > 0 and math.isfinite(s["fit_prediction_error"])
    assert result["models"]["np_servable@0.3"]["in_table_variants"]  # NP's servable widths are table variants
    row = result["models"]["serving@decode:1:32@1.05"]["serving"]
    assert row["predicted"]["decode:1:32"] >= 1.05 and row["transformers"]["decode:1:32"] > 0
    again = _run("serving_llamacpp", argv, tmp_path / "llamacpp.json")  # resumed: nothing measured again
    assert again["models"]["np_servable@0.3"]["speed"] == result["models"]["np_servable@0.3"]["speed"]
    report = (tmp_path / "llamacpp.md").read_text(encoding="utf-8")
    assert "## decode:2:32" in report and "Step-time prediction error" in report and "The fitted table (3" in report
    assert "whose shapes the table's variants express" in report
    other = [*argv[:-1], "1", "--workloads", "decode:2:32"]  # timed another way (one decode step): timed again
    retimed = _run("serving_llamacpp", other, tmp_path / "llamacpp.json")
    assert "1 decode step(s) per timing" in retimed["runtime"] and list(retimed["tables"]) == ["decode:2:32"]
    assert all(set(e.get("speed", {})) == {"decode:2:32"} for n, e in retimed["models"].items() if n != "dense")


def test_vllm_reader(tiny_dir, tmp_path):
    """Without vLLM (this environment's python as `--vllm-python`) every folder is recorded as refused, with why;
    transformers' side and the table run."""
    from optimum_prune import save_pruned_model
    from optimum_prune.modeling.auto_classes import register_pruned_architectures  # noqa: F401

    _corpora()
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    config = AutoModelForCausalLM.from_pretrained(tiny_dir).config
    config.intermediate_size = 256  # (the format's MLP widths are multiples of 256)
    folder = save_pruned_model(LlamaForCausalLM(config), tmp_path / "deci", AutoTokenizer.from_pretrained(tiny_dir),
                               format="deci")  # fmt: skip
    argv = ["--model", str(tiny_dir), "--vllm-python", sys.executable, "--models", f"tiny={folder}",
            "--prompts", "1", "--prompt-tokens", "16", "--workdir", str(tmp_path / "work")]  # fmt: skip
    result = _run("vllm_reader", argv, tmp_path / "vllm.json")
    row = result["rows"]["tiny"]
    assert row["ok"] is False and "vllm" in row["error"].lower() and row["shapes"]["kv_counts"] == [2]
    assert "| tiny | 2 | 0 | fails:" in (tmp_path / "vllm.md").read_text(encoding="utf-8")
    # --qwen2-biases: the model as a Qwen2 with q/k/v biases, dense and NP's default, written as DeciLM
    config.intermediate_size = 768  # (NP's 20% stays servable: widths in steps of 256)
    wide = tmp_path / "wide"
    LlamaForCausalLM(config).save_pretrained(wide)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(wide)
    argv = ["--model", str(wide), "--vllm-python", sys.executable, "--qwen2-biases", "0.3", "--prompts", "1",
            "--prompt-tokens", "16", "--num-samples", "2", "--seq-len", "32", "--workdir", str(tmp_path / "q")]  # fmt: skip
    result = _run("vllm_reader", argv, tmp_path / "vllm_q.json")
    assert set(result["rows"]) == {"qwen2_dense", "qwen2_np_0.2"}
    assert all(r["bias_effect_mean"] > 0 for r in result["rows"].values())  # the biases matter
    assert "Control: the mean" in (tmp_path / "vllm_q.md").read_text(encoding="utf-8")
    for name in result["rows"]:
        cfg = json.loads((tmp_path / "q" / name / "config.json").read_text())
        assert cfg["attention_bias"] and cfg["optimum_prune_base_model_type"] == "qwen2"


def test_recovery_curves(tiny_dir, tmp_path):
    """Throughput of every recipe, then curves: each recipe's checkpoints scored on the three texts, the gap share,
    the learning-rate screen and a rerun that skips what it has."""
    _corpora()
    import recovery_curves

    base = ["--model", str(tiny_dir), "--batch-size", "1", "--seq-len", "16", "--workdir", str(tmp_path / "w")]
    result = _run("recovery_curves", [*base, "--throughput", "--throughput-steps", "1", "--recipes", "lora", "kd"],
                  tmp_path / "tp.json")  # fmt: skip
    assert set(result["throughput"]) == {"lora", "lora_bf16", "kd", "kd_bf16"}
    assert all(r["tokens_per_s"] > 0 and len(r["step_s"]) == 2 for r in result["throughput"].values())
    argv = [*base, "--methods", "np20", "--recipes", "lora", "full", "--budgets", "16", "48", "--lr", "lora=1e-3,1e-2",
            "--num-samples", "2", "--calib-seq-len", "32", *TINY_EVAL]  # fmt: skip
    result = _run("recovery_curves", argv, tmp_path / "rc.json")
    _check_protocol(result)
    runs = result["rows"]["np20"]["runs"]
    assert set(runs) == {"lora@0.001:48", "lora@0.01:48", "full@3e-05:48"}
    assert all([p["tokens"] for p in r["points"]] == [16, 48] for r in runs.values())
    assert set(runs["full@3e-05:48"]["points"][0]["ppl"]) == {"bbc", "python_docs", "kjv"}
    assert runs["full@3e-05:48"]["train_texts"].keys() == {"bbc"}
    report = (tmp_path / "rc.md").read_text(encoding="utf-8")
    assert "gap recovered" in report and "-> best lr" in report and "| LoRA r=16, lr 0.001, fp32 | 48 | 16 |" in report
    again = _run("recovery_curves", argv, tmp_path / "rc.json")
    assert again["rows"]["np20"]["runs"]["lora@0.01:48"]["points"] == runs["lora@0.01:48"]["points"]  # kept
    assert again["protocol"] == result["protocol"]  # a rerun that scores nothing keeps what the texts were
    # the per-budget screen: one run per budget (its own schedule), and training on an equal share of three texts
    screen = [*argv[: argv.index("--lr")], "--lr", "lora=1e-3", "--separate-budgets", "--train-texts", "bbc", "kjv",
              "python_docs", *argv[argv.index("--num-samples") :]]  # fmt: skip
    screened = _run("recovery_curves", screen, tmp_path / "rs.json")["rows"]["np20"]["runs"]
    mixed = "on bbc+kjv+python_docs"
    assert set(screened) == {f"lora@0.001:16 {mixed}", f"lora@0.001:48 {mixed}", f"full@3e-05:16 {mixed}",
                         f"full@3e-05:48 {mixed}"}  # fmt: skip
    assert [p["tokens"] for p in screened[f"full@3e-05:16 {mixed}"]["points"]] == [16]
    shares = screened[f"full@3e-05:16 {mixed}"]["train_texts"]
    assert shares.keys() == {"bbc", "kjv", "python_docs"} and min(s["documents"] for s in shares.values()) > 0
    chars = [s["chars"] for s in shares.values()]
    assert max(chars) < 1.5 * min(chars)  # an equal share of each text, not the union
    assert "16 tokens trained on BBC + Bible + Python docs, best recipe:" in (tmp_path / "rs.md").read_text(
        encoding="utf-8"
    )  # runs on other texts are ranked apart (they are not learning-rate variants)
    other = [*argv[: argv.index("--methods")], "--methods", "np50", "--recipes", "lora", "kdh", "--hidden-weight",
             "5", "--budgets", "16", *argv[argv.index("--num-samples") :]]  # fmt: skip
    merged = _run("recovery_curves", other, tmp_path / "rc.json")  # another method's process: one file, both rows
    assert set(merged["rows"]) == {"np20", "np50"} and merged["rows"]["np20"]["runs"].keys() == runs.keys()
    hidden = merged["rows"]["np50"]["runs"]["kdh x5@3e-05:16"]  # the hidden-state recipe names its weight
    assert hidden["config"]["distill_hidden_weight"] == 5.0 and hidden["config"]["distill"] == "kl"
    assert "| full + KD + hidden x5, lr 3e-05, fp32 |" in (tmp_path / "rc.md").read_text(encoding="utf-8")
    assert recovery_curves.gap_recovered(10.0, 30.0, 15.0) == 0.75
    assert recovery_curves.gap_recovered(10.0, 30.0, 40.0) == -0.5
