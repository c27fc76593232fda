"""Recovery sized in tokens: `token_budget` (steps derived), `eval_at_tokens` (a curve from one run), `streaming`
(documents read while training, split by index like the in-memory path) and resuming a streamed run."""

import json
import logging

import pytest
import torch
from conftest import logits
from transformers import TrainerCallback

from optimum_prune import FinetuneConfig, finetune_
from optimum_prune.calibration.corpora import split_indices
from optimum_prune.calibration.data import split_documents
from optimum_prune.finetune.stream import DocumentIndex, TokenWindows


class _StopAt(TrainerCallback):
    """Stops a run after `step` optimizer steps, as an interruption would."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


FAST = {"batch_size": 2, "seq_len": 32, "eval_max_tokens": 64, "eval_fraction": 0.2, "lora_dropout": 0.0}


def test_token_budget_sets_the_steps_and_refuses_a_contradicting_step_count():
    cfg = FinetuneConfig(token_budget=1000, batch_size=2, seq_len=32, gradient_accumulation_steps=3)
    assert cfg.tokens_per_step == 192 and cfg.max_steps == 6  # ceil(1000 / 192)
    assert FinetuneConfig.from_dict(cfg.to_dict()) == cfg  # the derived step count round-trips
    with pytest.raises(ValueError, match="pass one of them"):
        FinetuneConfig(token_budget=1000, max_steps=5, batch_size=2, seq_len=32)
    with pytest.raises(ValueError, match="token_budget must be an int >= 1"):
        FinetuneConfig(token_budget=0)
    with pytest.raises(ValueError, match="eval_at_tokens"):
        FinetuneConfig(eval_at_tokens=(0, 10))
    assert FinetuneConfig(eval_at_tokens=[64, 32, 64]).eval_at_tokens == (32, 64)


def test_split_indices_is_split_documents_split():
    docs = [f"d{i}" for i in range(23)]
    kept, held = split_indices(len(docs), 0.3, seed=4)
    assert split_documents(docs, 0.3, 4, shuffle_held_out=False) == ([docs[i] for i in kept], [docs[i] for i in held])


def test_document_index_reads_a_directory_and_a_jsonl_lazily(tmp_path):
    texts = ["first document", "second one", "a third"]
    (tmp_path / "d").mkdir()
    for i, t in enumerate(texts):
        (tmp_path / "d" / f"{i:02d}.txt").write_text(t)
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n\n" for t in texts))
    for source in (tmp_path / "d", tmp_path / "t.jsonl", texts):
        idx = DocumentIndex(source)
        assert len(idx) == 3 and [idx[i] for i in range(3)] == texts
    rows = DocumentIndex(__import__("datasets").Dataset.from_dict({"text": texts}))
    assert len(rows) == 3 and [rows[i] for i in range(3)] == texts
    with pytest.raises(ValueError, match="no column"):
        DocumentIndex(__import__("datasets").Dataset.from_dict({"body": texts}))


def test_token_windows_pack_every_document_once_per_pass_in_a_new_order(smollm2_tokenizer, docs):
    windows = TokenWindows(docs, list(range(10)), smollm2_tokenizer, 16, seed=1)
    first = [w["input_ids"] for w in windows]
    assert all(w.shape == (16,) for w in first) and all(torch.equal(w, x["input_ids"]) for w, x in zip(first, windows))
    windows.set_epoch(1)
    assert windows.order() != TokenWindows(docs, list(range(10)), smollm2_tokenizer, 16, seed=1).order()
    assert sorted(windows.order()) == list(range(10))
    total = sum(len(smollm2_tokenizer(docs[i], add_special_tokens=False)["input_ids"]) for i in range(10))
    assert len(first) == pytest.approx(total / 16, abs=10 / 16 + 2)  # separators between documents


def test_eval_at_tokens_records_a_curve_that_ends_where_the_run_ends(
    make_tiny, smollm2_tokenizer, learnable_docs, caplog
):
    cfg = FinetuneConfig(method="full", learning_rate=1e-3, token_budget=8 * 64, eval_at_tokens=(64, 256), **FAST)
    with caplog.at_level("INFO", logger="optimum_prune.finetune.progress"):
        model, report = finetune_(make_tiny(), cfg, learnable_docs, smollm2_tokenizer)
    progress = [r.getMessage() for r in caplog.records if "tokens/s" in r.getMessage()]
    assert progress and progress[-1].startswith("512 / 512 training tokens (step 8 / 8)")  # with throughput and ETA
    assert len(progress) == len(set(progress))  # each logged step once
    assert report.config["max_steps"] == 8 and report.tokens_seen == 512
    assert [p["tokens"] for p in report.curve] == [64, 256, 512] and [p["step"] for p in report.curve] == [1, 4, 8]
    assert report.curve[-1]["perplexity"] == pytest.approx(report.perplexity_after, rel=1e-5)
    ppl = [p["perplexity"] for p in report.curve]
    assert ppl[-1] < ppl[0] < report.perplexity_before  # it learns along the way
    assert all(b["elapsed_s"] >= a["elapsed_s"] for a, b in zip(report.curve, report.curve[1:]))


def test_checkpoint_evaluations_are_not_counted_as_training_time(make_tiny, smollm2_tokenizer, learnable_docs,
                                                                  monkeypatch):  # fmt: skip
    import time

    from optimum_prune.finetune import trainer

    slow = trainer._ppl

    def _ppl(*args, **kwargs):
        time.sleep(0.5)
        return slow(*args, **kwargs)

    from transformers import Trainer

    train, walls = Trainer.train, []

    def timed_train(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = train(self, *args, **kwargs)
        walls.append(time.perf_counter() - t0)
        return out

    monkeypatch.setattr(trainer, "_ppl", _ppl)
    monkeypatch.setattr(Trainer, "train", timed_train)
    cfg = FinetuneConfig(method="full", learning_rate=1e-3, token_budget=4 * 64, eval_at_tokens=(64, 128), **FAST)
    _, report = finetune_(make_tiny(), cfg, learnable_docs, smollm2_tokenizer)
    assert len(report.curve) == 3 and report.checkpoint_eval_s >= 1.5  # three checkpoints, each >= 0.5 s
    assert report.train_runtime_s == pytest.approx(walls[0] - report.checkpoint_eval_s, abs=0.2)


def test_streaming_trains_from_a_folder_and_resumes_to_the_same_weights(make_tiny, smollm2_tokenizer, docs, tmp_path):
    folder = tmp_path / "text"
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"{i:03d}.txt").write_text(d)
    base = {**FAST, "method": "full", "learning_rate": 1e-3, "streaming": True, "max_steps": 6}
    straight, report = finetune_(make_tiny(), FinetuneConfig(**base), str(folder), smollm2_tokenizer)
    assert report.train_tokens is None and report.data["streaming"] and report.tokens_seen == 6 * 64
    assert report.eval_documents == round(0.2 * len(docs))
    ckpt = tmp_path / "ckpt"
    saving = {**base, "output_dir": str(ckpt), "training_args": {"save_strategy": "steps", "save_steps": 3}}
    finetune_(make_tiny(), FinetuneConfig(**saving), str(folder), smollm2_tokenizer, callbacks=[_StopAt(3)])
    assert sorted(p.name for p in ckpt.iterdir()) == ["checkpoint-3"]  # interrupted after its first checkpoint
    resumed_cfg = FinetuneConfig(**{**saving, "resume_from_checkpoint": str(ckpt / "checkpoint-3")})
    resumed, _ = finetune_(make_tiny(), resumed_cfg, str(folder), smollm2_tokenizer)
    ids = smollm2_tokenizer(docs[0][:200], return_tensors="pt").input_ids
    torch.testing.assert_close(logits(resumed, ids), logits(straight, ids), rtol=1e-5, atol=1e-5)


def test_streaming_refuses_too_little_text_before_training(make_tiny, smollm2_tokenizer):
    model = make_tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="do not fill one sequence"):
        finetune_(model, FinetuneConfig(streaming=True, **FAST), ["a b", "c d", "e f"] * 2, smollm2_tokenizer)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("native", [True, False])
def test_bf16_on_a_cpu_without_native_bf16_is_warned(monkeypatch, caplog, tmp_path, native):
    """bf16 autocast is emulated (far slower than fp32) on a CPU without AVX512-BF16 / AMX: the log says so."""
    from optimum_prune.utils import training

    monkeypatch.setattr(training, "cpu_has_native_bf16", lambda: native)
    with caplog.at_level(logging.WARNING, logger="optimum_prune.utils.training"):
        args = training.build_training_arguments({"output_dir": str(tmp_path)}, {"bf16": True, "use_cpu": True}, "X")
    assert args.bf16
    assert ("without native bf16" in caplog.text) is (not native)


def test_for_budget_takes_the_nearest_measured_budgets_recipe(monkeypatch):
    from optimum_prune.finetune import budgets

    kd = {"method": "full", "distill": "kl", "learning_rate": 3e-4, "batch_size": 2, "seq_len": 512}
    lora = {"method": "lora", "learning_rate": 1e-3, "lora_dropout": 0.0, "batch_size": 2, "seq_len": 512}
    monkeypatch.setattr(budgets, "BUDGET_RECIPES", {4096: (kd, lora), 262_144: (lora,)})
    cfg = FinetuneConfig.for_budget(3000)
    assert (cfg.method, cfg.distill, cfg.learning_rate, cfg.token_budget) == ("full", "kl", 3e-4, 3000)
    assert cfg.max_steps == 3 and cfg.warmup_steps == 1  # ceil(3000 / 1024) steps, 5% warm-up, at least one step
    no_teacher = FinetuneConfig.for_budget(3000, distill=False)  # no teacher at hand: the best without distillation
    assert (no_teacher.method, no_teacher.distill, no_teacher.lora_dropout) == ("lora", None, 0.0)
    far = FinetuneConfig.for_budget(100_000, streaming=True, batch_size=4)  # nearer 262k than 4k on a log scale
    assert (far.method, far.batch_size, far.streaming, far.max_steps) == ("lora", 4, True, 49)
    assert far.warmup_steps == 2 and FinetuneConfig.for_budget(100_000, warmup_steps=0).warmup_steps == 0
    assert budgets.BUDGET_RECIPES[4096][0] == kd  # the table is not changed by a call
    with pytest.raises(ValueError, match="positive number of training tokens"):
        FinetuneConfig.for_budget(0)
    with pytest.raises(ValueError, match="Unknown FinetuneConfig field"):
        FinetuneConfig.for_budget(4096, learning_rat=1e-3)


def test_the_budget_recipes_are_the_screens_picks():
    """Every measured budget's first recipe is the one its selection-split record names best, and each budget
    has a recipe without distillation."""
    import re
    from pathlib import Path

    from optimum_prune.finetune.budgets import BUDGET_RECIPES, MEASURED_IN

    record = (Path(__file__).resolve().parents[2] / MEASURED_IN).read_text(encoding="utf-8")
    picks = {int(b.replace(",", "")): (label, float(lr))
             for b, label, lr in re.findall(r"- ([\d,]+) tokens, best recipe: (.+?), lr ([\d.e-]+) \(", record)}  # fmt: skip
    assert picks and picks.keys() == BUDGET_RECIPES.keys()
    names = {"LoRA r=16": ("lora", None), "full": ("full", None), "full + KD": ("full", "kl")}
    for budget, recipes in BUDGET_RECIPES.items():
        label, lr = picks[budget]
        best = FinetuneConfig.for_budget(budget)
        assert (best.method, best.distill, best.learning_rate) == (*names[label], lr)
        assert any(r.get("distill") is None for r in recipes)
