"""`optimum-prune finetune | push | eval --tasks` and `optimum-cli prune` (registered through optimum.commands.register)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi

from optimum_prune.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pruned_dir(tmp_path_factory, smollm2_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    from optimum_prune import AutoPruner, MagnitudeConfig

    config = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("cli_recovery")
    dense = LlamaForCausalLM(config).eval()
    dense.save_pretrained(root / "dense")
    smollm2_tokenizer.save_pretrained(root / "dense")
    pruner = AutoPruner.from_pretrained(root / "dense")
    pruner.prune(MagnitudeConfig(pruning_ratio=0.3))
    pruner.save_pretrained(root / "pruned")
    return root


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    from optimum_prune.calibration.data import bbc_news_dir, load_texts

    d = tmp_path_factory.mktemp("texts")
    for i, doc in enumerate(load_texts(bbc_news_dir())[::60][:24]):
        (d / f"{i:03d}.txt").write_text(doc)
    return d


@pytest.fixture(scope="module")
def learnable_texts(tmp_path_factory):
    """10 documents repeating one sentence: a few steps measurably fit them (see tests/finetune/conftest.py)."""
    d = tmp_path_factory.mktemp("learnable")
    for i in range(10):
        (d / f"{i:03d}.txt").write_text(f"Document {i}. " + "the cat sat on the mat and the dog ate the bone. " * 12)
    return d


FT = [
    "--steps",
    "2",
    "--batch-size",
    "2",
    "--seq-len",
    "32",
    "--set",
    "eval_max_tokens=64",
    "--set",
    "eval_fraction=0.2",
]


def test_finetune_cli_with_distillation(pruned_dir, learnable_texts, tmp_path, capsys):
    out = tmp_path / "ft"
    argv = [
        "finetune",
        str(pruned_dir / "pruned"),
        "--data",
        str(learnable_texts),
        *FT,
        "--steps",
        "8",
        "--lr",
        "1e-2",
    ]
    assert main([*argv, "--distill", "kl", "--teacher", str(pruned_dir / "dense"), "--output", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["merged"] and summary["config"]["distill"] == "kl" and summary["output"] == str(out)
    # half LM loss, half KL: the held-out perplexity of the repetitive text measured 49.4k -> 23.1k (untrained: equal)
    assert summary["perplexity_after"] < 0.7 * summary["perplexity_before"]
    side = json.loads((out / "pruning_config.json").read_text())
    assert side["history"][0]["method"] == "magnitude" and side["finetune"][0]["config"]["max_steps"] == 8
    assert (out / "README.md").is_file()


def test_recover_cli_takes_a_token_budget_and_streams(pruned_dir, learnable_texts, tmp_path, capsys):
    out, report = tmp_path / "rec", tmp_path / "report.json"
    argv = ["recover", str(pruned_dir / "pruned"), "--data", str(learnable_texts), *FT[2:], "--tokens", "500",
            "--eval-at", "128", "--stream", "--lr", "1e-2", "--output", str(out), "--report", str(report)]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["config"]["token_budget"] == 500 and summary["config"]["max_steps"] == 8  # ceil(500 / (2 x 32))
    assert summary["tokens_seen"] == 512 and summary["config"]["streaming"] and summary["train_tokens"] is None
    curve = json.loads(report.read_text())["curve"]
    assert [p["tokens"] for p in curve] == [128, 512] and curve[-1]["perplexity"] < curve[0]["perplexity"]
    with pytest.raises(SystemExit):  # --steps or --tokens, not both
        main([*argv[:-4], "--steps", "3", "--output", str(tmp_path / "x")])
    assert "not allowed with argument" in capsys.readouterr().err


def test_recover_cli_without_a_recipe_runs_the_budgets_measured_one(pruned_dir, learnable_texts, tmp_path, capsys):
    from optimum_prune import FinetuneConfig

    argv = ["recover", str(pruned_dir / "pruned"), "--data", str(learnable_texts), *FT[2:], "--tokens", "256",
            "--output", str(tmp_path / "rec")]  # fmt: skip
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)["config"]
    want = FinetuneConfig.for_budget(256, distill=False, batch_size=2, seq_len=32).to_dict()  # no --teacher
    assert {
        k: got[k] for k in ("method", "learning_rate", "distill", "warmup_steps", "max_steps", "lora_dropout")
    } == {k: want[k] for k in ("method", "learning_rate", "distill", "warmup_steps", "max_steps", "lora_dropout")}
    assert main([*argv[:-1], str(tmp_path / "rec2"), "--method", "full"]) == 0  # a recipe given: the plain defaults
    got = json.loads(capsys.readouterr().out)["config"]
    assert (got["method"], got["learning_rate"], got["token_budget"]) == ("full", 2e-4, 256)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--distill", "kl"], "--distill needs --teacher"),
        (["--steps", "0"], "max_steps must be > 0"),
        (["--set", 'target_modules=["c_fc"]'], "target_modules"),
    ],
)
def test_finetune_cli_errors(pruned_dir, texts, tmp_path, capsys, extra, match):
    out = tmp_path / "ft"
    argv = ["finetune", str(pruned_dir / "pruned"), "--data", str(texts), *FT, *extra, "--output", str(out)]
    assert main(argv) == 2
    assert match in capsys.readouterr().err and not out.exists()


def test_push_cli(pruned_dir, monkeypatch, capsys):
    uploaded = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: None)
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: uploaded.append(kw) or "c0ffee")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    assert main(["push", str(pruned_dir / "pruned"), "user/tiny", "--token", "hf_x"]) == 0
    assert uploaded[0]["folder_path"] == str(pruned_dir / "pruned") and uploaded[0]["repo_id"] == "user/tiny"
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    assert main(["push", str(pruned_dir / "pruned"), "user/tiny"]) == 2
    assert "without a token" in capsys.readouterr().err and len(uploaded) == 1


def test_eval_tasks_cli(pruned_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OPTIMUM_PRUNE_CACHE", str(tmp_path))
    assert main(["eval", str(pruned_dir / "pruned"), "--tasks", "bbc_news_topic", "--limit", "5"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["zero_shot"]["bbc_news_topic"]["samples"] == 5
    assert main(["eval", str(pruned_dir / "pruned"), "--tasks", str(tmp_path / "none.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_optimum_cli_prune_is_registered(pruned_dir, tmp_path):
    # the `optimum` extra, which `make install` installs
    pytest.importorskip("optimum.commands.optimum_cli", reason="needs the extra: pip install -e '.[optimum]'")
    from optimum.commands.optimum_cli import load_optimum_namespace_cli_commands

    names = [c.COMMAND.name for c, _ in load_optimum_namespace_cli_commands() if hasattr(c, "COMMAND")]
    assert "prune" in names
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cli = [sys.executable, "-c", "from optimum.commands.optimum_cli import main; main()"]
    out = tmp_path / "via-optimum-cli"
    argv = ["prune", str(pruned_dir / "dense"), "--method", "magnitude", "--ratio", "0.25", "--output", str(out)]
    proc = subprocess.run([*cli, *argv], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["method"] == "magnitude" and (out / "pruning_config.json").is_file()
    bad = subprocess.run([*cli, "prune", str(tmp_path / "missing"), "--method", "magnitude", "-o", str(tmp_path / "x")],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and "optimum-cli prune: error:" in bad.stderr and "does not exist" in bad.stderr
