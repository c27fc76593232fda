"""Sparsity survives training: SparsityCallback in a user's own Trainer (with and without it), full fine-tuning,
masked LoRA and masked merge (2:4 stays 2:4); PruningCallback one-shot and gradual (cubic schedule)."""

import pytest
import torch
from conftest import logits
from transformers import Trainer, TrainingArguments, default_data_collator

from optimum_prune import (
    FinetuneConfig,
    MagnitudeConfig,
    NumericalConfig,
    PruningCallback,
    SparsityCallback,
    finetune_,
    prune_,
)
from optimum_prune.finetune import cubic_sparsity, sparsity_masks
from optimum_prune.finetune.trainer import training_windows

FAST = {"max_steps": 3, "batch_size": 2, "seq_len": 32, "eval_max_tokens": 64, "eval_fraction": 0.2}


def _two_four(model):
    prune_(model, MagnitudeConfig(sparsity=0.5, pattern="2:4"))
    return model


def _valid_2_4(model) -> bool:
    for layer in model.model.layers:
        for m in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj, layer.mlp.gate_proj):
            nonzero = (m.weight != 0).view(m.weight.shape[0], -1, 4).sum(-1)
            if (nonzero > 2).any():
                return False
    return True


def _dataset(tok, docs):
    import datasets

    w = training_windows(docs, tok, 32)
    ds = datasets.Dataset.from_dict({"input_ids": w.tolist(), "labels": w.tolist()})
    ds.set_format("torch")
    return ds


def _train(model, tok, docs, tmp_path, callbacks, steps=3):
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-2,
        report_to=[], save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False,
    )  # fmt: skip
    model.train()
    Trainer(model=model, args=args, train_dataset=_dataset(tok, docs), data_collator=default_data_collator,
            callbacks=callbacks).train()  # fmt: skip
    return model.eval()


@pytest.mark.parametrize("with_callback", [True, False])
def test_sparsity_callback_in_a_users_own_trainer(make_tiny, smollm2_tokenizer, docs, tmp_path, with_callback):
    model = _two_four(make_tiny())
    masks = sparsity_masks(model)
    assert len(masks) == 14  # 7 projections x 2 layers
    callbacks = [SparsityCallback(model)] if with_callback else []
    _train(model, smollm2_tokenizer, docs, tmp_path, callbacks)
    revived = sum(int(m.get_submodule(".".join(k.split(".")[-2:])).weight[~v].ne(0).sum())
                  for k, v in masks.items() for m in [model.model.layers[int(k.split(".")[2])]])  # fmt: skip
    if with_callback:
        assert revived == 0 and _valid_2_4(model)
    else:  # the test can fail: plain training revives pruned weights
        assert revived > 0 and not _valid_2_4(model)


def test_full_finetuning_keeps_2_4(make_tiny, smollm2_tokenizer, docs):
    model = _two_four(make_tiny())
    masks = sparsity_masks(model)
    model, report = finetune_(
        model, FinetuneConfig(method="full", learning_rate=1e-2, **FAST), docs, smollm2_tokenizer
    )
    assert report.sparsity_kept is True and _valid_2_4(model)
    assert all(torch.equal(sparsity_masks(model)[k], v) for k, v in masks.items())


def test_lora_is_masked_during_training_and_merge(make_tiny, smollm2_tokenizer, docs):
    model = _two_four(make_tiny())
    masks = sparsity_masks(model)
    peft_model, _ = finetune_(model, FinetuneConfig(merge=False, learning_rate=1e-2, **FAST), docs, smollm2_tokenizer)
    ids = smollm2_tokenizer("Shares rose sharply on Monday.", return_tensors="pt").input_ids
    trained = logits(peft_model, ids)
    from optimum_prune.finetune import merge_masked_

    merged = merge_masked_(peft_model, masks)
    assert _valid_2_4(merged)
    assert all(torch.equal(sparsity_masks(merged)[k] | v, v) for k, v in masks.items())  # no zero revived
    # the merged plain model computes exactly what was trained (the masked update)
    torch.testing.assert_close(logits(merged, ids), trained, rtol=1e-4, atol=1e-4)


def test_keep_sparsity_false_lets_lora_densify(make_tiny, smollm2_tokenizer, docs):
    model = _two_four(make_tiny())
    model, report = finetune_(
        model, FinetuneConfig(keep_sparsity=False, learning_rate=1e-2, **FAST), docs, smollm2_tokenizer
    )
    assert report.sparsity_kept is None and not _valid_2_4(model)


def test_cubic_schedule():
    assert cubic_sparsity(0, 0, 100, 0.5) == 0.0
    assert cubic_sparsity(100, 0, 100, 0.5) == 0.5
    assert cubic_sparsity(50, 0, 100, 0.5) == pytest.approx(0.5 * (1 - 0.5**3))
    values = [cubic_sparsity(t, 10, 90, 0.6) for t in range(0, 120, 5)]
    assert values == sorted(values) and values[0] == 0 and values[-1] == 0.6


def test_pruning_callback_gradual(make_tiny, smollm2_tokenizer, docs, tmp_path):
    model = make_tiny()
    cb = PruningCallback(MagnitudeConfig(sparsity=0.5, pattern="unstructured"), schedule=(1, 4, 0.5, 1))
    assert list(cb.steps) == [2, 3, 4] and cb.steps[4] == 0.5  # s(start_step) = 0: nothing to prune yet
    _train(model, smollm2_tokenizer, docs, tmp_path, [cb], steps=6)
    measured = [r.measured for r in cb.reports]
    assert len(measured) == 3 and measured == sorted(measured) and measured[0] > 0
    assert measured[-1] == pytest.approx(0.5, abs=1e-3)
    w = model.model.layers[0].mlp.up_proj.weight
    assert float((w == 0).float().mean()) == pytest.approx(0.5, abs=1e-2)  # kept after the last pruning step


def test_pruning_callback_gradual_n_m_ends_2_4(make_tiny, smollm2_tokenizer, docs, tmp_path):
    model = make_tiny()
    cb = PruningCallback(MagnitudeConfig(sparsity=0.5, pattern="2:4"), schedule=(0, 2, 0.5, 1))
    _train(model, smollm2_tokenizer, docs, tmp_path, [cb], steps=4)
    assert [r.config["pattern"] for r in cb.reports] == ["unstructured", "2:4"]
    assert _valid_2_4(model)


def test_pruning_callback_one_shot_with_calibration(make_tiny, smollm2_tokenizer, docs, tmp_path):
    from optimum_prune import CalibrationConfig, WandaConfig

    model = make_tiny()
    cal = CalibrationConfig(dataset=docs, num_samples=2, seq_len=32)
    cb = PruningCallback(WandaConfig(sparsity=0.4), schedule=2, calibration=cal, tokenizer=smollm2_tokenizer)
    _train(model, smollm2_tokenizer, docs, tmp_path, [cb], steps=4)
    assert len(cb.reports) == 1 and cb.reports[0].measured == pytest.approx(0.4, abs=0.01)
    assert float((model.model.layers[1].mlp.down_proj.weight == 0).float().mean()) == pytest.approx(0.4, abs=1e-2)


def test_pruning_callback_refuses_structured_and_bad_schedules():
    with pytest.raises(ValueError, match="Prune before training"):
        PruningCallback(NumericalConfig(pruning_ratio=0.2))
    with pytest.raises(ValueError, match="schedule"):
        PruningCallback(MagnitudeConfig(sparsity=0.5, pattern="unstructured"), schedule=(0, 10))
    with pytest.raises(ValueError, match="fixes the final sparsity"):
        PruningCallback(MagnitudeConfig(sparsity=0.5, pattern="2:4"), schedule=(0, 10, 0.7, 2))
