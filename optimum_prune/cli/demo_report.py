"""The demo's results (`demo_smollm2.json`, loaded) as text: the plain table `optimum-prune demo` prints and the
markdown file committed under `benchmarks/results/`."""

from __future__ import annotations

import math
from typing import Any

from ..evaluation.speed import format_speed

__all__ = ["format_demo_markdown", "format_demo_table"]


def _speed(x: float) -> str:
    if not math.isfinite(x) or x <= 0:
        return "n/a"
    return f"{x:.2f}x faster" if x >= 1 else f"{1 / x:.2f}x slower"


def _rate(x: float) -> str:
    return f"{x:.1f} tok/s" if math.isfinite(x) and x > 0 else "n/a"


def format_demo_table(result: dict[str, Any]) -> str:
    """The demo's results as a plain-text table plus the generated sentences."""
    d, p, r = result["dense"], result["pruned"], result["ratios"]

    rows = [
        ("parameters", f"{d['parameters'] / 1e6:.2f} M", f"{p['parameters'] / 1e6:.2f} M", f"{r['parameters']:.3f}x"),
        ("held-out perplexity", f"{d['perplexity']:.2f}", f"{p['perplexity']:.2f}", f"{r['perplexity']:.3f}x"),
        (
            "prefill latency (best)",
            f"{d['prefill_ms']:.1f} ms",
            f"{p['prefill_ms']:.1f} ms",
            _speed(r["prefill_speedup"]),
        ),
        (
            "decode throughput (best)",
            _rate(d["decode_tokens_per_s"]),
            _rate(p["decode_tokens_per_s"]),
            _speed(r["decode_speedup"]),
        ),
    ]
    header = ("", "dense", "pruned", "pruned / dense")
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(4)]
    line = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
    s, rep, gen = result["settings"], result["report"], result["generation"]
    load = s["speed"].get("load_average_1min") or []
    out = [
        f"{s['model']}, Numerical Pruning, ratio {s['method']['pruning_ratio']} "
        f"(measured {rep['measured']:.3f} of attention+MLP parameters removed)",
        f"calibration: {s['calibration']['num_samples']} x {s['calibration']['seq_len']} tokens of BBC news; "
        f"perplexity: {s['evaluation']['max_tokens']} tokens of {s['evaluation']['documents']} other BBC articles, "
        f"windows of {s['evaluation']['seq_len']}; speed: prompt {s['speed']['prompt_len']}, "
        f"{s['speed']['new_tokens']} new tokens, best of {s['speed']['repeats']} interleaved runs, "
        f"{s['torch_threads']} threads",
        "",
        line(header),
        line(tuple("-" * w for w in widths)),
        *(line(row) for row in rows),
        "",
        f"medians: prefill {d['prefill_ms_median']:.1f} ms vs {p['prefill_ms_median']:.1f} ms "
        f"({_speed(r['prefill_speedup_median'])}), decode {_rate(d['decode_tokens_per_s_median'])} vs "
        f"{_rate(p['decode_tokens_per_s_median'])} ({_speed(r['decode_speedup_median'])})",
        *(
            [
                f"note: load average {max(load):.1f} > {s['torch_threads']} threads: other processes disturbed the timings"
            ]
            if load and max(load) > s["torch_threads"] + 0.5
            else []
        ),
        *([f"per-round speedups: {_spreads(result['speed'])}"] if "speed" in result else []),
        f"saved to {result['output_dir']}; reloaded logits max |diff| = {result['reload']['max_abs_logit_diff']:.3g}",
        f"prompt: {gen['prompt']}",
        f"  dense : {gen['dense']}",
        f"  pruned: {gen['pruned_reloaded']}",
        f"total time {result['timings_s']['total_s']:.0f} s",
    ]
    return "\n".join(out)


def _spreads(speed: dict[str, Any]) -> str:
    """Prefill and decode speedups of the pruned model, per round: median [Q1, Q3] and the verdict."""
    per_round = speed["ratios"]["pruned"]["per_round"]
    cells = []
    for what in ("prefill", "decode"):
        sp = per_round[f"{what}_speedup"]
        if sp["verdict"] == "undetermined":
            cells.append(f"{what} undetermined")
        else:
            cells.append(f"{what} {sp['median']:.2f}x [{sp['q1']:.2f}, {sp['q3']:.2f}] {sp['verdict']}")
    return ", ".join(cells) + " (tie when |median - 1| <= Q3 - Q1)"


def format_demo_markdown(result: dict[str, Any]) -> str:
    """The demo's results file (`demo_smollm2.json`, loaded) as markdown: settings, the dense-vs-pruned table, the
    per-round speed comparison with its spread, the wall time of each step and the generated sentences."""
    d, p, r = result["dense"], result["pruned"], result["ratios"]
    s, rep, gen, t = result["settings"], result["report"], result["generation"], result["timings_s"]
    repeats = s["speed"]["repeats"]
    load = s["speed"].get("load_average_1min") or []
    rows = [
        ("parameters", f"{d['parameters'] / 1e6:.2f} M", f"{p['parameters'] / 1e6:.2f} M", f"{r['parameters']:.3f}x"),
        ("held-out perplexity", f"{d['perplexity']:.2f}", f"{p['perplexity']:.2f}", f"{r['perplexity']:.3f}x"),
        (
            f"prefill latency (best of {repeats})",
            f"{d['prefill_ms']:.1f} ms",
            f"{p['prefill_ms']:.1f} ms",
            _speed(r["prefill_speedup"]),
        ),
        (
            f"decode throughput (best of {repeats})",
            _rate(d["decode_tokens_per_s"]),
            _rate(p["decode_tokens_per_s"]),
            _speed(r["decode_speedup"]),
        ),
    ]
    lines = [
        f"# Demo: {s['model']}, Numerical Pruning ratio {s['method']['pruning_ratio']}",
        "",
        f"Run {result.get('date', 'n/a')}: {rep['measured']:.3f} of the attention+MLP parameters removed; "
        f"calibration {s['calibration']['num_samples']} x {s['calibration']['seq_len']} tokens of "
        f"{s['calibration']['documents']} BBC news articles; perplexity on {s['evaluation']['max_tokens']} tokens of "
        f"{s['evaluation']['documents']} other articles (windows of {s['evaluation']['seq_len']}); "
        f"{s['torch_threads']} torch threads"
        + (f"; load average (1 min) {min(load):.1f}-{max(load):.1f} during the speed test." if load else "."),
        "",
        "| | dense | pruned | pruned / dense |",
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
