import json
import math
import statistics
import time
from types import SimpleNamespace

import pytest
import torch

from optimum_prune.evaluation import benchmark_speed, compare_speed, format_speed, speedup_spread


class SleepyLM(torch.nn.Module):
    """Fake causal LM whose prefill / generate take fixed times; records the order in which models run."""

    def __init__(self, name, prefill_s, generate_s, log):
        super().__init__()
        self.name, self.prefill_s, self.generate_s, self.log = name, prefill_s, generate_s, log
        self.config = SimpleNamespace(vocab_size=100)
        self.weight = torch.nn.Parameter(torch.ones(10))

    def forward(self, input_ids, attention_mask=None, use_cache=True):
        self.log.append(self.name)
        time.sleep(self.prefill_s)

    def generate(self, input_ids, attention_mask=None, max_new_tokens=1, min_new_tokens=1, **kwargs):
        assert max_new_tokens == min_new_tokens
        time.sleep(self.generate_s)
        return torch.zeros(input_ids.shape[0], input_ids.shape[1] + max_new_tokens, dtype=torch.long)


def test_benchmark_speed_tiny_llama(tiny_llama, smollm2_tokenizer):
    result = benchmark_speed(tiny_llama, smollm2_tokenizer, prompt_len=16, new_tokens=4, warmup=1, repeats=3)
    json.dumps(result)
    for key in ("prefill_ms_median", "generate_ms_median", "decode_tokens_per_s", "end_to_end_tokens_per_s"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["prefill_ms_iqr"] >= 0 and len(result["prefill_ms"]) == len(result["generate_ms"]) == 3
    assert result["num_parameters"] == sum(p.numel() for p in tiny_llama.parameters())
    assert result["peak_memory_bytes"] >= result["model_bytes"] > 0
    assert result["settings"]["num_threads"] == torch.get_num_threads()
    assert result["end_to_end_tokens_per_s"] == pytest.approx(4 / (result["generate_ms_median"] / 1e3))
    assert result["decode_tokens_per_s"] == pytest.approx(4 / (result["decode_ms_median"] / 1e3))


def test_compare_speed_interleaves_and_ratios_from_medians():
    log = []
    models = {
        "dense": SleepyLM("dense", 0.03, 0.09, log),
        "pruned": SleepyLM("pruned", 0.002, 0.006, log),
        "other": SleepyLM("other", 0.002, 0.010, log),
    }
    out = compare_speed(models, prompt_len=8, new_tokens=5, warmup=1, repeats=3)
    # warm-up per model, then rounds with the order rotated by one each time, then one memory run per model
    assert log == ["dense", "pruned", "other"] + [
        "dense",
        "pruned",
        "other",
        "pruned",
        "other",
        "dense",
        "other",
        "dense",
        "pruned",
    ] + ["dense", "pruned", "other"]
    res, ratios = out["models"], out["ratios"]
    for name, r in res.items():
        assert r["prefill_ms_median"] == statistics.median(r["prefill_ms"])
        assert r["decode_ms_median"] == pytest.approx(r["generate_ms_median"] - r["prefill_ms_median"])
        assert ratios[name]["prefill_speedup"] == pytest.approx(
            res["dense"]["prefill_ms_median"] / r["prefill_ms_median"]
        )
        assert ratios[name]["generate_speedup"] == pytest.approx(
            res["dense"]["generate_ms_median"] / r["generate_ms_median"]
        )
        assert ratios[name]["decode_speedup"] == pytest.approx(
            res["dense"]["decode_ms_median"] / r["decode_ms_median"]
        )
    assert ratios["dense"]["prefill_speedup"] == 1.0 and ratios["dense"]["memory_ratio"] == 1.0
    # sleeps only ever get longer under load, so the faster fake model is never measured slower than the dense one
    assert ratios["pruned"]["prefill_speedup"] > 1.0
    assert ratios["other"]["parameter_ratio"] == 1.0
    # the per-round ratios pair round i of every model (run back to back), not the medians
    for name, r in res.items():
        spread = ratios[name]["per_round"]
        assert spread["prefill_speedup"]["rounds"] == [
            a / b for a, b in zip(res["dense"]["prefill_ms"], r["prefill_ms"])
        ]
        decode = [g - p for p, g in zip(r["prefill_ms"], r["generate_ms"])]
        dense_decode = [g - p for p, g in zip(res["dense"]["prefill_ms"], res["dense"]["generate_ms"])]
        assert spread["decode_speedup"]["rounds"] == [a / b for a, b in zip(dense_decode, decode)]
    assert ratios["dense"]["per_round"]["prefill_speedup"]["verdict"] == "tie"
    table = format_speed(out)
    assert "| dense |" in table and "| pruned |" in table and "reference" in table


def test_speedup_spread_median_quartiles_and_verdicts():
    # synthetic per-round times: a steady 2x win, with the reference disturbed in one round
    ref, fast = [10.0, 10.0, 10.0, 30.0, 10.0], [5.0, 5.0, 5.0, 5.0, 5.0]
    s = speedup_spread(ref, fast)
    assert s["rounds"] == [2.0, 2.0, 2.0, 6.0, 2.0]
    assert (s["median"], s["q1"], s["q3"], s["iqr"], s["verdict"]) == (2.0, 2.0, 2.0, 0.0, "faster")
    # a 5% median win inside rounds that disagree by 10% (IQR): a tie, not "faster"
    rounds = [1.05, 0.9, 1.15, 1.05, 1.3]
    noisy = speedup_spread([100.0] * 5, [100 / x for x in rounds])
    assert noisy["median"] == pytest.approx(1.05)
    assert (noisy["q1"], noisy["q3"], noisy["iqr"]) == pytest.approx((1.05, 1.15, 0.1))
    assert noisy["verdict"] == "tie"
    # the same spread around a clear loss
    slow = speedup_spread([100.0] * 5, [100 / (x - 0.3) for x in rounds])
    assert slow["median"] == pytest.approx(0.75) and slow["verdict"] == "slower"
    # decode times can be <= 0 under noise: those rounds are left out; one usable round gives no spread
    one = speedup_spread([10.0, -1.0, 10.0], [5.0, 5.0, 0.0])
    assert one["rounds"] == [2.0] and one["verdict"] == "undetermined" and math.isnan(one["iqr"])
    assert speedup_spread([], [])["verdict"] == "undetermined"
    with pytest.raises(ValueError, match="length"):
        speedup_spread([1.0, 2.0], [1.0])


def test_format_speed_reports_the_spread_and_ties():
    result = {
        "settings": {"prompt_len": 8, "new_tokens": 4, "batch_size": 1, "repeats": 5, "num_threads": 2},
        "models": {
            "dense": {"prefill_ms_median": 100.0, "decode_tokens_per_s": 20.0},
            "pruned": {"prefill_ms_median": 95.0, "decode_tokens_per_s": float("nan")},
        },
        "ratios": {
            "dense": {
                "per_round": {k: speedup_spread([1.0] * 5, [1.0] * 5) for k in ("prefill_speedup", "decode_speedup")}
            },
            "pruned": {
                "per_round": {
                    "prefill_speedup": speedup_spread([100.0] * 5, [100 / x for x in (1.05, 0.9, 1.15, 1.05, 1.3)]),
                    "decode_speedup": speedup_spread([10.0] * 5, [5.0] * 5),
                }
            },
        },
    }
    table = format_speed(result)
    assert "| pruned | 95.0 | n/a | 1.05x [1.05, 1.15] tie | 2.00x [2.00, 2.00] faster |" in table
    assert "| dense | 100.0 | 20.0 | reference | reference |" in table


def test_compare_speed_validates_arguments():
    with pytest.raises(ValueError):
        compare_speed({})
    with pytest.raises(ValueError, match="repeats"):
        compare_speed({"m": SleepyLM("m", 0, 0, [])}, repeats=0)


def test_a_busy_machine_is_measured_and_flagged_before_the_verdicts(monkeypatch, caplog):
    """The CPU time other processes take while the rounds run is measured (the machine's busy time less ours); when
    they take more than the CPUs left free, the result says so, by how much, before anything else."""
    import optimum_prune.evaluation.speed as speed

    log = []
    models = {"dense": SleepyLM("dense", 0.004, 0.012, log), "pruned": SleepyLM("pruned", 0.002, 0.006, log)}
    quiet = compare_speed(models, warmup=0, repeats=3)
    machine = quiet["settings"]["machine"]
    assert machine["cpus"] >= 1 and machine["threads"] == torch.get_num_threads()
    assert machine["other_processes_cpus"] is not None and machine["other_processes_cpus"] >= 0
    clock = {"busy": 0.0}

    def busy_cpu_seconds():  # other processes keep 8 CPUs busy: 8 CPU-seconds per second of wall time
        clock["busy"] = max(clock["busy"], 8 * time.perf_counter() + time.process_time())
        return clock["busy"]

    monkeypatch.setattr(speed, "_busy_cpu_seconds", busy_cpu_seconds)
    monkeypatch.setattr(speed.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    with caplog.at_level("WARNING"):
        loud = compare_speed(models, warmup=0, repeats=3)
    machine = loud["settings"]["machine"]
    assert machine["busy"] and machine["cpus"] == 2 and machine["other_processes_cpus"] == pytest.approx(8, rel=0.1)
    assert "unreliable" in caplog.text
    text = format_speed(loud)
    assert text.startswith("**UNRELIABLE: other processes used 8.0 of the 2 CPUs"), text
    assert text.splitlines()[1].startswith("pruned vs dense: prefill "), text  # then the verdict, then the table
    assert not format_speed(quiet).startswith("**UNRELIABLE") or quiet["settings"]["machine"]["busy"]
