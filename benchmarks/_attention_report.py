"""Markdown for `benchmarks/attention.py` results."""

from __future__ import annotations

import statistics
from typing import Any

ATTN = {
    "sparsegpt": "SparseGPT",
    "wanda": "Wanda",
    "amp": "AMP (default)",
    "amp_layer": "AMP (refit to the layer)",
    "amp_model": "AMP (refit to the model)",
    "amp_paper": "AMP (paper)",
}
MLP = {
    "dense": "Dense MLP",
    "wanda": "Wanda MLP",
    "sparsegpt": "SparseGPT MLP",
    "wanda_rest": "Wanda v/o + MLP",
    "wanda_rest_pass": "Wanda v/o + MLP, one pass",
}
_AMP_FIELDS = (
    "solver",
    "lambda_rel",
    "cg_steps",
    "lambda_",
    "lr",
    "steps",
    "regularizer",
    "score",
    "per",
    "refit_steps",
    "refit_target",
)


def _f(x: Any, fmt: str = ".2f") -> str:
    return "not run" if x is None else format(x, fmt)


def render_markdown(result: dict[str, Any]) -> str:
    s, rows, st = result["setup"], result["rows"], result.get("stage1", {})
    c = s["calibration"]
    attn = [a for a in ATTN if any(k.startswith(f"{a}|") for k in rows) or a in st]
    mlps = [m for m in MLP if any(k.endswith(f"|{m}") for k in rows)]
    cfgs = {k: v for k, v in result.get("amp_configs", {}).items() if k in attn}
    protocol = bool(result.get("protocol"))
    texts = ["bbc", "pydocs"] + (["kjv"] if protocol else [])
    names = {"bbc": "BBC", "pydocs": "Python docs", "kjv": "KJV Bible"}
    where = (
        f"Perplexity on {s['eval']['tokens']} tokens (windows of {s['eval']['seq_len']}) of each test text"
        if protocol
        else f"Perplexity on the first {s['eval']['tokens']} tokens (windows of {s['eval']['seq_len']}) of the "
        "held-out BBC half (in domain) and of the Python 3.11 documentation (out of domain)"
    )
    lines = [
        "# AMP (attention-matrix pruning) on SmolLM2-135M: the paper's Table 1",
        "",
        f"Model `{s['model']}` (float32, CPU, {s['threads']} threads, {s['cpu_count']} CPUs shared with other jobs). "
        f"Calibration: {c['num_samples']} x {c['seq_len']} tokens of the calibration BBC documents, identical ids for "
        f"every cell. {where}. Every method prunes 50% of its targets; stage 1 prunes q/k, stage 2 the rest of the "
        "stage-1 model named by the row; v/o stay dense unless the row names them."
        + "".join(
            f" {ATTN[k]}: " + ", ".join(f"{f}={v[f]}" for f in _AMP_FIELDS if f in v) + "." for k, v in cfgs.items()
        ),
        "",
    ]
    if protocol:
        lines += [harness_protocol_line(result), ""]
    dense = result.get("dense", {})
    lines += [
        "Dense: " + ", ".join(f"{names[t]} **{_f(dense.get(f'ppl_{t}'))}**" for t in texts) + ".",
        "",
        "## Perplexity: " + " / ".join(names[t] for t in texts) + " (pruning time, s)",
        "",
        "| stage 2 \\ q,k by | " + " | ".join(ATTN[a] for a in attn) + " |",
        "|---|" + "---:|" * len(attn),
    ]
    for m in mlps:
        cells = []
        for a in attn:
            r = rows.get(f"{a}|{m}")
            cells.append(
                "not run" if r is None else " / ".join(f"{r[f'ppl_{t}']:.2f}" for t in texts) + f" ({r['time_s']:.0f})"
            )
        lines.append(f"| {MLP[m]} | " + " | ".join(cells) + " |")
    if any("documents" in r for r in rows.values()):
        lines += ["", "## Perplexity with its interval; Δ: against Wanda on q/k with the same stage 2", ""]
        lines += _interval_rows(result, attn, mlps, [(f"ppl_{t}", names[t]) for t in texts])
    lines += ["", "## Times and sparsity", "", "Whole-model fraction of zero weights per cell: " + ", ".join(
        f"{k} {v['whole_model_sparsity']:.3f}" for k, v in rows.items()) + "."]  # fmt: skip
    if st:
        lines += ["", "Stage-1 (q/k) pruning time (wall clock; load average at the end): " + ", ".join(
            f"{ATTN[a]} {v['time_s']:.1f} s ({v['load']:.1f})" for a, v in st.items()) + "."]  # fmt: skip
        for a in ("amp", "amp_paper"):
            amp = st.get(a, {}).get("amp_layers")
            if amp:
                soft = [v["rel_attention_error_soft"] for v in amp.values()]
                hard = [v["rel_attention_error_binary"] for v in amp.values()]
                refit = [v["rel_attention_error_refit"] for v in amp.values() if "rel_attention_error_refit" in v]
                lines += [
                    f"{ATTN[a]} per layer (stage 1): relative attention error before binarisation median "
                    f"{_med(soft):.3g}, after median {_med(hard):.3g} (max {max(hard):.3g})"
                    + (f", after the refit median {_med(refit):.3g} (max {max(refit):.3g})." if refit else ".")
                ]
    passes = {k: v["amp_layers"] for k, v in rows.items() if v.get("amp_layers")}
    if passes:
        lines += ["", "A row marked \"one pass\" is one recipe, [the q/k method, Wanda on v/o + MLP], run in one "
                  "layer-wise calibration pass (`prune_(model, [config, WandaConfig(...)])`): every layer sees the "
                  "outputs of the layers pruned by both.", "",
                  "AMP in those recipes, relative attention error per layer (median over the layers; \"layer\": "
                  "against the dense weights on this model's inputs, \"model\": against the dense model's own "
                  "attention):"]  # fmt: skip
        for k, amp in passes.items():
            lines += [f"- {ATTN[k.split('|')[0]]}: binarised {_errors(amp, 'binary')}; after the refit "
                      f"{_errors(amp, 'refit')}."]  # fmt: skip
    err = result.get("attention_error")
    if err:
        rhos, methods = err["rhos"], [m for m in ATTN if m in next(iter(err["layers"].values()))]
        lines += ["", "## Relative attention error ‖f̃ − f‖²/‖f‖² per layer (dense inputs, q and k pruned)", "",
                  "| layer | " + " | ".join(f"{ATTN[m]} ρ={r}" for r in rhos for m in methods) + " |",
                  "|---:|" + "---:|" * (len(rhos) * len(methods))]  # fmt: skip
        for layer, rec in err["layers"].items():
            lines.append(f"| {layer} | " + " | ".join(f"{rec[m][str(r)]:.3g}" for r in rhos for m in methods) + " |")
        for a in ("amp", "amp_paper"):
            if a in methods:
                wins = {r: sum(rec[a][str(r)] < min(rec["wanda"][str(r)], rec["sparsegpt"][str(r)])
                               for rec in err["layers"].values()) for r in rhos}  # fmt: skip
                lines += ["", f"{ATTN[a]} has the lowest error on " + ", ".join(
                    f"{w}/{len(err['layers'])} layers at ρ={r}" for r, w in wins.items()) + "."]  # fmt: skip
    sp = result.get("speed")
    if sp:
        lines += ["", f"## AMP speed at {c['num_samples']} x {c['seq_len']} calibration tokens", "",
                  f"{sp['layers']} layer(s) x {sp['steps']} steps, median of {sp['repeats']} interleaved runs: "
                  f"**{sp['seconds_per_step']:.3f} s per step** (load average {sp['load']}), i.e. "
                  f"~{sp['extrapolated_min']:.1f} min of descent for 30 layers x 100 steps. Plain autograd through "
                  f"the same forward (same iterates): {sp['autograd_seconds_per_step']:.3f} s per step "
                  f"({sp['autograd_over_fast']:.2f}x). Process CPU time (all {sp.get('threads', '?')} threads): "
                  f"{sp['cpu_seconds_per_step']:.3f} s per step (autograd {sp['autograd_cpu_seconds_per_step']:.3f})."]  # fmt: skip
        for o in result.get("speed_other_runs", []):
            lines += ["", f"Same probe with {o['threads']} threads ({o['note']}): {o['seconds_per_step']:.3f} s per step "
                      f"(load average {o['load']})."]  # fmt: skip
        if "floor_seconds_per_step" in sp:
            lines += ["", f"Floor: one layer-step is {sp['gflop_projections'] + sp['gflop_attention']:.1f} GFLOP of "
                      f"matmuls ({sp['gflop_projections']:.1f} in the q/k projections and their weight gradients, "
                      f"{sp['gflop_attention']:.1f} in the logits, dq and dk of the causal blocks); at the "
                      f"{sp['sgemm_gflops']:.0f} GFLOP/s this process's sgemm sustains on the projection's shape "
                      f"({sp['threads']} threads, same run) that is {sp['floor_seconds_per_step']:.3f} s per step "
                      f"(~{sp['floor_seconds_per_step'] * sp['extrapolated_min'] / sp['seconds_per_step']:.1f} min "
                      f"for 30 x 100): the fast path runs at "
                      f"{sp['seconds_per_step'] / sp['floor_seconds_per_step']:.2f}x the floor."]  # fmt: skip
    if "amp" in st and st["amp"].get("timed"):
        a = result.get("amp_configs", {}).get("amp", {})
        work = (
            f"CG {a['cg_steps']} iterations + refit {a['refit_steps']} steps per layer"
            if a.get("solver") == "cg"
            else f"{st['amp']['steps']} steps per layer"
        )
        lines += [f"Whole-model AMP run (stage 1 above, {work}, a separate timed run on the idle machine): "
                  f"**{st['amp']['time_s'] / 60:.1f} min** wall, {st['amp']['cpu_s'] / 60:.1f} min of process CPU time "
                  f"(load average {st['amp']['load']:.1f} at the end)."]  # fmt: skip
    if result.get("status") != "complete":
        lines += ["", f"_Partial results ({result.get('status')}); cells marked 'not run' did not finish._"]
    return "\n".join(lines) + "\n"


def _interval_rows(result: dict[str, Any], attn: list[str], mlps: list[str], texts: list) -> list[str]:
    import harness

    rows, dense = result["rows"], result.get("dense", {})
    out = [{"group": "dense", "label": "dense", "ppl": dense, "docs": dense.get("documents"), "ref": None}]
    for m in mlps:
        base = rows.get(f"wanda|{m}")
        for a in attn:
            r = rows.get(f"{a}|{m}")
            if r is not None:
                ref = None if a == "wanda" or base is None else {"ppl": base, "docs": base.get("documents")}
                out.append({"group": MLP[m], "label": ATTN[a], "ppl": r, "docs": r.get("documents"), "ref": ref})
    return harness.interval_table(out, texts, group="stage 2", baseline="Wanda q/k")


def harness_protocol_line(result: dict[str, Any]) -> str:
    import harness

    return harness.protocol_line(result)


def _errors(amp: dict[str, Any], stage: str) -> str:
    """Median over the layers of AMP's relative attention error at `stage`, against the layer and the model."""
    fields = {"layer": f"rel_attention_error_{stage}", "model": f"rel_attention_error_model_{stage}"}
    vals = {t: [v[f] for v in amp.values() if f in v] for t, f in fields.items()}
    return ", ".join(f"{_med(x):.3g} ({t})" for t, x in vals.items() if x)


def _med(xs: list[float]) -> float:
    return statistics.median(xs)
