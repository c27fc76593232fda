"""The cost model: workloads, sublayer variants, the analytic bytes / FLOP table against a hand computation, the
measured table's structure (no timing is asserted: timings belong in benchmarks/), prediction and JSON."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from optimum_prune.evaluation.cost_model import (
    NO_OP,
    CostTable,
    Workload,
    analytic_cost_table,
    assembled_model,
    attention_variants,
    check_cost_table,
    fit_cost_table,
    layer_row_of,
    measure_cost_table,
    mlp_variants,
    random_assemblies,
)
from optimum_prune.modeling.architectures import get_spec
from optimum_prune.modeling.shapes import layer_table


def smollm2_like(**kw):
    base = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
            "num_key_value_heads": 3, "head_dim": 64, "num_hidden_layers": 30}  # fmt: skip
    return transformers.LlamaConfig(**{**base, **kw})


def tiny(**kw):
    base = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 512, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 3}  # fmt: skip
    return transformers.LlamaConfig(**{**base, **kw})


def test_workloads_parse_and_refuse_nonsense():
    assert Workload.parse("decode:16:2048") == Workload("decode", 16, 2048)
    assert Workload("prefill", 2, 512).tokens == 1024 and Workload("decode", 16, 2048).tokens == 16
    for bad in ("decode:16", "train:1:1", "decode:x:1"):
        with pytest.raises(ValueError, match="phase"):
            Workload.parse(bad)
    with pytest.raises(ValueError, match=">= 1"):
        Workload("decode", 0, 10)


def test_variants_of_a_gqa_decoder():
    c = smollm2_like()
    assert attention_variants(c) == [3, 1, NO_OP]  # KV-head counts dividing the 9 query heads, at most 3
    assert mlp_variants(c) == [1536, 1280, 1024, 768, 512, 256, NO_OP]
    assert mlp_variants(smollm2_like(intermediate_size=1000)) == [1000, 768, 512, 256, NO_OP]
    assert attention_variants(tiny(num_key_value_heads=4)) == [4, 2, 1, NO_OP]


def test_analytic_table_is_the_bytes_and_flops_of_each_sublayer():
    c = smollm2_like()
    w = Workload("decode", 16, 2048)
    bw, tf = 50.0, 1.0
    t = analytic_cost_table(c, w, bandwidth_gbs=bw, tflops=tf, dtype_bytes=4)
    d, h, hd = 576, 9, 64
    for kv in (3, 1):
        params = d * h * hd * 2 + d * kv * hd * 2
        cache = 16 * 2048 * kv * hd * 2 * 4
        flops = 2 * params * 16 + 4 * 16 * h * hd * 2048
        want = max((params * 4 + cache) / (bw * 1e9), flops / (tf * 1e12))
        assert math.isclose(t.attention_s(kv), want, rel_tol=1e-12)
    assert math.isclose(t.mlp_s(768), max(3 * d * 768 * 4 / (bw * 1e9), 2 * 3 * d * 768 * 16 / 1e12), rel_tol=1e-12)
    assert t.attention_s(NO_OP) == 0 and t.mlp_s(NO_OP) == 0
    assert t.attention_s(1) < t.attention_s(3)  # fewer KV heads: a smaller cache to read
    prefill = analytic_cost_table(c, Workload("prefill", 1, 512), bandwidth_gbs=bw, tflops=tf)
    assert prefill.mlp_s(1536) == pytest.approx(2 * 3 * d * 1536 * 512 / 1e12)  # compute-bound


def test_prediction_sums_the_layers_and_interpolates_widths(tmp_path):
    w = Workload("decode", 1, 64)
    table = CostTable(w, {"2": 2.0, "1": 1.0, NO_OP: 0.0}, {"512": 5.0, "256": 3.0, NO_OP: 0.0}, fixed_s=10.0,
                      per_layer_s=0.5)  # fmt: skip
    c = tiny()
    rows = [layer_row_of(c, 2, 512), layer_row_of(c, NO_OP, 256), layer_row_of(c, 1, NO_OP)]
    assert table.predict(rows) == 10 + 3 * 0.5 + (2 + 5) + (0 + 3) + (1 + 0)
    assert table.mlp_s(384) == 4.0  # between 256 and 512
    with pytest.raises(KeyError, match="no attention variant 3"):
        table.attention_s(3)
    table.save(tmp_path / "t.json")
    again = CostTable.load(tmp_path / "t.json")
    assert again == table and again.predict(rows) == table.predict(rows)


def test_assembled_models_have_the_shapes_asked_for():
    c = tiny()
    rows = [layer_row_of(c, 2, 512), layer_row_of(c, NO_OP, 256), layer_row_of(c, 1, NO_OP)]
    model = assembled_model(c, rows)
    got = layer_table(model, get_spec(model))
    for want, have in zip(rows, got):
        for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            assert have[k] == want[k], (k, have, want)
    with torch.inference_mode():
        out = model(torch.randint(0, 256, (2, 8))).logits
    assert torch.isfinite(out).all()


def test_a_measured_table_covers_every_variant_and_predicts_assemblies():
    c = tiny()
    w = Workload("decode", 2, 32)
    table = measure_cost_table(c, w, layers=2, rounds=2, warmup=0, mlp=[512, 256, NO_OP])
    assert set(table.attention) == {"2", "1", NO_OP} and set(table.mlp) == {"512", "256", NO_OP}
    assert all(v >= 0 for v in [*table.attention.values(), *table.mlp.values()]) and table.source == "measured"
    assert table.info["median_s"]["empty"] > 0 and table.info["layers"] == 2
    models = {"dense": assembled_model(c, [layer_row_of(c, 2, 512)] * 3)}
    checked = check_cost_table(table, models, rounds=2, warmup=0)
    assert checked["dense"]["measured_s"] > 0 and math.isfinite(checked["dense"]["error"])
    with pytest.raises(ValueError, match="cost model"):
        measure_cost_table(transformers.BertConfig(), w)


def test_the_fit_recovers_costs_from_whole_assemblies_and_keeps_them_in_the_variants():
    """Step times that are exactly a sum of per-variant costs (another table's): the fit, from a wrong prior and a
    weak ridge, recovers those costs and predicts held-out assemblies (float64 least squares)."""
    config = smollm2_like(num_hidden_layers=6)
    w = Workload("decode", 16, 2048)
    truth = analytic_cost_table(config, w, bandwidth_gbs=20, tflops=0.5, sublayer_overhead_s=1e-4)
    prior = analytic_cost_table(config, w, bandwidth_gbs=60, tflops=2.0)  # off by ~3x
    fit_on, held_out = random_assemblies(config, 40, seed=0), random_assemblies(config, 5, seed=1)
    assert all(r["num_attention_heads"] > 0 for rows in fit_on for r in rows[:1])  # layer 0 keeps its attention
    assert all(r["intermediate_size"] > 0 or r["num_attention_heads"] == 0 for rows in fit_on for r in rows)
    fitted = fit_cost_table(prior, fit_on, [truth.predict(rows) for rows in fit_on], prior=1e-8)
    for rows in held_out:
        assert fitted.predict(rows) == pytest.approx(truth.predict(rows), rel=1e-4)
    assert max(abs(r) for r in fitted.info["fit"]["relative_residuals"]) < 1e-4
    assert fitted.attention[NO_OP] == 0.0 and fitted.mlp[NO_OP] == 0.0
    # a strong prior keeps the table's own values
    kept = fit_cost_table(prior, fit_on[:3], [truth.predict(rows) for rows in fit_on[:3]], prior=1e6)
    assert kept.mlp["1536"] == pytest.approx(prior.mlp["1536"], rel=1e-3)
    with pytest.raises(ValueError, match="one depth"):
        fit_cost_table(prior, [fit_on[0], fit_on[1][:3]], [1.0, 1.0])


class _SumRuntime:
    """A runtime whose step takes exactly a sum of known costs (`truth`'s) over the timed model's layers; with
    `skips=True` it runs like llama.cpp's deci graph: a layer without an MLP is skipped whole."""

    def __init__(self, truth: CostTable, skips: bool) -> None:
        self.truth, self.needs_mlp_beside_attention, self.label = truth, skips, "sum"
        self.closed = 0

    def step(self, model, workload, device):
        rows = layer_table(model, get_spec(model))
        kept = [r for r in rows if r["intermediate_size"] > 0] if self.needs_mlp_beside_attention else rows
        seconds = self.truth.predict(kept)
        runtime = self

        class Step:
            def __call__(self):
                return seconds

            def close(self):
                runtime.closed += 1

        return Step()


@pytest.mark.parametrize("skips", [False, True], ids=["transformers-like", "llama.cpp-like"])
def test_a_table_measured_in_a_runtime_recovers_its_costs_and_predicts_assemblies(skips):
    """Step times that are exactly sums of per-variant costs: the measured table predicts every valid assembly to
    float rounding, also where a layer without an MLP is skipped whole (attention timed beside the narrowest MLP, a
    whole first layer in front of each timed model), and every step is closed."""
    config = smollm2_like(num_hidden_layers=6)
    w = Workload("decode", 1, 2048)
    truth = analytic_cost_table(config, w, bandwidth_gbs=20, tflops=0.5, sublayer_overhead_s=1e-4)
    truth = CostTable(w, truth.attention, truth.mlp, fixed_s=0.003, per_layer_s=2e-5)
    runtime = _SumRuntime(truth, skips)
    table = measure_cost_table(config, w, layers=3, rounds=1, warmup=0, runtime=runtime)
    assert table.info["runtime"] == "sum" and runtime.closed == len(table.info["median_s"])
    for rows in random_assemblies(config, 10, seed=2):
        want = truth.predict([r for r in rows if r["intermediate_size"] > 0] if skips else rows)
        assert table.predict(rows) == pytest.approx(want, rel=1e-9, abs=1e-15)
    if skips:  # a kept layer's residual adds are in its MLP's cost: an empty layer costs nothing, as llama.cpp runs it
        assert table.per_layer_s == 0 and table.mlp_s(256) == pytest.approx(truth.mlp_s(256) + 2e-5)
    else:
        assert table.attention == pytest.approx(truth.attention) and table.per_layer_s == pytest.approx(2e-5)
    with pytest.raises(ValueError, match="runtime"):
        measure_cost_table(config, w, runtime="vllm")


def test_llamacpp_runtime_names_its_extra_and_refuses_what_it_cannot_time(monkeypatch):
    import sys

    from optimum_prune.export import LlamaCppRuntime

    with monkeypatch.context() as m:
        m.setitem(sys.modules, "llama_cpp", None)  # not installed
        with pytest.raises(ImportError, match=r"optimum-prune\[llamacpp\]"):
            LlamaCppRuntime(object())
    with pytest.raises(ValueError, match="tokenizer"):
        LlamaCppRuntime(None)
    pytest.importorskip("llama_cpp", reason="the llamacpp extra (llama-cpp-python) times the steps")
    with pytest.raises(ValueError, match="decode_tokens"):
        LlamaCppRuntime(object(), decode_tokens=0)
    runtime = LlamaCppRuntime(object())
    too_many = Workload("decode", runtime.llama_cpp.llama_max_parallel_sequences() + 1, 16)
    with pytest.raises(ValueError, match="sequences at once"):
        runtime.step(assembled_model(tiny(), [layer_row_of(tiny(), 2, 512)]), too_many, torch.device("cpu"))


def test_llamacpp_steps_run_a_pruned_shape_and_rewind_their_cache(smollm2_tokenizer):
    """In llama.cpp (the `llamacpp` extra): a prefill step evaluates every sequence's whole context from an empty
    cache and a decode timing `decode_tokens` tokens of every sequence from the context's position, every time, each
    sequence in its own KV stream; a table of every variant is measured there."""
    pytest.importorskip("llama_cpp", reason="the llamacpp extra (llama-cpp-python) times the steps")
    from optimum_prune.export import LlamaCppRuntime

    c = tiny(vocab_size=len(smollm2_tokenizer), intermediate_size=512)
    runtime = LlamaCppRuntime(smollm2_tokenizer, threads=1, decode_tokens=3)
    model = assembled_model(c, [layer_row_of(c, 2, 512), layer_row_of(c, NO_OP, 256), layer_row_of(c, 1, 256)])
    cases = [(Workload("prefill", 1, 16), 16), (Workload("decode", 1, 16), 19), (Workload("prefill", 3, 16), 16),
             (Workload("decode", 3, 16), 19)]  # fmt: skip
    for w, after in cases:
        step = runtime.step(model, w, torch.device("cpu"))
        lc = runtime.llama_cpp
        try:
            for _ in range(2):
                assert step() > 0
                ends = [lc.llama_memory_seq_pos_max(step._memory, s) + 1 for s in range(w.batch)]
                starts = [lc.llama_memory_seq_pos_min(step._memory, s) for s in range(w.batch)]
                assert ends == [after] * w.batch and starts == [0] * w.batch, (w.name, ends, starts)
        finally:
            step.close()
        assert not step._dir.exists()
    table = measure_cost_table(c, Workload("decode", 1, 16), layers=2, rounds=1, warmup=0, runtime=runtime)
    assert set(table.attention) == {"2", "1", NO_OP} and set(table.mlp) == {"512", "256", NO_OP}
    assert "llama.cpp" in table.info["runtime"] and table.info["median_s"]["skipped"] > 0
