"""The demo's results (`demo_smollm2.json`, loaded) as text: the plain table `optimum-prune demo` prints and the
markdown file committed under `benchmarks/results/`."""

from __future__ import annotations

import math
from typing import Any

from ..evaluation.speed import format_speed, machine_note, speed_verdicts, speedup_cell

__all__ = ["format_demo_markdown", "format_demo_table"]


def _rate(x: float) -> str:
    return f"{x:.1f} tok/s" if math.isfinite(x) and x > 0 else "n/a"


def _machine(result: dict[str, Any]) -> dict[str, Any] | None:
    """How busy the machine was during the speed test: `compare_speed`'s measure, or (a results file written before
    it existed) the load average against the threads."""
    speed = result.get("speed") or {}
    machine = speed.get("settings", {}).get("machine")
    if machine is not None:
        return machine
    load, threads = result["settings"]["speed"].get("load_average_1min") or [], result["settings"]["torch_threads"]
    if load and max(load) > threads + 0.5:
        return {"busy": True, "note": f"load average {max(load):.1f} > {threads} threads"}
    return None


def _verdict(result: dict[str, Any]) -> list[str]:
    """What the demo found, first: size, quality and the per-round speedups with their interval; the warning about a
    busy machine before them."""
    r, machine = result["ratios"], _machine(result)
    lines = []
    if machine and machine.get("busy"):
        note = machine.get("note") or machine_note(machine)
        lines.append(f"UNRELIABLE speed: {note}; other processes disturbed the timings, re-run on an idle machine.")
    verdicts = speed_verdicts(result["speed"]) if "speed" in result else []
    speed = "; ".join(v for v in verdicts if not v.startswith("UNRELIABLE")) or "speed not measured"
    lines.append(
        f"pruned: {1 - r['parameters']:.1%} fewer parameters, held-out perplexity {r['perplexity']:.3f}x "
        f"({result['dense']['perplexity']:.2f} -> {result['pruned']['perplexity']:.2f}); {speed} "
        "(per-round median [Q1, Q3]; a tie when |median - 1| <= Q3 - Q1)"
    )
    return lines


def _rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    d, p, r = result["dense"], result["pruned"], result["ratios"]
    per_round = result["speed"]["ratios"]["pruned"]["per_round"] if "speed" in result else {}
    cell = lambda key: speedup_cell(per_round[key]) if key in per_round else "n/a"  # noqa: E731
    return [
        ("parameters", f"{d['parameters'] / 1e6:.2f} M", f"{p['parameters'] / 1e6:.2f} M", f"{r['parameters']:.3f}x"),
        ("held-out perplexity", f"{d['perplexity']:.2f}", f"{p['perplexity']:.2f}", f"{r['perplexity']:.3f}x"),
        (
            "prefill latency (median)",
            f"{d['prefill_ms_median']:.1f} ms",
            f"{p['prefill_ms_median']:.1f} ms",
            cell("prefill_speedup"),
        ),
        (
            "decode throughput (median)",
            _rate(d["decode_tokens_per_s_median"]),
            _rate(p["decode_tokens_per_s_median"]),
            cell("decode_speedup"),
        ),
    ]


def format_demo_table(result: dict[str, Any]) -> str:
    """The demo's results as plain text: the verdict first, then the table and the generated sentences."""
    rows = _rows(result)
    header = ("", "dense", "pruned", "pruned vs dense (per round)")
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(4)]
    line = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
    s, rep, gen = result["settings"], result["report"], result["generation"]
    out = [
        *_verdict(result),
        "",
        f"{s['model']}, Numerical Pruning, ratio {s['method']['pruning_ratio']} "
        f"(measured {rep['measured']:.3f} of attention+MLP parameters removed)",
        f"calibration: {s['calibration']['num_samples']} x {s['calibration']['seq_len']} tokens of BBC news; "
        f"perplexity: {s['evaluation']['max_tokens']} tokens of {s['evaluation']['documents']} other BBC articles, "
        f"windows of {s['evaluation']['seq_len']}; speed: prompt {s['speed']['prompt_len']}, "
        f"{s['speed']['new_tokens']} new tokens, {s['speed']['repeats']} interleaved rounds, "
        f"{s['torch_threads']} threads",
        "",
        line(header),
        line(tuple("-" * w for w in widths)),
        *(line(row) for row in rows),
        "",
        f"saved to {result['output_dir']}; reloaded logits max |diff| = {result['reload']['max_abs_logit_diff']:.3g}",
        f"prompt: {gen['prompt']}",
        f"  dense : {gen['dense']}",
        f"  pruned: {gen['pruned_reloaded']}",
        f"total time {result['timings_s']['total_s']:.0f} s",
    ]
    return "\n".join(out)


def format_demo_markdown(result: dict[str, Any]) -> str:
    """The demo's results file (`demo_smollm2.json`, loaded) as markdown: settings, the dense-vs-pruned table, the
    per-round speed comparison with its spread, the wall time of each step and the generated sentences."""
    s, rep, gen, t = result["settings"], result["report"], result["generation"], result["timings_s"]
    load = s["speed"].get("load_average_1min") or []
    rows = _rows(result)
    lines = [
        f"# Demo: {s['model']}, Numerical Pruning ratio {s['method']['pruning_ratio']}",
        "",
        *(f"**{line}**" for line in _verdict(result)),
        "",
        f"Run {result.get('date', 'n/a')}: {rep['measured']:.3f} of the attention+MLP parameters removed; "
        f"calibration {s['calibration']['num_samples']} x {s['calibration']['seq_len']} tokens of "
        f"{s['calibration']['documents']} BBC news articles; perplexity on {s['evaluation']['max_tokens']} tokens of "
        f"{s['evaluation']['documents']} other articles (windows of {s['evaluation']['seq_len']}); "
        f"{s['torch_threads']} torch threads"
        + (f"; load average (1 min) {min(load):.1f}-{max(load):.1f} during the speed test." if load else "."),
        "",
        "| | dense | pruned | pruned vs dense (per round) |",
        "|---|---:|---:|---:|",
        *(f"| {' | '.join(row)} |" for row in rows),
        "",
        "## Speed, round by round",
        "",
        format_speed(result["speed"]).rstrip("\n"),
        "",
        "## Wall time",
        "",
        "| step | seconds |",
        "|---|---:|",
        *(f"| {name.removesuffix('_s')} | {sec:.1f} |" for name, sec in t.items()),
        "",
        "## Generation",
        "",
        f"Prompt: {gen['prompt']}",
        "",
        f"- dense: {gen['dense']}",
        f"- pruned (reloaded): {gen['pruned_reloaded']}",
        "",
        f"Reloaded logits max abs diff: {result['reload']['max_abs_logit_diff']:.3g}.",
    ]
    return "\n".join(lines) + "\n"
