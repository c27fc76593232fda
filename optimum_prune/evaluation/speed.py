"""Prefill latency, decode throughput and peak memory of causal LMs, alone or interleaved for fair comparisons."""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from typing import Any

import torch

from ..modeling.architectures import require_causal_lm

__all__ = ["benchmark_speed", "compare_speed", "format_speed", "machine_note", "speed_verdicts", "speedup_spread"]

logger = logging.getLogger(__name__)

_PROMPT_SEED = 0
_RSS_POLL_S = 0.002


class _Runner:
    """One model with its fixed prompt; `run()` times one prefill forward and one greedy `generate`."""

    def __init__(
        self, model: torch.nn.Module, tokenizer: Any, device: Any, prompt_len: int, new_tokens: int, batch_size: int
    ):
        if device is not None:
            model.to(device)
        model.eval()
        self.model = model
        self.device = torch.device(device) if device is not None else _input_device(model)
        vocab = (
            getattr(getattr(model, "config", None), "vocab_size", None) or model.get_input_embeddings().num_embeddings
        )
        gen = torch.Generator().manual_seed(_PROMPT_SEED)
        self.input_ids = torch.randint(0, vocab, (batch_size, prompt_len), generator=gen).to(self.device)  # (B, P)
        self.attention_mask = torch.ones_like(self.input_ids)  # (B, P)
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        gen_config = getattr(model, "generation_config", None)
        if pad is None and gen_config is not None:
            pad = gen_config.pad_token_id if gen_config.pad_token_id is not None else gen_config.eos_token_id
        pad = pad[0] if isinstance(pad, (list, tuple)) else pad
        # min == max: every run decodes exactly `new_tokens` tokens, whatever the model predicts
        self.gen_kwargs = {
            "max_new_tokens": new_tokens,
            "min_new_tokens": new_tokens,
            "do_sample": False,
            "num_beams": 1,
            "use_cache": True,
            "pad_token_id": 0 if pad is None else pad,
        }
        self.prefill_s: list[float] = []
        self.generate_s: list[float] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, record: bool = True) -> None:
        with torch.inference_mode():
            self._sync()
            t0 = time.perf_counter()
            self.model(input_ids=self.input_ids, attention_mask=self.attention_mask, use_cache=True)
            self._sync()
            t1 = time.perf_counter()
            self.model.generate(input_ids=self.input_ids, attention_mask=self.attention_mask, **self.gen_kwargs)
            self._sync()
            t2 = time.perf_counter()
        if record:
            self.prefill_s.append(t1 - t0)
            self.generate_s.append(t2 - t1)


def _input_device(model: torch.nn.Module) -> torch.device:
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device


def _current_rss() -> int | None:
    """Resident set size of this process in bytes, or `None` where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        try:
            import psutil  # noqa: PLC0415  (a requirement where /proc is missing: pyproject.toml)

            return psutil.Process().memory_info().rss
        except ImportError:
            return None


def _measure_memory(runner: _Runner) -> dict[str, Any]:
    """Peak memory of one untimed run: CUDA allocator peak, or on CPU weights + the RSS growth seen while running."""
    model = runner.model
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
        runner.run(record=False)
        peak = torch.cuda.max_memory_allocated(runner.device)
        return {"peak_memory_bytes": peak, "model_bytes": model_bytes, "memory_method": "cuda_max_memory_allocated"}
    baseline = _current_rss()
    if baseline is None:
        runner.run(record=False)
        return {"peak_memory_bytes": model_bytes, "model_bytes": model_bytes, "memory_method": "cpu_weights_only"}
    peak = [baseline]
    done = threading.Event()

    def poll() -> None:  # a lower bound: allocator reuse and short-lived peaks between polls are not seen
        while not done.is_set():
            peak[0] = max(peak[0], _current_rss() or 0)
            done.wait(_RSS_POLL_S)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        runner.run(record=False)
    finally:
        done.set()
        thread.join()
    delta = max(peak[0], _current_rss() or 0) - baseline
    return {
        "peak_memory_bytes": model_bytes + max(delta, 0),
        "model_bytes": model_bytes,
        "rss_delta_bytes": delta,
        "memory_method": "cpu_weights_plus_rss_delta",
    }


def _busy_cpu_seconds() -> float | None:
    """CPU seconds every process of the machine has spent busy since boot (Linux `/proc/stat`: user, nice, system,
    irq, softirq, steal); None where that cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


class _MachineLoad:
    """How much of the machine other processes took while the rounds were timed: their CPU time over the wall time
    (the machine's busy CPU time less this process's), in CPUs. On a CPU device the timings are flagged as unreliable
    (`busy`) when the others used more than the CPUs this benchmark's threads leave free, plus half a CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.load = [_load_average()]
        self.wall, self.busy, self.own = time.perf_counter(), _busy_cpu_seconds(), time.process_time()

    def finish(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.wall
        busy, own = _busy_cpu_seconds(), time.process_time() - self.own
        others = max(0.0, (busy - self.busy - own) / wall) if busy is not None and self.busy is not None else None
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = torch.get_num_threads()
        flagged = self.device.type == "cpu" and others is not None and others > max(cpus - threads, 0) + 0.5
        out = {
            "cpus": cpus,
            "threads": threads,
            "other_processes_cpus": others,
            "load_average_1min": [x for x in (*self.load, _load_average()) if x is not None],
            "busy": flagged,
        }
        if flagged:
            logger.warning("%s: the timings are unreliable", machine_note(out))
        return out


def machine_note(machine: dict[str, Any]) -> str:
    """One sentence on how busy the machine was while a comparison was timed (`settings["machine"]`)."""
    others = machine.get("other_processes_cpus")
    if others is None:
        return f"{machine['threads']} threads on {machine['cpus']} CPUs (other processes' load not measured)"
    return (
        f"other processes used {others:.1f} of the {machine['cpus']} CPUs while the rounds ran "
        f"({machine['threads']} threads here)"
    )


def _summary(samples_s: list[float]) -> tuple[float, float]:
    """Median and interquartile range, in milliseconds."""
    ms = [s * 1e3 for s in samples_s]
    if len(ms) < 2:
        return ms[0], 0.0
    q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive")
    return statistics.median(ms), q3 - q1


def speedup_spread(reference_ms: list[float], model_ms: list[float]) -> dict[str, Any]:
    """Per-round speedups of a model over the reference, with their median, quartiles and a verdict.

    Round `i` of `reference_ms` and of `model_ms` ran back to back (`compare_speed` interleaves the models), so each
    round's ratio `reference_ms[i] / model_ms[i]` sees nearly the same machine load; a round where either time is not
    positive (a decode time can be, under noise) is left out. The spread is the interquartile range (IQR) of those
    ratios. A difference from 1 no larger than the spread is reported as a tie: on a shared machine a smaller
    difference is within what the rounds disagree on.

    Args:
        reference_ms (`list[float]`): the reference model's time per round.
        model_ms (`list[float]`): the compared model's time per round, same length.

    Returns:
        `dict`: `rounds` (the per-round speedups, > 1 = the model is faster), `median`, `q1`, `q3`, `iqr` and
        `verdict`: `"faster"`, `"slower"`, `"tie"` (|median - 1| <= iqr) or `"undetermined"` (fewer than two
        usable rounds, so no spread; the quartiles and IQR are then NaN).
    """
    if len(reference_ms) != len(model_ms):
        raise ValueError(f"Per-round times differ in length: {len(reference_ms)} vs {len(model_ms)}.")
    rounds = [a / b for a, b in zip(reference_ms, model_ms) if a > 0 and b > 0]
    nan = float("nan")
    if not rounds:
        return {"rounds": [], "median": nan, "q1": nan, "q3": nan, "iqr": nan, "verdict": "undetermined"}
    median = statistics.median(rounds)
    if len(rounds) < 2:
        return {"rounds": rounds, "median": median, "q1": nan, "q3": nan, "iqr": nan, "verdict": "undetermined"}
    q1, _, q3 = statistics.quantiles(rounds, n=4, method="inclusive")
    iqr = q3 - q1
    verdict = "tie" if abs(median - 1.0) <= iqr else ("faster" if median > 1.0 else "slower")
    return {"rounds": rounds, "median": median, "q1": q1, "q3": q3, "iqr": iqr, "verdict": verdict}


def _round_spreads(ref: dict[str, Any], res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`speedup_spread` of prefill, full generate and decode (generate - prefill of the same run) per round."""

    def decode(r: dict[str, Any]) -> list[float]:
        return [g - p for p, g in zip(r["prefill_ms"], r["generate_ms"])]

    return {
        "prefill_speedup": speedup_spread(ref["prefill_ms"], res["prefill_ms"]),
        "generate_speedup": speedup_spread(ref["generate_ms"], res["generate_ms"]),
        "decode_speedup": speedup_spread(decode(ref), decode(res)),
    }


def _result(runner: _Runner, new_tokens: int, batch_size: int) -> dict[str, Any]:
    prefill_ms, prefill_iqr = _summary(runner.prefill_s)
    generate_ms, generate_iqr = _summary(runner.generate_s)
    decode_ms = generate_ms - prefill_ms  # generate = prefill (first token) + decode steps
    if decode_ms <= 0:
        logger.warning(
            "generate (%.3f ms) was not slower than prefill (%.3f ms); decode rate is undefined",
            generate_ms,
            prefill_ms,
        )
    params = list({p.data_ptr(): p for p in runner.model.parameters()}.values())
    return {
        "prefill_ms_median": prefill_ms,
        "prefill_ms_iqr": prefill_iqr,
        "generate_ms_median": generate_ms,
        "generate_ms_iqr": generate_iqr,
        "decode_ms_median": decode_ms,
        "decode_tokens_per_s": batch_size * new_tokens / (decode_ms / 1e3) if decode_ms > 0 else float("nan"),
        "end_to_end_tokens_per_s": batch_size * new_tokens / (generate_ms / 1e3),
        "prefill_ms": [s * 1e3 for s in runner.prefill_s],
        "generate_ms": [s * 1e3 for s in runner.generate_s],
        "num_parameters": sum(p.numel() for p in params),
        "num_nonzero_parameters": sum(int(torch.count_nonzero(p)) for p in params),
        "device": str(runner.device),
        "dtype": str(params[0].dtype) if params else None,
    }


def compare_speed(
    models: dict[str, torch.nn.Module],
    tokenizer: Any = None,
    *,
    prompt_len: int = 128,
    new_tokens: int = 32,
    batch_size: int = 1,
    warmup: int = 2,
    repeats: int = 10,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """Benchmark several models interleaved, so that drifting machine load affects all of them alike.

    Every model is warmed up, then each of the `repeats` rounds runs every model once, the order rotating by one
    model per round. Each run times one prefill forward and one greedy `generate` (see [`benchmark_speed`]).
    Memory is measured afterwards, in one extra untimed run per model.

    Args:
        models (`dict[str, PreTrainedModel]`): name → causal LM; the first entry is the reference for the ratios.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): used only for the pad / EOS token id.
        prompt_len, new_tokens, batch_size, warmup, repeats, device: as in [`benchmark_speed`].

    Returns:
        `dict`: `settings`, `models` (name → the dict of [`benchmark_speed`]) and `ratios` (name → ratios against
        the first model, from medians: `prefill_speedup` = t_first / t_model, `generate_speedup`, `decode_speedup`,
        `memory_ratio` = peak_model / peak_first, `parameter_ratio` = params_model / params_first; and `per_round`:
        `prefill_speedup` / `generate_speedup` / `decode_speedup` → [`speedup_spread`] of the round-by-round ratios,
        with their median, interquartile range and a `verdict` that calls a difference within the spread a tie).
        `settings["machine"]` says how busy the machine was while the rounds ran: `cpus`, `threads`,
        `other_processes_cpus` (CPU time of the other processes over the wall time, Linux; None elsewhere),
        `load_average_1min` (before, after) and `busy` (on a CPU device, the others took more than the CPUs the
        threads leave free plus half a CPU: the timings are unreliable, and a warning is logged).
        [`format_speed`] renders it as markdown, the verdicts first.
    """
    if not models:
        raise ValueError("compare_speed needs at least one model.")
    for m in models.values():
        require_causal_lm(m, "The prefill / generation benchmark")
    for name, value in {
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "batch_size": batch_size,
        "repeats": repeats,
    }.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}.")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}.")
    runners = {name: _Runner(m, tokenizer, device, prompt_len, new_tokens, batch_size) for name, m in models.items()}
    names = list(runners)
    for name in names:
        for _ in range(warmup):
            runners[name].run(record=False)
    load = _MachineLoad(runners[names[0]].device)
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            runners[name].run()
    machine = load.finish()
    results = {
        name: {**_result(runners[name], new_tokens, batch_size), **_measure_memory(runners[name])} for name in names
    }
    ref = results[names[0]]
    ratios = {
        name: {
            "prefill_speedup": ref["prefill_ms_median"] / res["prefill_ms_median"],
            "generate_speedup": ref["generate_ms_median"] / res["generate_ms_median"],
            "decode_speedup": ref["decode_ms_median"] / res["decode_ms_median"]
            if res["decode_ms_median"] > 0
            else float("nan"),
            "memory_ratio": res["peak_memory_bytes"] / ref["peak_memory_bytes"],
            "parameter_ratio": res["num_parameters"] / ref["num_parameters"],
            "per_round": _round_spreads(ref, res),
        }
        for name, res in results.items()
    }
    settings = {
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "batch_size": batch_size,
        "warmup": warmup,
        "repeats": repeats,
        "num_threads": torch.get_num_threads(),
        "prompt_seed": _PROMPT_SEED,
        "machine": machine,
    }
    for name, res in results.items():
        logger.info(
            "%s: prefill %.2f ms, decode %.1f tok/s", name, res["prefill_ms_median"], res["decode_tokens_per_s"]
        )
        if name != names[0]:
            per_round = ratios[name]["per_round"]
            logger.info(
                "%s vs %s, per round: prefill %s, decode %s",
                name,
                names[0],
                speedup_cell(per_round["prefill_speedup"]),
                speedup_cell(per_round["decode_speedup"]),
            )
    return {"settings": settings, "models": results, "ratios": ratios}


def speedup_cell(spread: dict[str, Any]) -> str:
    """A [`speedup_spread`] as text: `1.20x [1.18, 1.22] faster` (median [Q1, Q3] verdict)."""
    if spread["verdict"] == "undetermined":
        return "n/a" if not spread["rounds"] else f"{spread['median']:.2f}x (undetermined: 1 round)"
    return f"{spread['median']:.2f}x [{spread['q1']:.2f}, {spread['q3']:.2f}] {spread['verdict']}"


def speed_verdicts(result: dict[str, Any]) -> list[str]:
    """The answer of a `compare_speed` result first: one line per compared model with its per-round prefill and
    decode speedups (median [Q1, Q3] and the verdict), and, first of all, a warning when the machine was busy."""
    ratios, settings = result["ratios"], result["settings"]
    ref = next(iter(result["models"]))
    machine = settings.get("machine")
    lines = []
    if machine and machine.get("busy"):
        lines.append(f"UNRELIABLE: {machine_note(machine)}; re-run on an idle machine.")
    for name in list(result["models"])[1:]:
        per_round = ratios[name]["per_round"]
        lines.append(
            f"{name} vs {ref}: prefill {speedup_cell(per_round['prefill_speedup'])}, "
            f"decode {speedup_cell(per_round['decode_speedup'])}"
        )
    return lines


def format_speed(result: dict[str, Any]) -> str:
    """A `compare_speed` result as markdown: the verdicts first ([`speed_verdicts`]), then a table of the medians per
    model and the per-round speedups against the first model as median [first quartile, third quartile] with the
    verdict (`tie` when the difference from 1 is no larger than the interquartile range)."""
    models, ratios, settings = result["models"], result["ratios"], result["settings"]
    ref = next(iter(models))
    machine = settings.get("machine")
    verdicts = speed_verdicts(result)
    lines = [
        *(f"**{line}**" if line.startswith("UNRELIABLE") else line for line in verdicts),
        *([""] if verdicts else []),
        f"Prompt {settings['prompt_len']} tokens, {settings['new_tokens']} new tokens, batch {settings['batch_size']}, "
        f"{settings['repeats']} interleaved rounds, {settings['num_threads']} threads"
        + (f"; {machine_note(machine)}" if machine else "")
        + f"; speedups against `{ref}`, per round: median [Q1, Q3], a tie when |median - 1| <= Q3 - Q1.",
        "",
        "| model | prefill ms (median) | decode tok/s (median) | prefill speedup | decode speedup |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, res in models.items():
        rate = res["decode_tokens_per_s"]
        per_round = ratios[name]["per_round"]
        lines.append(
            f"| {name} | {res['prefill_ms_median']:.1f} | {f'{rate:.1f}' if rate == rate else 'n/a'} | "
            f"{'reference' if name == ref else speedup_cell(per_round['prefill_speedup'])} | "
            f"{'reference' if name == ref else speedup_cell(per_round['decode_speedup'])} |"
        )
    return "\n".join(lines) + "\n"


def benchmark_speed(
    model: torch.nn.Module,
    tokenizer: Any = None,
    *,
    prompt_len: int = 128,
    new_tokens: int = 32,
    batch_size: int = 1,
    warmup: int = 2,
    repeats: int = 10,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """Prefill latency, decode throughput, peak memory and parameter count of one causal LM.

    The prompt is `batch_size × prompt_len` random token ids drawn with a fixed seed (the same for every model of
    the same vocabulary). Prefill is one forward (`use_cache=True`) over the prompt; decoding is greedy `generate`
    with `min_new_tokens == max_new_tokens == new_tokens`. Decode time = median(generate) − median(prefill);
    `decode_tokens_per_s` = `batch_size * new_tokens` / decode time, and `end_to_end_tokens_per_s` uses the full
    generate time. Timings use `time.perf_counter` (with `torch.cuda.synchronize` on CUDA) and whatever
    `torch.set_num_threads` the caller set. Peak memory: `torch.cuda.max_memory_allocated` on CUDA; on CPU the
    parameter + buffer bytes plus the process RSS growth seen during one run (a lower bound).

    Args:
        model (`PreTrainedModel`): a causal LM with `generate`; put in `eval()` mode (and moved to `device`).
        tokenizer (`PreTrainedTokenizerBase`, *optional*): used only for the pad / EOS token id.
        prompt_len (`int`, *optional*, defaults to `128`): prompt tokens per sequence.
        new_tokens (`int`, *optional*, defaults to `32`): tokens generated per sequence.
        batch_size (`int`, *optional*, defaults to `1`): sequences per run.
        warmup (`int`, *optional*, defaults to `2`): untimed runs first.
        repeats (`int`, *optional*, defaults to `10`): timed runs.
        device (`str | torch.device`, *optional*): defaults to the model's device.

    Returns:
        `dict`: `prefill_ms_median`, `prefill_ms_iqr`, `generate_ms_median`, `generate_ms_iqr`, `decode_ms_median`,
        `decode_tokens_per_s`, `end_to_end_tokens_per_s`, the raw `prefill_ms` / `generate_ms` samples,
        `num_parameters`, `num_nonzero_parameters`, `peak_memory_bytes`, `model_bytes`, `memory_method`, `device`,
        `dtype` and `settings`.
    """
    out = compare_speed(
        {"model": model},
        tokenizer,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        batch_size=batch_size,
        warmup=warmup,
        repeats=repeats,
        device=device,
    )
    return {**out["models"]["model"], "settings": out["settings"]}
