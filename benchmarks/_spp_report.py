"""Markdown for `benchmarks/spp.py` results."""

from __future__ import annotations

import math
from typing import Any

from optimum_prune.methods.spp.config import TEXT_BIAS_STRENGTH

NAMES = {"spp": "SPP", "np": "NP", "flap": "FLAP", "spp_ria": "SPP + RIA (experimental)", "ria": "RIA",
         "wanda": "Wanda", "spp_refit": "SPP + refit", "spp_norefit": "SPP, no refit",
         "spp_random": "SPP, random order (control)", "spp_bias": "SPP, refit with a bias",
         "spp_bias_s0.5": "SPP, refit with a bias at strength 0.5", "spp_bias_s1": "SPP, refit with a bias at strength 1",
         "spp_full_refit": "SPP, the full refit without an intercept (the default before the refit screen)",
         "spp_per_kind": "SPP, pools per kind (q/k, v/o, MLP)", "spp_separate": "SPP, pools attention / MLP (the code's)",
         "spp_cost_weighted": "SPP, one cost-weighted pool", "spp_uniform": "SPP, the same fraction in every layer",
         "spp_mlp": "SPP, MLP channels only (every attention dimension kept)",
         "spp_mlp_refit": "SPP, MLP channels only, full refit without a bias (servable shapes)",
         "spp_np_widths": "SPP's MLP order at NP's per-layer MLP widths (diagnostic)",
         "np_spp_widths": "NP's MLP order at the per-layer MLP widths of SPP's MLP-only cut (diagnostic)",
         "spp_np_order": "SPP, NP's order of the MLP channels within each layer (channel_order=\"np\")",
         "spp_mlp_np_order": "SPP, MLP channels only, NP's order within each layer, full refit without a bias",
         "spp_former_default": "SPP's former default (every kind in the path's order, a refit with an intercept at "
                               "half strength)"}  # fmt: skip
ROWS = (
    "spp",
    "spp_former_default",
    "spp_refit",
    "spp_norefit",
    "spp_bias",
    "spp_bias_s0.5",
    "spp_bias_s1",
    "spp_full_refit",
    "spp_per_kind",
    "spp_separate",
    "spp_cost_weighted",
    "spp_uniform",
    "spp_mlp",
    "spp_mlp_refit",
    "spp_np_order",
    "spp_mlp_np_order",
    "spp_random",
    "np",
    "spp_np_widths",
    "np_spp_widths",
    "flap",
)

# The SPPConfig fields of the named extraction rows (the same path, one setting changed): the screen of the extraction
# settings that `benchmarks/spp.py --extra-spp-rows` and `benchmarks/vision.py --methods` run.
# Each row changes one setting of the default of its time, which these rows spell out (`FORMER`: every kind cut in the
# path's order, the refit with an intercept at the modality's strength), so that they still run as they ran.
FORMER = {"prune_attention": True, "compensation_bias": True, "compensation_strength": None, "channel_order": "path"}
VARIANTS = {
    "spp_former_default": FORMER,  # SPP's language-model default before the MLP-only cut with NP's order
    "spp_bias": {**FORMER, "compensation_strength": 1.0},  # (before the half strength: the default's bias at full)
    "spp_bias_s0.5": {**FORMER, "compensation_strength": 0.5},
    "spp_bias_s1": {**FORMER, "compensation_strength": 1.0},
    "spp_full_refit": {**FORMER, "compensation_bias": False, "compensation_strength": 1.0},
    # the allocation across unit kinds (the path's order within each pool is the same)
    "spp_per_kind": {**FORMER, "pools": "per_kind"},
    "spp_separate": {**FORMER, "pools": "separate"},
    "spp_cost_weighted": {**FORMER, "pools": "cost_weighted"},
    "spp_uniform": {**FORMER, "allocation": "uniform"},
    # the whole ratio from the MLP, as NP's servable default takes it (with its refit: no bias, full strength)
    "spp_mlp": {**FORMER, "prune_attention": False},
    "spp_mlp_refit": {**FORMER, "prune_attention": False, "compensation_bias": False, "compensation_strength": 1.0},
    # the path's widths per layer, NP's scores choosing the channels within each (`channel_order="np"`)
    "spp_np_order": {**FORMER, "channel_order": "np"},
    "spp_mlp_np_order": {  # SPP's language-model default since (the same settings, written out)
        "prune_attention": False,
        "compensation_bias": False,
        "compensation_strength": 1.0,
        "channel_order": "np",
    },
}

_SHOWN = ("faithful_to", "lr", "lambda_", "batch_size", "nu_scale", "search_labels", "search_seq_len")


def _f(x: Any, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def _kept(row: dict, dense_layers: tuple[int, int, int]) -> str:
    """Mean fraction of q/k dims, v/o dims and MLP channels SPP kept."""
    layers = row.get("layers")
    if not layers:
        return ""
    fr = [sum(layer[k] for layer in layers) / (len(layers) * dense_layers[k]) for k in range(3)]
    return f"q/k {fr[0]:.0%}, v/o {fr[1]:.0%}, MLP {fr[2]:.0%}"


def _spp_settings(config: dict) -> str:
    """The extraction settings of an `spp` row (keys a file written before they existed lacks: their old values)."""
    pools = f"pools={config.get('pools', 'separate')}"
    if config.get("prune_attention") is False:
        pools = "MLP channels only"
    if config.get("channel_order") == "np":
        pools += ", NP's order within each layer"
    if not config.get("compensate", False):
        return f"{pools}, no refit"
    strength = config.get("compensation_strength", 1.0)
    strength = f"{strength:g}" if strength is not None else f"{TEXT_BIAS_STRENGTH:g} (`None`: a language model's)"
    return (
        f"{pools}, refit with{'' if config.get('compensation_bias', False) else 'out'} a bias at strength {strength}"
    )


def _interval_sections(res: dict, ratios: list, bible: bool) -> list[str]:
    """The perplexities with their bootstrap intervals, each method against NP at the same ratio (NP against FLAP),
    before and after LoRA (results that store per-document sums)."""
    import harness

    texts = [("bbc", "BBC"), ("python", "Python docs")] + ([("kjv", "KJV Bible")] if bible else [])
    dense = res.get("dense", {})
    out = []
    for stage, title in (("pruned", "Perplexity with its interval"), ("lora", "After LoRA")):
        rows = [] if stage == "lora" else [{"group": "0", "label": "dense", "ppl": dense,
                                            "docs": dense.get("documents"), "ref": None}]  # fmt: skip
        reference = (res.get("reference") or {}).get("rows", {})
        for ratio in ratios:
            got = {m: res["rows"][f"{m}@{ratio}"].get(stage) for m in ROWS if f"{m}@{ratio}" in res["rows"]}
            # the reference file's SPP (and NP, when this run has none): `--reference`
            refs = {m: reference[f"{m}@{ratio}"].get(stage) for m in ("spp", "np") if f"{m}@{ratio}" in reference}
            listed = [(m, p, NAMES[m]) for m, p in got.items()]
            listed += [(m, p, f"{NAMES[m]} (reference)") for m, p in refs.items() if m == "spp" or m not in got]
            for method, p, label in listed:
                if not p:
                    continue
                base = {**got, **refs}.get("flap" if method == "np" else "np")  # the reference's NP when given
                ref = None if method == "flap" or not base else {"ppl": base, "docs": base.get("documents")}
                rows.append({"group": f"{ratio}", "label": label, "ppl": p, "docs": p.get("documents"),
                             "ref": ref})  # fmt: skip
        if len(rows) > (stage == "pruned"):
            out += ["", f"{title} (Δ: each method against NP at the same ratio, NP against FLAP):", ""]
            out += harness.interval_table(rows, texts, baseline="NP (NP: FLAP)")
    out += _geomean_section(res, ratios, [k for k, _ in texts])
    un = res.get("unstructured", {})
    if any("documents" in r for r in un.values()):
        rows = [{"group": "50%", "label": NAMES[m], "ppl": un[m], "docs": un[m].get("documents"),
                 "ref": None if m == "ria" or "ria" not in un else {"ppl": un["ria"], "docs": un["ria"].get("documents")}}
                for m in ("spp_ria", "ria", "wanda") if m in un]  # fmt: skip
        out += ["", "50% unstructured with intervals:", ""]
        out += harness.interval_table(rows, texts, group="sparsity", baseline="RIA")
    return out


def _geomean_section(res: dict, ratios: list, keys: list[str]) -> list[str]:
    """The selection criterion (benchmarks/README.md): the geometric mean of the texts' perplexities, each SPP row
    against SPP's default extraction (`spp`) and every row against NP, each Δ with its paired interval."""
    import harness

    def gm(p: dict) -> float:
        return math.exp(sum(math.log(p[k]) for k in keys) / len(keys))

    def item(p: dict) -> dict:
        return {"docs": {k: p["documents"].get(k) for k in keys}}

    def usable(rows: dict, ratio) -> dict:
        got = {m: rows[f"{m}@{ratio}"].get("pruned") for m in ROWS if f"{m}@{ratio}" in rows}
        return {m: p for m, p in got.items() if p and all(k in p.get("documents", {}) for k in keys)}

    reference = res.get("reference")
    lines = []
    for ratio in ratios:
        got, refs = usable(res["rows"], ratio), usable(reference["rows"], ratio) if reference else {}
        base = {**got, **refs}  # the reference's SPP and NP, when given
        for m, p in got.items():
            vs_spp = harness.geomean_delta_cell(item(p), item(base["spp"]), keys) if "spp" in base and (
                reference or m != "spp") else ""  # fmt: skip
            vs_np = harness.geomean_delta_cell(item(p), item(base["np"]), keys) if "np" in base and m != "np" else ""
            lines.append(f"| {ratio} | {NAMES[m]} | {gm(p):.2f} | {vs_spp} | {vs_np} |")
        for m, p in refs.items() if reference else ():  # against NP: the reference's own, else this run's
            vs_np = harness.geomean_delta_cell(item(p), item(base["np"]), keys) if "np" in base and m != "np" else ""
            lines.append(f"| {ratio} | {NAMES[m]} (reference) | {gm(p):.2f} | | {vs_np} |")
    if not lines:
        return []
    against = (
        f" against the SPP and NP rows of `{reference['file']}` (commit {reference['commit']}; the reference rows are "
        "marked)"
        if reference
        else ""
    )
    return [
        "",
        f"Geometric mean of the {len(keys)} texts (the selection criterion), with paired 95% intervals{against}:",
        "",
        "| ratio | model | geometric mean | Δ vs SPP [95%] | Δ vs NP [95%] |",
        "|---:|---|---:|---|---|",
        *lines,
    ]


def markdown(res: dict) -> str:
    a = res["args"]
    bible = any("kjv" in row["pruned"] for row in res["rows"].values())  # the protocol's third text
    dense = res.get("dense", {})
    search = res.get("search", {})
    lines = [
        "# Solution Path Pruning on SmolLM2-135M: one search, a family, against NP and FLAP",
        "",
        f"Generated by `benchmarks/spp.py` ({res.get('date')}, {res.get('host')}; torch {res.get('torch')}, commit "
        f"{res.get('commit')}). 1-min load average {_f(res.get('load_average_start'), '.1f')} at the start of the last "
        f"run, {_f(res.get('load_average_now'), '.1f')} at its last write (2 CPUs shared with other jobs).",
        "",
        "- Model: SmolLM2-135M-Instruct (`SmolLM2-135M-Instruct.Q4_1.gguf` dequantized to float32), CPU, "
        f"{a['threads']} torch thread(s).",
        (
            f"- Data: BBC news, {a['num_samples']} × {a['calib_seq_len']} calibration token ids from the calibration "
            "split (the protocol line below), identical for every method (NP / FLAP / RIA / Wanda calibrate on them, "
            "SPP's refit); LoRA trains on the calibration split too."
            if res.get("protocol")
            else f"- Data: BBC news split with `split_documents(docs, 0.5, seed=0)`; {a['num_samples']} × "
            f"{a['calib_seq_len']} calibration token ids from the first half, identical for every method (NP / FLAP / "
            "RIA / Wanda calibrate on them, SPP's refit and, in runs before SPP searched on windows of its own "
            "(below), its search); LoRA trains on the first half too."
        ),
        (
            f"- Perplexity: windows of {a['eval_seq_len']} over each text's evaluation split (the protocol line): "
            "**BBC** news, **Python** = Python 3.11 documentation sources, and the KJV Bible (listed below the table)."
            if res.get("protocol")
            else f"- Perplexity: first {a['eval_tokens']} tokens, windows of {a['eval_seq_len']}: **BBC** = held-out "
            "half (shuffled, seed 0), **Python** = Python 3.11 documentation sources (out of domain)."
        ),
        f"- SPP: one search of {search.get('steps')} steps (settings "
        f"`{ {k: v for k, v in (search.get('settings') or {}).items() if k in _SHOWN} }`, ν per unit kind "
        f"{ {k: round(v, 1) for k, v in (search.get('nu') or {}).items()} }) on "
        f"{' × '.join(map(str, search.get('calibration') or ['the calibration']))} windows of the calibration split"
        + (
            (
                " (the calibration ids above"
                + ("" if search.get("calibration") == [a["num_samples"], a["calib_seq_len"]] else ", sliced otherwise")
                + ")"
            )
            if search.get("view_of_calibration")
            else ""
        )  # fmt: skip
        + (
            f", cut into {' × '.join(map(str, search['windows']))} search windows"
            if search.get("windows") and search["windows"] != search.get("calibration")
            else ""
        )  # fmt: skip
        + f" in {_f(search.get('search_seconds'), '.0f')} s"
        + (f" ({search['search_cpu_seconds']:.0f} s of CPU time)" if search.get("search_cpu_seconds") else "")
        + (
            f" after {search['targets_seconds']:.0f} s ({search['targets_cpu_seconds']:.0f} s of CPU time) cutting the "
            "windows and drawing their targets"
            if search.get("targets_seconds") is not None
            else ""
        )
        + f"; units that entered the path: {search.get('entered')}; the "
        f"saved path is {_f((search.get('path_bytes') or 0) / 1e6, '.2f')} MB. Every ratio is then extracted from "
        "the saved path with `SPPConfig(pruning_ratio=r, solution_path=...)` (the refit of `o_proj` / `down_proj`, "
        "`compensate=True`, takes one calibration pass on the ids above; without it extraction needs no data). "
        "`random order`: the path's entries and Z permuted within each pool (the control). NP and FLAP: defaults "
        + (
            '(NP at `allocation="global"`, its default before `"auto"`: `--global-allocation`) '
            if a.get("global_allocation")
            else ""
        )
        + "(`round_to=64`), one calibration pass shared by the ratios (`reuse_calibration_pass`), so their prune "
        "time at the first ratio includes the pass and later ones do not.",
        f"- LoRA recovery: r=16, all projections, {a['lora_steps']} steps × batch {a['lora_batch_size']} × "
        f"{a['lora_seq_len']} tokens, lr {a['lora_lr']}, the same windows for every model.",
        "",
        f"Dense: BBC ppl **{_f(dense.get('bbc'))}**, Python ppl **{_f(dense.get('python'))}**, "
        + (f"Bible ppl **{_f(dense.get('kjv'))}**, " if dense.get("kjv") is not None else "")
        + f"{_f((dense.get('params') or 0) / 1e6, '.1f')} M parameters.",
        "",
        "| ratio | method | measured | params (M) | BBC ppl | Python ppl | "
        + ("Bible ppl | " if bible else "")
        + "BBC + LoRA | Python + LoRA | prefill × | decode × | prune time (s) |",
        "|---:|---|---:|---:|---:|---:|" + ("---:|" if bible else "") + "---:|---:|---:|---:|---:|",
    ]
    if res.get("protocol"):
        import harness

        lines[9:9] = [harness.protocol_line(res) + " (This run: calibration and LoRA on the calibration split; the "
                      "table's perplexity columns on the evaluation split.)"]  # fmt: skip
    dense_layers = (64, 64, 1536)
    for ratio in a["ratios"]:
        speed = res.get("speed", {}).get(str(ratio), {}).get("ratios", {})
        for method in ROWS:
            row = res["rows"].get(f"{method}@{ratio}")
            if row is None:
                if method in ("spp", "np", "flap"):
                    lines.append(f"| {ratio} | {NAMES[method]} | not run |" + " |" * (8 + bible))
                continue
            p, lo, sp = row["pruned"], row.get("lora", {}), speed.get(method, {})
            t = f"{row['extract_s']:.2f} (extract)" if method.startswith("spp") else _f(row["prune_s"], ".1f")
            lines.append(
                f"| {ratio} | {NAMES[method]} | {row['measured']:.3f} | {row['params'] / 1e6:.1f} | {_f(p['bbc'])} | "
                f"{_f(p['python'])} | "
                + (f"{_f(p.get('kjv'))} | " if bible else "")
                + f"{_f(lo.get('bbc'))} | {_f(lo.get('python'))} | "
                f"{_f(sp.get('prefill_speedup'))} | {_f(sp.get('decode_speedup'))} | {t} |"
            )
    if any("documents" in row["pruned"] for row in res["rows"].values()):
        lines += _interval_sections(res, a["ratios"], bible)
    lora_kjv = {key: row["lora"]["kjv"] for key, row in res["rows"].items() if "kjv" in row.get("lora", {})}
    if lora_kjv:
        lines += ["", f"KJV Bible perplexity after LoRA (dense {_f(dense.get('kjv'))}):", ""]
        lines += [f"- {key}: {_f(v)}" for key, v in lora_kjv.items()]
    spp_rows = [(r, res["rows"][f"spp@{r}"]) for r in a["ratios"] if f"spp@{r}" in res["rows"]]
    if spp_rows:
        lines += ["", "The `SPP` rows (the default when each was run): " + "; ".join(
            f"{r}: {_spp_settings(row.get('config') or {})}" for r, row in spp_rows) + "."]  # fmt: skip
    rho = search.get("spearman_mlp")
    if rho:
        lines += ["", f"Path vs a plain importance score: Spearman correlation between an MLP channel's place in the "
                  f"path's order and ‖W_down[:, j]‖·‖X_j‖, per layer: mean {sum(rho) / len(rho):.2f}, range "
                  f"{min(rho):.2f} to {max(rho):.2f} (≈ 0 for a path that carries no information)."]  # fmt: skip
    lines += ["", "SPP widths kept (mean over layers):", ""]
    for ratio in a["ratios"]:
        for method in ROWS:
            row = res["rows"].get(f"{method}@{ratio}")
            if row and row.get("layers") and method != "spp_random":
                lines.append(
                    f"- {ratio}" + (f", {NAMES[method]}" if method != "spp" else "") + f": {_kept(row, dense_layers)}"
                )
    costs = [(r, row) for r in a["ratios"] if (row := res["rows"].get(f"spp@{r}")) and "prune_norefit_s" in row]
    if costs:
        lines += ["", "Extracting a member from the saved path (s; the load average above): " + "; ".join(
            f"{r}: {row['prune_s']:.1f} with the refit (its calibration pass {row['refit_s']:.1f}), "
            f"{row['prune_norefit_s']:.2f} without" for r, row in costs) + "."]  # fmt: skip
    kept = [(ratio, method, row["kept"]) for ratio in a["ratios"] for method in ROWS
            if (row := res["rows"].get(f"{method}@{ratio}")) and row.get("kept") and method != "spp_random"]  # fmt: skip
    if kept:
        lines += ["", "Attention (q/k/v/o) / MLP parameters kept:", ""]
        lines += [f"- {r}, {NAMES[m]}: {k['attention']:.0%} / {k['mlp']:.0%}" for r, m, k in kept]
    if res.get("speed"):
        any_speed = next(iter(res["speed"].values()))
        lines += [
            "",
            f"Speed: medians of {any_speed['settings']['repeats']} interleaved rounds (dense, SPP, NP, FLAP of one "
            f"ratio), prompt {any_speed['settings']['prompt_len']} tokens, {any_speed['settings']['new_tokens']} "
            f"greedy tokens, {any_speed['settings']['num_threads']} thread(s), under the timing lock (load averages in "
            "the JSON); × = dense time / model time.",
        ]
    ab = res.get("ablation", {})
    if ab:
        ratios = a.get("ablation_ratios", [0.1, 0.2, 0.3])
        lines += [
            "",
            "## Ablation: dynamics and extraction choices (no recovery)",
            "",
            "BBC / Python perplexity of the model extracted at each ratio. `default`: the path above; `step_record`, "
            '`cost_weighted`, `fold_masks`: the same path cut with `statistic="step_record"`, '
            '`pools="cost_weighted"`, `fold_masks=True` (no refit); `code`: a search with the authors\' dynamics '
            '(`faithful_to="code"`: no pull towards Γ), the other settings as the default\'s, cut with '
            "`extrapolate=True` (entered fraction in the JSON); `coupled` / `paper`: earlier runs' variants; "
            "`random`: the default path's order replaced by a random one (the control).",
            "",
            "| variant | " + " | ".join(f"{r}" for r in ratios) + " |",
            "|---|" + "---:|" * len(ratios),
        ]
        for name in ("default", "step_record", "cost_weighted", "fold_masks", "code", "coupled", "paper", "random"):
            if not any(f"{name}@{r}" in ab for r in ratios):
                continue
            cells = []
            for r in ratios:
                x = ab.get(f"{name}@{r}")
                cells.append("—" if x is None else f"{x['bbc']:.1f} / {x['python']:.1f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    un = res.get("unstructured", {})
    if un:
        lines += [
            "",
            "## 50% unstructured: SPP + RIA vs RIA vs Wanda (same calibration ids)",
            "",
            "| method | measured sparsity | BBC ppl | Python ppl | "
            + ("Bible ppl | " if bible else "")
            + "time (s) |",
            "|---|---:|---:|---:|" + ("---:|" if bible else "") + "---:|",
        ]
        for name in ("spp_ria", "ria", "wanda"):
            r = un.get(name)
            if r is None:
                lines.append(f"| {NAMES[name]} | not run | | | " + ("| " if bible else "") + "|")
                continue
            kjv = f"{_f(r.get('kjv'))} | " if bible else ""
            lines.append(
                f"| {NAMES[name]} | {r['measured']:.3f} | {_f(r['bbc'])} | {_f(r['python'])} | {kjv}{r['prune_s']:.0f} |"
            )
        s = (un.get("spp_ria") or {}).get("search")
        if s:
            lines += ["", f"SPP + RIA's elementwise search: {s['steps']} steps, {s['search_s']:.0f} s, "
                          f"{s['entered']:.1%} of the weights entered the path."]  # fmt: skip
    lines.append("")
    return "\n".join(lines)
