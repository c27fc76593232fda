"""finetune_ / AutoPruner.finetune: LoRA (merged or saved as an adapter) and full fine-tuning on pruned tiny models,
distillation, the report in pruning_config.json, and bad input (clear errors, nothing changed)."""

import copy
import json

import pytest
import torch
from conftest import logits
from peft import PeftModel

from optimum_prune import (
    AutoPrunedModelForCausalLM,
    AutoPruner,
    FinetuneConfig,
    MagnitudeConfig,
    finetune_,
    prune_,
)
from optimum_prune.finetune.adapters import merge_adapter
from optimum_prune.finetune.engine import DistillationTrainer, hidden_state_loss

FAST = {"max_steps": 2, "batch_size": 2, "seq_len": 32, "eval_max_tokens": 64, "eval_fraction": 0.2}
# Enough steps on `learnable_docs` for training to show: measured (seed 0) held-out perplexity 49.5k -> 23.6k (LoRA,
# lr 1e-2) and -> 21.8k (full, lr 1e-3), logged loss 10.83 -> 10.04 / 9.96; untrained (lr ~ 0) both stay put.
LEARN = {**FAST, "max_steps": 8}


def _assert_learned(report, ppl_factor=0.7, loss_drop=0.3):
    """Fine-tuning fitted its (repetitive) text: held-out perplexity down by 30% and the logged loss by 0.3 nats."""
    assert report.perplexity_after < ppl_factor * report.perplexity_before, (
        report.perplexity_before,
        report.perplexity_after,
    )
    losses = [h["loss"] for h in report.loss_history]
    assert len(losses) == report.config["max_steps"] and losses[-1] < losses[0] - loss_drop, losses


def _structured(model):
    # global allocation: the two layers end with different shapes
    prune_(model, MagnitudeConfig(pruning_ratio=0.4, allocation="global", round_to=1))
    return model


def _ids(tok):
    return tok("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same_state(model, state):
    sd = model.state_dict()
    return set(sd) == set(state) and all(torch.equal(sd[k], state[k]) for k in state)


def test_lora_on_per_layer_shapes_merges_into_a_plain_checkpoint(
    make_tiny, smollm2_tokenizer, learnable_docs, tmp_path
):
    model = _structured(make_tiny())
    shapes = [layer.mlp.up_proj.out_features for layer in model.model.layers]
    assert len(set(shapes)) > 1
    before = _state(model)
    pruner = AutoPruner(model, smollm2_tokenizer)
    report = pruner.finetune(FinetuneConfig(method="lora", learning_rate=1e-2, **LEARN), learnable_docs)
    assert report.merged and report.trainable_params > 0 and report.train_documents + report.eval_documents == 10
    _assert_learned(report)
    merged = pruner.model
    assert not any("lora" in n for n, _ in merged.named_modules())
    assert set(merged.state_dict()) == set(before)  # a plain model of the same shapes
    assert any(not torch.equal(merged.state_dict()[k], before[k]) for k in before)  # training changed it
    out = pruner.save_pretrained(tmp_path / "out")
    side = json.loads((out / "pruning_config.json").read_text())
    assert side["finetune"][0]["perplexity_after"] == pytest.approx(report.perplexity_after)
    assert side["history"][0]["method"] == "magnitude"
    reloaded = AutoPrunedModelForCausalLM.from_pretrained(out)
    ids = _ids(smollm2_tokenizer)
    torch.testing.assert_close(logits(reloaded, ids), logits(merged, ids))
    assert reloaded._optimum_prune_finetune[0]["config"]["method"] == "lora"


def test_the_report_counts_the_held_out_tokens_scored(make_tiny, smollm2_tokenizer, docs):
    """`eval_tokens`: the held-out documents' tokens (joined as the perplexity reads them), capped by
    `eval_max_tokens`."""
    from optimum_prune.calibration.data import DOCUMENT_SEPARATOR, split_documents

    _, held_out = split_documents(docs, FAST["eval_fraction"], 0, shuffle_held_out=False)
    want = len(smollm2_tokenizer(DOCUMENT_SEPARATOR.join(held_out))["input_ids"])
    assert want > FAST["eval_max_tokens"]
    full = finetune_(make_tiny(), FinetuneConfig(**{**FAST, "eval_max_tokens": None}), docs, smollm2_tokenizer)[1]
    capped = finetune_(make_tiny(), FinetuneConfig(**FAST), docs, smollm2_tokenizer)[1]
    assert (full.eval_tokens, full.eval_documents) == (want, len(held_out))
    assert capped.eval_tokens == FAST["eval_max_tokens"]


def test_merge_false_saves_a_peft_adapter_that_loads_on_the_pruned_base(make_tiny, smollm2_tokenizer, docs, tmp_path):
    model = _structured(make_tiny())
    model, report = finetune_(model, FinetuneConfig(merge=False, learning_rate=1e-2, **FAST), docs, smollm2_tokenizer)
    assert isinstance(model, PeftModel) and not report.merged
    ids = _ids(smollm2_tokenizer)
    expected = logits(model, ids)
    out = AutoPruner(model, smollm2_tokenizer).save_pretrained(tmp_path / "out")
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "model.safetensors").is_file()
    assert any("lora" in n for n, _ in model.named_modules())  # the in-memory PEFT model is intact
    base = AutoPrunedModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(logits(PeftModel.from_pretrained(base, out / "adapter"), ids), expected)
    # merging the saved adapter gives the same function in plain weights
    merged = merge_adapter(AutoPrunedModelForCausalLM.from_pretrained(out), out / "adapter")
    torch.testing.assert_close(logits(merged, ids), expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="already carries a PEFT adapter"):
        finetune_(model, FinetuneConfig(**FAST), docs, smollm2_tokenizer)


def test_merge_adapter_refuses_a_model_pruned_differently(make_tiny, smollm2_tokenizer, docs, tmp_path):
    model, _ = finetune_(_structured(make_tiny()), FinetuneConfig(merge=False, **FAST), docs, smollm2_tokenizer)
    out = AutoPruner(model, smollm2_tokenizer).save_pretrained(tmp_path / "out")
    other = make_tiny()
    prune_(other, MagnitudeConfig(pruning_ratio=0.2, allocation="uniform"))
    state = _state(other)
    with pytest.raises(ValueError, match="does not fit this model's shapes"):
        merge_adapter(other, out / "adapter")
    assert _same_state(other, state) and not any("lora" in n for n, _ in other.named_modules())


def test_full_finetuning_trains_every_parameter(make_tiny, smollm2_tokenizer, learnable_docs):
    model = _structured(make_tiny())
    n = sum(p.numel() for p in model.parameters())
    model, report = finetune_(
        model, FinetuneConfig(method="full", learning_rate=1e-3, **LEARN), learnable_docs, smollm2_tokenizer
    )
    assert report.trainable_params == n and report.tokens_seen == 8 * 2 * 32
    _assert_learned(report)


def _kl(teacher, student, ids):
    """Mean KL(teacher || student) per position of the next-token distributions."""
    log_t, log_s = logits(teacher, ids).log_softmax(-1), logits(student, ids).log_softmax(-1)  # (1, T, V)
    return (log_t.exp() * (log_t - log_s)).sum(-1).mean().item()


def test_distillation_uses_the_unpruned_model_as_teacher(make_tiny, smollm2_tokenizer, learnable_docs, monkeypatch):
    dense = make_tiny()
    with torch.no_grad():  # peaked outputs, so that pruning moves them far enough for the KL to have something to fit
        dense.lm_head.weight.mul_(30)
    pruner = AutoPruner(dense, smollm2_tokenizer, keep_teacher=True)  # a CPU copy is kept before the first pruning
    pruner.prune(MagnitudeConfig(pruning_ratio=0.4))
    teacher = pruner.teacher()
    assert teacher.model.layers[0].mlp.up_proj.out_features == 128  # unpruned
    seen = {}
    original = DistillationTrainer.compute_loss

    def spy(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        seen["teacher"] = self.teacher
        return original(self, model, inputs, return_outputs, num_items_in_batch)

    monkeypatch.setattr(DistillationTrainer, "compute_loss", spy)
    ids = smollm2_tokenizer(learnable_docs[0], return_tensors="pt").input_ids[:, :64]
    kl_before = _kl(teacher, pruner.model, ids)
    config = FinetuneConfig(distill="kl", distill_alpha=1.0, learning_rate=3e-3, **LEARN)
    report = pruner.finetune(config, learnable_docs)
    assert seen["teacher"] is teacher and report.teacher["source"].startswith("copy of the in-memory model")
    # pure KL pulls the pruned student towards the teacher: measured KL 0.818 -> 0.723 (-12%); untrained it stays put
    assert _kl(teacher, pruner.model, ids) < 0.95 * kl_before


def test_distillation_loss_is_zero_when_student_equals_teacher(make_tiny, smollm2_tokenizer):
    model = make_tiny()
    trainer = DistillationTrainer.__new__(DistillationTrainer)
    trainer.teacher, trainer.temperature, trainer.alpha, trainer.hidden_weight = copy.deepcopy(model), 2.0, 1.0, 0.0
    ids = _ids(smollm2_tokenizer)
    loss = trainer.compute_loss(model, {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)})
    assert abs(loss.item()) < 1e-5


def test_hidden_state_loss_matches_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    student = [torch.randn(2, 5, 8, generator=g) for _ in range(3)]
    teacher = [torch.randn(2, 5, 8, generator=g) * (i + 1) for i in range(3)]
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    ref = []
    for hs, ht in zip(student, teacher):  # the loop written out: every kept token's relative squared error
        errs = [((hs[b, i].double() - ht[b, i].double()) ** 2).sum() / (ht[b, i].double() ** 2).sum()
                for b in range(2) for i in range(5) if mask[b, i]]  # fmt: skip
        ref.append(sum(errs) / len(errs))
    assert hidden_state_loss(student, teacher, mask).item() == pytest.approx((sum(ref) / 3).item(), rel=1e-5)
    assert hidden_state_loss(teacher, teacher, mask).item() == 0.0


def test_distillation_loss_with_hidden_states_is_the_written_formula(make_tiny, smollm2_tokenizer):
    """alpha · T² · KL + (1 − alpha) · LM + w · hidden, each term recomputed in float64 from the two models."""
    teacher, student = make_tiny(seed=0), make_tiny(seed=1)
    trainer = DistillationTrainer.__new__(DistillationTrainer)
    trainer.teacher, trainer.temperature, trainer.alpha, trainer.hidden_weight = teacher, 2.0, 0.3, 0.7
    ids = _ids(smollm2_tokenizer)
    mask = torch.ones_like(ids)
    loss = trainer.compute_loss(student, {"input_ids": ids, "labels": ids, "attention_mask": mask})
    with torch.no_grad():
        s, t = (copy.deepcopy(m).double()(ids, labels=ids, output_hidden_states=True) for m in (student, teacher))
    p_t, log_s = (t.logits / 2).softmax(-1), (s.logits / 2).log_softmax(-1)
    kl = (p_t * (p_t.log() - log_s)).sum(-1).mean()
    hidden = torch.stack([((hs - ht) ** 2).sum(-1).div((ht**2).sum(-1)).mean()
                          for hs, ht in zip(s.hidden_states[1:], t.hidden_states[1:])]).mean()  # fmt: skip
    expected = 0.3 * 4 * kl + 0.7 * s.loss + 0.7 * hidden
    assert hidden > 0.1 and loss.item() == pytest.approx(expected.item(), rel=1e-4)


def test_hidden_state_distillation_pulls_every_layer_towards_the_teacher(make_tiny, smollm2_tokenizer, learnable_docs):
    dense = make_tiny()
    pruner = AutoPruner(dense, smollm2_tokenizer, keep_teacher=True)
    pruner.prune(MagnitudeConfig(pruning_ratio=0.4))  # width pruning: same depth and hidden size as the teacher
    teacher = pruner.teacher()
    ids = smollm2_tokenizer(learnable_docs[0], return_tensors="pt").input_ids[:, :64]

    def hidden_error():
        with torch.no_grad():
            s, t = (m(ids, output_hidden_states=True).hidden_states[1:] for m in (pruner.model, teacher))
        return hidden_state_loss(s, t).item()

    before = hidden_error()
    config = FinetuneConfig(distill="kl", distill_alpha=1.0, distill_hidden_weight=10.0, learning_rate=3e-3, **LEARN)
    report = pruner.finetune(config, learnable_docs)
    assert report.config["distill_hidden_weight"] == 10.0
    assert hidden_error() < 0.9 * before


def test_hidden_state_distillation_refuses_a_teacher_of_another_depth(make_tiny, smollm2_tokenizer, docs):
    model = make_tiny()
    state = _state(model)
    config = FinetuneConfig(distill="kl", distill_hidden_weight=1.0, **FAST)
    with pytest.raises(ValueError, match=r"\(2, 64\) and the teacher \(3, 64\).*distill_hidden_weight=0"):
        finetune_(model, config, docs, smollm2_tokenizer, teacher=make_tiny(num_hidden_layers=3))
    assert _same_state(model, state)


def test_in_memory_model_keeps_no_teacher_unless_asked(make_tiny, smollm2_tokenizer, docs):
    """No silent copy (it doubles the memory): distillation without one says how to get a teacher, and trains nothing."""
    pruner = AutoPruner(make_tiny(), smollm2_tokenizer)
    pruner.prune(MagnitudeConfig(pruning_ratio=0.4))
    assert pruner._teacher is None
    state = _state(pruner.model)
    with pytest.raises(ValueError, match=r"keep_teacher=True.*from_pretrained\(path\).*teacher="):
        pruner.finetune(FinetuneConfig(distill="kl", **FAST), docs)
    assert _same_state(pruner.model, state) and not pruner.finetune_reports
    # an explicit teacher still works, and it is the one distilled from (distill_alpha=1: the loss is the KL alone):
    # the pruned model as its own teacher leaves a zero loss, the dense model (seed 0) a positive one
    kl_only = FinetuneConfig(distill="kl", distill_alpha=1.0, **FAST)
    assert pruner.finetune(kl_only, docs, teacher=copy.deepcopy(pruner.model)).train_loss < 1e-6
    assert pruner.finetune(kl_only, docs, teacher=make_tiny()).train_loss > 1e-3


def test_autopruner_from_path_reloads_the_teacher(make_tiny, smollm2_tokenizer, tmp_path):
    make_tiny().save_pretrained(tmp_path / "dense")
    smollm2_tokenizer.save_pretrained(tmp_path / "dense")
    pruner = AutoPruner.from_pretrained(tmp_path / "dense")
    pruner.prune(MagnitudeConfig(pruning_ratio=0.4))
    assert pruner._teacher is None  # nothing kept in memory until distillation needs it
    teacher = pruner.teacher()
    assert teacher.model.layers[0].mlp.up_proj.out_features == 128


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"max_steps": 0}, "max_steps must be > 0"),
        ({"method": "qlora"}, "method must be"),
        ({"distill": "mse"}, "distill must be"),
        ({"distill_hidden_weight": 1.0}, r"set distill='kl'"),
        ({"distill": "kl", "distill_hidden_weight": -1.0}, "distill_hidden_weight must be"),
        ({"eval_fraction": 1.0}, "eval_fraction"),
    ],
)
def test_config_rejects_bad_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        FinetuneConfig(**overrides)


@pytest.mark.parametrize(
    "config, data, match",
    [
        (FinetuneConfig(**FAST), [], "No non-empty documents"),
        (FinetuneConfig(**FAST), ["a b c", "d e f"], "Training text too short"),
        (FinetuneConfig(**FAST), ["only one document " * 50], "at least 2 documents"),
        (FinetuneConfig(target_modules=("c_attn",), **FAST), None, "target_modules"),
        (FinetuneConfig(distill="kl", **FAST), None, "needs a teacher"),
    ],
)
def test_bad_input_leaves_the_model_untouched(make_tiny, smollm2_tokenizer, docs, config, data, match):
    model = _structured(make_tiny())
    state = _state(model)
    with pytest.raises(ValueError, match=match):
        finetune_(model, config, docs if data is None else data, smollm2_tokenizer)
    assert _same_state(model, state) and not any("lora" in n for n, _ in model.named_modules())


def test_teacher_with_another_vocabulary_is_refused(make_tiny, smollm2_tokenizer, docs):
    model = make_tiny()
    teacher = make_tiny(vocab_size=len(smollm2_tokenizer) + 8)
    with pytest.raises(ValueError, match="vocabulary"):
        finetune_(model, FinetuneConfig(distill="kl", **FAST), docs, smollm2_tokenizer, teacher=teacher)


def test_lora_on_pruned_head_dimensions(make_tiny, smollm2_tokenizer, learnable_docs, tmp_path):
    """SPP leaves q/k and v/o head widths of their own in every layer: LoRA trains and merges on them, reload is exact."""
    from testing_utils import calibration_ids

    from optimum_prune import SPPConfig

    model = make_tiny()
    spp = {"steps": 6, "lr": 0.08, "lambda_": 0.3, "betas": (0.5, 0.9), "round_to": 1, "head_dim_multiple": 2}
    spp["prune_attention"] = True  # (the head dimensions, which a language model's default keeps)
    prune_(model, SPPConfig(pruning_ratio=0.3, extrapolate=True, **spp), calibration_ids())
    assert model.model.layers[0].self_attn.qk_head_dim < 16 or model.model.layers[0].self_attn.vo_head_dim < 16
    pruner = AutoPruner(model, smollm2_tokenizer, keep_teacher=False)
    report = pruner.finetune(FinetuneConfig(method="lora", learning_rate=1e-2, **LEARN), learnable_docs)
    assert report.merged
    _assert_learned(report)
    out = pruner.save_pretrained(tmp_path / "out")
    ids = _ids(smollm2_tokenizer)
    torch.testing.assert_close(logits(AutoPrunedModelForCausalLM.from_pretrained(out), ids), logits(pruner.model, ids))
