"""Tables of `benchmarks/scale.py`: the per-method accounting, the runs, and what other sizes would need.

The projection fits, per method, the peak memory above the process's own (after its imports) as
`a · block + b · gram` (a block's bytes in the checkpoint's dtype, the float32 Gram of the MLP's width) and the CPU
seconds of a block as proportional to its multiply-adds (forward and statistics: `block parameters × tokens`; NP's
float64 refit: `MLP width³`), by least squares over the measured low-memory runs of every size, and states how far
each measured run is from its fit.
"""

from __future__ import annotations

import statistics
from typing import Any

SHAPES = {  # hidden, MLP, blocks, query heads, KV heads, tied embeddings (as scale.SHAPES)
    "Llama-3.2-1B": (2048, 8192, 16, 32, 8, True),
    "Llama-3.2-3B": (3072, 8192, 28, 24, 8, True),
    "Llama-3.1-8B": (4096, 14336, 32, 32, 8, False),
    "Llama-3.1-70B": (8192, 28672, 80, 64, 8, False),
}
VOCAB = 128256
ELSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _gb(b: float | None) -> str:
    return "" if b is None else f"{b / 1e9:.2f}"


def shape_bytes(shape: str, dtype: str = "bfloat16", blocks: int | None = None) -> dict[str, float]:
    """Bytes of a block, of the embeddings and of the checkpoint; the MLP's float32 Gram; multiply-adds per token."""
    hidden, mlp, layers, heads, kv, tied = SHAPES[shape]
    layers = blocks or layers
    d = hidden // heads
    params = 2 * hidden * hidden + 2 * hidden * kv * d + 3 * hidden * mlp + 2 * hidden
    e = ELSIZE[dtype]
    return {
        "block": params * e,
        "block_params": params,
        "embeddings": VOCAB * hidden * e,
        "checkpoint": (layers * params + VOCAB * hidden * (1 if tied else 2) + hidden) * e,
        "gram": 4 * mlp * mlp,
        "mlp": mlp,
        "layers": layers,
        "hidden": hidden,
    }


def _peak(r: dict) -> int:
    return r["vmhwm"]


def _median_block(r: dict, key: str = "cpu_seconds") -> dict[int, float]:
    """Median CPU seconds of a block per pass (the visits of the passes that pruned or scored)."""
    out: dict[int, list[float]] = {}
    for b in (r.get("progress") or {}).get("blocks", []):
        if b.get("process", 0) == 0:  # a resumed process first replays the finished blocks: not a pass's cost
            out.setdefault(b["pass"], []).append(b[key])
    return {p: statistics.median(v) for p, v in out.items()}


def _mode(r: dict) -> str:
    return "low-memory" if r["low_memory"] else "in memory"


def accounting(results: dict) -> list[str]:
    runs = {k: r for k, r in results["runs"].items() if r["model"] == "acct" and r["low_memory"] and "at_peak" in r}
    m = results["models"].get("acct", {})
    if not runs or m.get("shape") not in SHAPES:  # a smoke run's local model: no shape to account for
        return []
    sb = shape_bytes(m["shape"], m["dtype"], m["blocks"])
    lines = [
        "## Where the peak goes, per method",
        "",
        f"Low-memory runs on the `acct` checkpoint ({m['shape']}'s first {m['blocks']} blocks, {m['dtype']}: "
        f"{_gb(m['bytes'])} GB; one block {_gb(sb['block'])} GB, the MLP's float32 Gram {_gb(sb['gram'])} GB, "
        f"the embeddings {_gb(sb['embeddings'])} GB), 8 × 256 calibration tokens. `before`: the code before this "
        "accounting (blocks read through a memory map, the save through `safetensors.save_file`, NP's solves on whole "
        "float64 copies); `after`: this commit. Peak = VmHWM; at the sample nearest the peak: the phase, the "
        "anonymous memory above the process's own (after its imports) in blocks and Grams, and the resident pages "
        "of the checkpoint's files.",
        "",
        "| method | code | peak GB | % of checkpoint | peak anon GB | peak file GB | at the peak: phase | anon above "
        "imports GB | = blocks | checkpoint pages GB |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    order = sorted(runs, key=lambda k: (runs[k]["config"]["method"], runs[k]["code"] != "before"))
    for k in order:
        r = runs[k]
        at = r.get("at_peak") or {}
        above = at.get("anon", 0) - r["after_import"]["RssAnon"]
        pages = (at.get("file_pages") or {}).get("checkpoint", 0)
        lines.append(
            f"| {r['config']['method']} | {r['code']} | {_gb(_peak(r))} | {100 * _peak(r) / m['bytes']:.0f} "
            f"| {_gb(r['peak_sampled']['RssAnon'])} | {_gb(r['peak_sampled']['RssFile'])} | {at.get('phase', '')} "
            f"| {_gb(above)} | {above / sb['block']:.1f} | {_gb(pages)} |"
        )
    lines += ["", "Peak anonymous memory by phase (GB; `after` runs):", ""]
    phases = ["load model", "embed calibration", "load block", "forward", "decide", "refit", "write block",
              "release block", "measure", "save"]  # fmt: skip
    lines += ["| method | " + " | ".join(phases) + " |", "|---|" + "---:|" * len(phases)]
    for k in order:
        r = runs[k]
        if r["code"] != "after":
            continue
        ph = r.get("phases") or {}
        cells = [_gb(ph[p]["RssAnon"]) if p in ph else "" for p in phases]
        lines.append(f"| {r['config']['method']} | " + " | ".join(cells) + " |")
    return lines


def _identical(results: dict, r: dict) -> str:
    """For a run with digests: whether the in-memory run of the same model and config saved the same tensors."""
    if not r.get("digest"):
        return ""
    for other in results["runs"].values():
        if other is r or not other.get("digest") or other["model"] != r["model"] or other["config"] != r["config"]:
            continue
        if other["low_memory"] != r["low_memory"] and other["code"] == r["code"]:
            return "yes" if other["digest"] == r["digest"] else "**no**"
    return ""


def runs_table(results: dict) -> list[str]:
    lines = [
        "## Runs",
        "",
        "Peak = VmHWM (anonymous + resident file pages, libraries included), and its share of the checkpoint's size on "
        "disk; peak swap: the largest VmSwap sampled (the process's pages in swap, which VmHWM and RssAnon do not "
        "count; the machine has a swapfile). Seconds: wall clock of the pruning (the machine is shared: see the load average) and the median CPU "
        "seconds of a block in each pass over the blocks (NP: scoring, then refit and write; then the measurements). "
        "Disk: bytes written by the process (`/proc/self/io`: pruned blocks, then the save's non-block shard; the "
        "blocks are hard-linked into the output). Identical: the saved tensors hash the same as the in-memory run's.",
        "",
        "| run | code | model (on disk) | mode, method | threads | peak GB | % of ckpt | peak anon GB | peak file GB "
        "| peak swap GB | prune wall s | CPU s / block (per pass) | disk written GB | load avg | identical |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    partial = []
    for k, r in results["runs"].items():
        if r["model"] == "acct" and r["low_memory"] and not r.get("digest") and not r.get("partial"):
            continue
        m = results["models"][r["model"]]
        per_pass = " / ".join(f"{v:.1f}" for v in _median_block(r).values())
        if r.get("partial"):
            partial.append((k, r))
        prune_s = f"{r['seconds']['prune']:.0f}" if "seconds" in r else ""
        written = _gb(r["io"]["write_bytes"]) if "io" in r else ""
        lines.append(
            f"| {k}{' (unfinished)' if r.get('partial') else ''} | {r['code']} | {m['shape']} {m['dtype']} "
            f"({_gb(m['bytes'])} GB) | {_mode(r)}, {r['config']['method']} | {r['threads']} | {_gb(_peak(r))} "
            f"| {100 * _peak(r) / m['bytes']:.0f} | {_gb(r['peak_sampled']['RssAnon'])} "
            f"| {_gb(r['peak_sampled']['RssFile'])} | {_gb(r['peak_sampled'].get('VmSwap'))} | {prune_s} | {per_pass} "
            f"| {written} | {r['loadavg_before'][0]:.1f} | {_identical(results, r)} |"
        )
    for k, r in partial:
        blocks = [b for b in r["progress"]["blocks"] if b.get("process", 0) == 0]
        later = [b for b in r["progress"]["blocks"] if b.get("process", 0) > 0]
        done = {}
        for b in blocks:
            done[b["pass"]] = done.get(b["pass"], 0) + 1
        lines += [
            "",
            f"**{k} did not finish** before the results were recorded (`scale.py --salvage`): its "
            + (f"{r['processes']} processes (killed, then resumed: {r['resumed']})" if r.get("resumed") else "process")
            + " had logged "
            + ", ".join(f"{n} blocks of pass {p + 1}" for p, n in sorted(done.items()))
            + f" ({sum(b['seconds'] for b in blocks) / 60:.0f} min, code {str(r.get('library_commit'))[:7]})"
            + (
                f", then the resumed process {len(later)} block visits (the finished blocks replayed at a median "
                f"{statistics.median(b['cpu_seconds'] for b in later):.1f} CPU s each, then the next ones)"
                if later
                else ""
            )
            + "; "
            + (
                f"its memory is the largest of {r['samples']['count']} samples of /proc (every 5 s), its CPU seconds "
                "per block from the samples too."
                if r["samples"]["count"]
                else "its memory is what its progress lines logged at the end of each block (the peak: VmHWM), its "
                "CPU seconds too (no samples: it ran before the parent sampled)."
            ),
        ]
    resumed = [(k, r) for k, r in results["runs"].items() if len(r.get("parts") or []) > 1]
    for k, r in resumed:
        first, second = r["parts"]
        lines += [
            "",
            f"**Resume ({k}).** The run was killed with SIGKILL after {first['blocks_finished']} blocks were recorded "
            f"in its checkpoint directory ({first['wall_seconds']:.0f} s), then started again with the same call: "
            f"{r.get('resumed') or 'it resumed'}, and finished in {second['wall_seconds']:.0f} s "
            f"(the row above: the second process's memory and pruning time).",
        ]
    return lines


def _fit(rows: list[tuple[list[float], float]]) -> list[float]:
    """Least squares without intercept (normal equations; 1 or 2 unknowns, none negative)."""
    n = len(rows[0][0])
    if n == 1:
        num = sum(x[0] * y for x, y in rows)
        den = sum(x[0] * x[0] for x, _ in rows) or 1.0
        return [num / den]
    a = [[sum(x[i] * x[j] for x, _ in rows) for j in range(n)] for i in range(n)]
    b = [sum(x[i] * y for x, y in rows) for i in range(n)]
    det = a[0][0] * a[1][1] - a[0][1] * a[1][0]
    coef = (
        [(b[0] * a[1][1] - b[1] * a[0][1]) / det, (a[0][0] * b[1] - a[1][0] * b[0]) / det] if abs(det) > 1e-30 else []
    )
    if len(coef) < 2 or min(coef) < 0:  # a negative cost has no meaning: the first term alone
        return [_fit([([x[0]], y) for x, y in rows])[0], 0.0]
    return coef


def projection(results: dict) -> list[str]:
    low = {
        k: r
        for k, r in results["runs"].items()
        if r["low_memory"] and r["code"] == "after" and results["models"][r["model"]]["shape"] in SHAPES
    }
    if not low:
        return []
    lines = [
        "## What other sizes need (low-memory, bf16 checkpoints, 8 × 256 calibration tokens)",
        "",
        "Fitted on the low-memory runs above (see the script): peak = the process's own memory + `a` blocks + `b` "
        "float32 MLP Grams; CPU seconds of a block ∝ its parameters × tokens (NP adds ∝ MLP width³, its float64 "
        "refit). The fit's error on each measured run is in the last columns. Disk: the checkpoint, plus the pruned "
        "blocks the run writes (as large as the checkpoint's blocks; the output hard-links them). With "
        '`device="cuda"`, the GPU holds the block, its statistics and the solves (the fitted peak less the '
        "process's own memory); the host keeps the process and the embedding rows the calibration reads.",
        "",
    ]
    own = [r["after_import"]["VmRSS"] for r in results["runs"].values() if r.get("after_import")]
    if not own:  # only salvaged runs: the process's own memory is not known
        return []
    base = statistics.median(own)
    fits, errors = {}, {}
    for method in sorted({r["config"]["method"] for r in low.values()}):
        mine = [r for r in low.values() if r["config"]["method"] == method]
        mem_rows, time_rows = [], []
        for r in mine:
            m = results["models"][r["model"]]
            sb = shape_bytes(m["shape"], m["dtype"], m["blocks"])
            extra = [sb["block"], sb["gram"]] if method == "numerical" else [sb["block"]]
            mem_rows.append((extra, _peak(r) - (r["after_import"]["VmRSS"] if r.get("after_import") else base)))
            per_block = sum(_median_block(r).values())
            flops = [sb["block_params"] * 2048 / 1e9] + ([sb["mlp"] ** 3 / 1e12] if method == "numerical" else [])
            time_rows.append((flops, per_block))
        fits[method] = (_fit(mem_rows), _fit(time_rows))
        errors[method] = [
            (r["model"], sum(c * x for c, x in zip(fits[method][0], mx)) / y - 1 if y else 0.0,
             sum(c * x for c, x in zip(fits[method][1], tx)) / ty - 1 if ty else 0.0)
            for r, (mx, y), (tx, ty) in zip(mine, mem_rows, time_rows)
        ]  # fmt: skip
    methods = list(fits)
    head = "| model | checkpoint GB | one block GB | disk needed GB | " + " | ".join(
        f"{m} peak GB | {m} GPU GB | {m} CPU h (1 thread)" for m in methods
    )
    lines += [head + " |", "|---|---:|---:|---:|" + "---:|---:|---:|" * len(methods)]
    for shape in SHAPES:
        sb = shape_bytes(shape)
        cells = []
        for method in methods:
            (mem, tim) = fits[method]
            extra = [sb["block"], sb["gram"]] if method == "numerical" else [sb["block"]]
            above = sum(c * x for c, x in zip(mem, extra))
            flops = [sb["block_params"] * 2048 / 1e9] + ([sb["mlp"] ** 3 / 1e12] if method == "numerical" else [])
            hours = sum(c * x for c, x in zip(tim, flops)) * sb["layers"] / 3600
            cells += [_gb(base + above), _gb(above), f"{hours:.1f}"]
        lines.append(f"| {shape} | {_gb(sb['checkpoint'])} | {_gb(sb['block'])} | {_gb(2 * sb['checkpoint'])} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    lines += ["", "Fit: " + "; ".join(
        f"{m}: peak = own + {fits[m][0][0]:.1f} blocks" + (f" + {fits[m][0][1]:.1f} Grams" if len(fits[m][0]) > 1 else "")
        + " (error on " + ", ".join(f"{name} {100 * e:+.0f}%" for name, e, _ in errors[m]) + "); CPU time error "
        + ", ".join(f"{name} {100 * e:+.0f}%" for name, _, e in errors[m])
        for m in methods
    ) + "."]  # fmt: skip
    return lines


def render(results: dict[str, Any]) -> str:
    import harness

    lines = [
        "# Large models: peak memory, time per block and disk traffic of low-memory pruning (CPU)",
        "",
        "Generated by `benchmarks/scale.py` (random weights with the real shapes; the machine: 2 cores shared with "
        "other jobs, 24 GB; load averages below).",
    ]
    if results.get("protocol"):
        lines += ["", harness.protocol_line(results)]
    for part in (accounting(results), runs_table(results), projection(results)):
        if part:
            lines += [""] + part
    return "\n".join(lines) + "\n"
