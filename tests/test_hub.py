"""Model card written by save_pretrained; push_to_hub uploads exactly the saved folder in one commit (only the network
calls are replaced); no token / offline mode fail before anything is written."""

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, ModelCard

from optimum_prune import AutoPrunedModelForCausalLM, AutoPruner, MagnitudeConfig, NumericalConfig
from optimum_prune.hub import upload_folder


@pytest.fixture
def pruned(tiny_llama, smollm2_tokenizer):
    import copy

    pruner = AutoPruner(copy.deepcopy(tiny_llama), smollm2_tokenizer, keep_teacher=False)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    pruner.prune(NumericalConfig(pruning_ratio=0.3), calibration=ids)
    return pruner


@pytest.fixture
def fake_hub(monkeypatch):
    """Replace only the two network calls; record what would have been uploaded."""
    calls = {"create": [], "upload": []}

    def create_repo(self, repo_id, **kwargs):
        calls["create"].append((repo_id, kwargs))

    def upload(self, *, repo_id, folder_path, commit_message=None, **kwargs):
        files = {str(p.relative_to(folder_path)): p.read_bytes() for p in Path(folder_path).rglob("*") if p.is_file()}
        calls["upload"].append({"repo_id": repo_id, "files": files, "message": commit_message, **kwargs})
        return "commit-info"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    return calls


def _config(data: bytes) -> dict:
    return {k: v for k, v in json.loads(data).items() if k != "dtype"}


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in Path(folder).rglob("*") if p.is_file()}


def test_model_card(pruned, tmp_path):
    out = pruned.save_pretrained(
        tmp_path / "out", model_card={"base_model": "HuggingFaceTB/SmolLM2-135M", "license": "apache-2.0"}
    )
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M" and data["license"] == "apache-2.0"
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"pruned", "optimum-prune", "numerical"} <= set(data["tags"])
    report = pruned.reports[0]
    assert f"{report.params_before / 1e6:.2f} M before" in card.text
    assert "AutoPrunedModelForCausalLM" in card.text  # global allocation: per-layer shapes need optimum-prune
    assert '"pruning_ratio": 0.3' in card.text


def test_model_card_stock_loader_for_uniform_shapes(tiny_llama, smollm2_tokenizer, tmp_path):
    import copy

    pruner = AutoPruner(copy.deepcopy(tiny_llama), smollm2_tokenizer, keep_teacher=False)
    pruner.prune(MagnitudeConfig(pruning_ratio=0.25, allocation="uniform"))
    card = ModelCard.load(pruner.save_pretrained(tmp_path / "out") / "README.md")
    assert "AutoModelForCausalLM.from_pretrained" in card.text and "AutoPruned" not in card.text
    assert "base_model" not in card.data.to_dict() or card.data.base_model is None


def test_push_uploads_exactly_the_saved_folder(pruned, fake_hub, tmp_path, monkeypatch):
    saved = _files(pruned.save_pretrained(tmp_path / "ref"))
    staging = tmp_path / "tmp"
    staging.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staging))  # the push stages here; nothing else writes to it
    assert pruned.push_to_hub("user/tiny-np30", token="hf_x", private=True, commit_message="msg") == "commit-info"
    assert fake_hub["create"] == [("user/tiny-np30", {"private": True, "exist_ok": True, "repo_type": "model"})]
    (upload,) = fake_hub["upload"]  # one commit
    assert upload["repo_id"] == "user/tiny-np30" and upload["message"] == "msg"
    assert set(upload["files"]) == set(saved)
    for name, data in saved.items():
        if name == "README.md":  # the pushed card names its repo in the loading snippet
            assert b"user/tiny-np30" in upload["files"][name]
        elif name == "config.json":  # transformers records `dtype` in the config once a model was saved
            assert _config(upload["files"][name]) == _config(data)
        else:
            assert upload["files"][name] == data, name
    assert list(staging.iterdir()) == []  # the staging folder is gone


def test_push_a_loaded_pruned_model(pruned, fake_hub, tmp_path):
    out = pruned.save_pretrained(tmp_path / "out")
    model = AutoPrunedModelForCausalLM.from_pretrained(out)
    model.push_to_hub("user/reloaded", token="hf_x")
    files = fake_hub["upload"][0]["files"]
    assert {"config.json", "model.safetensors", "pruning_config.json", "README.md", "tokenizer.json"} <= set(files)
    assert json.loads(files["pruning_config.json"])["history"][0]["method"] == "numerical"
    assert _config(files["config.json"]) == _config((out / "config.json").read_bytes())


def test_push_without_token_or_offline_writes_nothing(pruned, monkeypatch, tmp_path):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    called = []
    monkeypatch.setattr(HfApi, "upload_folder", lambda *a, **k: called.append(1))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # anything staged would land here
    with pytest.raises(OSError, match="without a token"):
        pruned.push_to_hub("user/x")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match="offline mode"):
        pruned.push_to_hub("user/x", token="hf_x")
    assert not called and list(tmp_path.iterdir()) == []


def test_upload_folder_checks_its_input(pruned, fake_hub, tmp_path):
    with pytest.raises(ValueError, match="user/name"):
        upload_folder(tmp_path, "not a repo id", token="hf_x")
    with pytest.raises(FileNotFoundError, match="pruning_config.json"):
        upload_folder(tmp_path, "user/x", token="hf_x")
    out = pruned.save_pretrained(tmp_path / "out")
    upload_folder(out, "user/x", token="hf_x")
    assert set(fake_hub["upload"][0]["files"]) == set(_files(out))
    shutil.rmtree(out)
