"""Every public entry point of a bare install (the package without extras) on tiny random models built here from
configs (no Hub, no data wheels): text prune + save + reload + perplexity + LoRA recovery, an image model, GGUF
export, the console script; and the features of an extra that is absent fail with our error naming it.

Run by `tests/smoke/bare_install.sh` (`make smoke`) inside a fresh virtual environment; not a pytest module. Usage:
`python tests/smoke/bare_install.py WORK_DIR`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

TEXTS = [
    "The committee met on Tuesday to discuss the budget for the coming year and agreed on new spending limits.",
    "Shares rose sharply after the company reported record profits and announced a new line of products.",
    "The team won the final match in extra time, and the captain lifted the trophy in front of the home crowd.",
    "Researchers released a new version of the software that runs faster on older computers and phones.",
    "The film opened to strong reviews, and its lead actor was praised for a quiet and moving performance.",
    "Ministers said the new law would take effect next spring after a final vote in parliament this month.",
] * 4

EXTRAS = {"PIL": "vision", "scipy": "lsa", "lm_eval": "eval"}


def step(name: str, t0: list[float]) -> None:
    now = time.perf_counter()
    print(f"ok  {name} ({now - t0[0]:.1f}s)", flush=True)
    t0[0] = now


def tokenizer():
    """A byte-level BPE tokenizer trained here on the smoke texts (GGUF export needs a byte-level BPE)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(TEXTS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def text_model(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def vit_model():
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
                       image_size=16, patch_size=4, num_labels=3)  # fmt: skip
    torch.manual_seed(0)
    return ViTForImageClassification(config).eval()


def expect_extra(extra: str, fn) -> None:
    """`fn()` must fail with our ImportError naming `pip install 'optimum-prune[extra]'`."""
    try:
        fn()
    except ImportError as e:
        assert f"optimum-prune[{extra}]" in str(e), f"the error does not name the [{extra}] extra: {e}"
        return
    raise AssertionError(f"expected an ImportError naming the [{extra}] extra")


def main(work: Path) -> None:
    import gguf

    import optimum_prune
    from optimum_prune import (
        AutoPrunedModelForCausalLM,
        AutoPrunedModelForImageClassification,
        AutoPruner,
        CalibrationConfig,
        FinetuneConfig,
        NumericalConfig,
        WandaConfig,
        export_gguf,
        load_pruned_model,
    )
    from optimum_prune.evaluation import perplexity

    t0 = [time.perf_counter()]
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    installed = [m for m in EXTRAS if importlib.util.find_spec(m) is not None]
    assert not installed, f"not a bare install: {installed} importable (extras {[EXTRAS[m] for m in installed]})"
    print(f"optimum_prune {optimum_prune.__version__} from {Path(optimum_prune.__file__).parent}")

    # text: load from a directory, prune (structured, then unstructured), save, reload exactly
    tok = tokenizer()
    dense = work / "dense"
    text_model(len(tok)).save_pretrained(dense)
    tok.save_pretrained(dense)
    calibration = CalibrationConfig(dataset=TEXTS, num_samples=8, seq_len=32, batch_size=4)
    pruner = AutoPruner.from_pretrained(dense)
    report = pruner.prune(NumericalConfig(pruning_ratio=0.3, round_to=1), calibration=calibration)
    assert report.params_after < report.params_before
    pruner.prune(WandaConfig(sparsity=0.5), calibration=calibration)
    out = pruner.save_pretrained(work / "pruned")
    reloaded = AutoPrunedModelForCausalLM.from_pretrained(out)
    ids = tok(TEXTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, pruner.model(ids).logits)
    assert json.loads((out / "pruning_config.json").read_text())["history"][-1]["method"] == "wanda"
    step("text: prune (numerical + wanda), save, reload exactly", t0)

    ppl = perplexity(reloaded, tok, TEXTS, seq_len=32, max_tokens=256)
    assert ppl > 1, ppl
    ft = AutoPruner.from_pretrained(out).finetune(
        FinetuneConfig(method="lora", max_steps=2, batch_size=2, seq_len=32, eval_fraction=0.2, eval_max_tokens=64),
        TEXTS,
    )
    assert ft.perplexity_after > 0
    step("text: perplexity, LoRA recovery", t0)

    # GGUF export: the pruner's method (its tokenizer) and the function on a saved directory
    path = pruner.export_gguf(work / "pruned.gguf", outtype="f16")
    fields = gguf.GGUFReader(path).fields
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "deci"  # per-layer shapes
    export_gguf(out, work / "dir.gguf", "q8_0")
    step("GGUF export (AutoPruner.export_gguf, export_gguf(dir))", t0)

    # an image model saved without an image processor: no Pillow needed
    vit = work / "vit"
    vit_model().save_pretrained(vit)
    image_pruner = AutoPruner.from_pretrained(vit)
    assert image_pruner.tokenizer is None
    pixels = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    image_pruner.prune(NumericalConfig(pruning_ratio=0.3, round_to=1), calibration=pixels)
    vit_out = image_pruner.save_pretrained(work / "vit_pruned")
    vit_back = AutoPrunedModelForImageClassification.from_pretrained(vit_out)
    with torch.no_grad():
        torch.testing.assert_close(vit_back(pixels).logits, image_pruner.model(pixels).logits)
    from transformers import ViTForImageClassification

    assert isinstance(load_pruned_model(vit_out), ViTForImageClassification)
    step("vision: ViT prune on pixel values, save, reload exactly", t0)

    # the features of absent extras say which extra to install
    processor = {"image_processor_type": "ViTImageProcessor", "size": {"height": 16, "width": 16}}
    (vit / "preprocessor_config.json").write_text(json.dumps(processor))
    expect_extra("vision", lambda: AutoPruner.from_pretrained(vit))
    from optimum_prune.methods.ria.functional import ria_channel_reallocation

    expect_extra("lsa", lambda: ria_channel_reallocation(torch.rand(8, 16), 2, 4, lsa=True))
    data = work / "task.jsonl"
    data.write_text("".join(json.dumps({"q": t, "a": 0}) + "\n" for t in TEXTS[:4]))
    (work / "task.yaml").write_text(
        "task: smoke\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: task.jsonl\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_target: a\n"
        "doc_to_choice: ['yes', 'no']\n"
    )
    from optimum_prune.evaluation import zero_shot

    expect_extra("eval", lambda: zero_shot(reloaded, tok, [str(work / "task.yaml")]))
    step("absent extras named: vision, lsa, eval", t0)

    # the console script
    cli = shutil.which("optimum-prune")
    assert cli is not None, "the optimum-prune console script is not on PATH"
    help_text = subprocess.run([cli, "--help"], check=True, capture_output=True, text=True).stdout
    assert "prune" in help_text and "export-gguf" in help_text
    texts = work / "texts"
    texts.mkdir()
    for i, t in enumerate(TEXTS[:6]):
        (texts / f"{i}.txt").write_text(t * 3)
    env = {**os.environ, "PYTHONWARNINGS": "error::FutureWarning"}  # the CLI uses no deprecated name
    args = [cli, "prune", str(dense), "--method", "wanda", "--ratio", "0.5", "--calib", str(texts),
            "--num-samples", "4", "--seq-len", "32", "--batch-size", "2", "-o", str(work / "cli")]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["output"] == str((work / "cli").absolute())
    assert isinstance(AutoPrunedModelForCausalLM.from_pretrained(work / "cli"), torch.nn.Module)
    step("CLI: --help, prune", t0)
    print("bare-install smoke test passed")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("smoke_run"))
