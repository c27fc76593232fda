"""Named Hub datasets fail at once, with the way to pass local text, when offline or when the Hub is unreachable.

No test needs the network: offline mode is an environment variable, an unreachable Hub is a closed local port, a
hanging one a patched connection, and `datasets.load_dataset` is replaced so that any call to it is seen.
"""

import socket
import threading
import time

import datasets
import pytest

from optimum_prune import CalibrationConfig
from optimum_prune.calibration import hub
from optimum_prune.calibration.data import get_calibration_batches, load_texts

_PROXY_VARS = (
    "https_proxy",
    "HTTPS_PROXY",
    "http_proxy",
    "HTTP_PROXY",
    "all_proxy",
    "ALL_PROXY",
    "no_proxy",
    "NO_PROXY",
)
_OFFLINE_VARS = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """Empty caches, no proxy, online mode; `datasets.load_dataset` records its calls and returns a tiny dataset."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for var in (
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_DATASETS_CACHE",
        "HF_ENDPOINT",
        *_PROXY_VARS,
        *_OFFLINE_VARS,
    ):
        monkeypatch.delenv(var, raising=False)
    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append(args)
        return datasets.Dataset.from_dict({"text": ["cached one", "cached two"], "sentence": ["s1", "s2"]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    return calls


def _fails_fast(name: str, *patterns: str) -> str:
    start = time.perf_counter()
    with pytest.raises(RuntimeError) as info:
        load_texts(name)
    elapsed = time.perf_counter() - start
    message = str(info.value)
    assert "Pass local text instead" in message and "bbc_news_dir" in message, message
    for pattern in patterns:
        assert pattern in message, message
    assert elapsed < 5, f"{elapsed:.1f} s (datasets' own retries take ~25 s)"  # generous: the probe is bounded by 1 s
    return message


@pytest.mark.parametrize("var", _OFFLINE_VARS)
def test_offline_mode_fails_without_calling_datasets(hub_env, monkeypatch, var):
    monkeypatch.setenv(var, "1")
    monkeypatch.setattr(hub.socket, "create_connection", _no_network)  # offline: not even a probe
    for name in ("wikitext2", "c4", "ptb"):
        _fails_fast(name, f"offline mode is on ({var})", "is not cached")
    assert hub_env == []


def _no_network(*args, **kwargs):
    raise AssertionError("the network was probed")


def test_unreachable_hub_fails_without_calling_datasets(hub_env, monkeypatch):
    port = _closed_port()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    _fails_fast("wikitext2", f"the Hub (127.0.0.1:{port}) is unreachable", "ConnectionRefusedError")
    config = CalibrationConfig(dataset="c4", num_samples=1, seq_len=8)  # the config itself does not touch the Hub
    with pytest.raises(RuntimeError, match="unreachable.*Pass local text instead"):
        get_calibration_batches(config, tokenizer=None)  # fails before the tokenizer is needed
    assert hub_env == []


def test_unreachable_proxy_is_named(hub_env, monkeypatch):
    port = _closed_port()
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{port}")
    _fails_fast("ptb", f"the proxy (127.0.0.1:{port}) is unreachable")
    assert hub_env == []


def test_a_hub_that_never_answers_is_bounded(monkeypatch):
    release = threading.Event()

    def hang(*args, **kwargs):  # a blackholed address: no answer, no error
        release.wait(30)
        raise TimeoutError("timed out")

    monkeypatch.setattr(hub.socket, "create_connection", hang)
    start = time.perf_counter()
    try:
        assert hub._connect_error("huggingface.co", 443, timeout=0.2) == "no answer within 0.2 s"
        assert time.perf_counter() - start < 5
    finally:
        release.set()  # let the probe thread end


def test_reachable_hub_or_cached_copy_goes_to_datasets(hub_env, monkeypatch, tmp_path):
    with socket.socket() as server:  # a local "Hub" that accepts connections
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert load_texts("wikitext2") == ["cached one", "cached two"]
    assert hub_env == [("Salesforce/wikitext", "wikitext-2-raw-v1")]
    # offline, but a copy is in the hub cache (or the datasets cache): `datasets` loads it from there
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "hf" / "hub" / "datasets--Salesforce--wikitext").mkdir(parents=True)
    assert load_texts("wikitext2", split="test") == ["cached one", "cached two"]
    (tmp_path / "hf" / "datasets" / "ptb-text-only___ptb_text_only").mkdir(parents=True)
    assert load_texts("ptb") == ["s1", "s2"]
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")  # datasets' own switch overrides HF_HUB_OFFLINE
    assert hub._offline_switch() is None
    assert len(hub_env) == 3
