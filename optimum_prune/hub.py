"""Sharing pruned models: `push_to_hub` (one commit of exactly the folder `save_pretrained` writes, model card
included: see `optimum_prune.card`).

The network is touched only by `HfApi.create_repo` and `HfApi.upload_folder`; a missing token or offline mode fails
before anything is written, and the folder is built in a temporary directory that is always removed.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import huggingface_hub
from torch import nn

from .card import REPO_ID
from .constants import PRUNING_CONFIG_NAME
from .serialization import save_pruned_model

__all__ = ["push_to_hub", "upload_folder", "check_hub_access"]

logger = logging.getLogger(__name__)


def check_hub_access(token: str | None) -> str:
    """The token to use; raises before anything is written when offline or without a token."""
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise OSError(
            "Cannot push to the Hub: offline mode is on (HF_HUB_OFFLINE=1). Unset it, or save locally with "
            "save_pretrained() and upload later."
        )
    token = token or huggingface_hub.get_token()
    if not token:
        raise OSError(
            "Cannot push to the Hub without a token: run `hf auth login`, set HF_TOKEN, or pass token=... "
            "Nothing was written."
        )
    return token


def upload_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
) -> Any:
    """Create the repo if needed and upload `folder` in one commit (the `CommitInfo`)."""
    if not isinstance(repo_id, str) or not REPO_ID.match(repo_id):
        raise ValueError(f"repo_id must look like 'user/name', got {repo_id!r}.")
    token = check_hub_access(token)
    folder = Path(folder)
    if not (folder / PRUNING_CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{folder} is not a checkpoint saved by optimum-prune (no {PRUNING_CONFIG_NAME}).")
    api = huggingface_hub.HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    info = api.upload_folder(
        repo_id=repo_id, folder_path=str(folder), commit_message=commit_message or "Upload pruned model (optimum-prune)",
        revision=revision, create_pr=create_pr, repo_type="model",
    )  # fmt: skip
    logger.info("Uploaded %s to %s", folder, repo_id)
    return info


def push_to_hub(
    model: nn.Module,
    repo_id: str,
    tokenizer: Any = None,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    model_card: bool | dict = True,
    max_shard_size: str | int = "5GB",
) -> Any:
    """Save `model` (as `save_pretrained` does: checkpoint, tokenizer, `pruning_config.json`, README.md) into a
    temporary folder and upload that folder to `repo_id` in one commit. Returns the `CommitInfo`."""
    if not isinstance(repo_id, str) or not REPO_ID.match(repo_id):
        raise ValueError(f"repo_id must look like 'user/name', got {repo_id!r}.")
    token = check_hub_access(token)  # before anything is written
    if model_card:
        model_card = {"repo_id": repo_id, **(model_card if isinstance(model_card, dict) else {})}
    with tempfile.TemporaryDirectory(prefix="optimum_prune_push_") as tmp:
        folder = save_pruned_model(
            model, Path(tmp) / "model", tokenizer, max_shard_size=max_shard_size, model_card=model_card
        )
        return upload_folder(folder, repo_id, private=private, token=token, commit_message=commit_message,
                             revision=revision, create_pr=create_pr)  # fmt: skip
