"""Can a named Hub dataset be loaded right now? Answered in well under a second, before `datasets` is called.

Without network, `datasets.load_dataset` only fails after its own retries (about 25 s of back-off on an unresolvable
host). [`hub_unavailable`] answers first, from what costs nothing: a local copy in the Hugging Face caches (then
`datasets` is always tried: it can load from the cache), the offline switches (`HF_DATASETS_OFFLINE`,
`HF_HUB_OFFLINE`, `TRANSFORMERS_OFFLINE`, read as `datasets` reads them), and one TCP connection to the Hub endpoint
(or to the HTTPS proxy in the environment) bounded by [`HUB_PROBE_TIMEOUT_S`].
"""

from __future__ import annotations

import os
import socket
import threading
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["HUB_PROBE_TIMEOUT_S", "hub_unavailable", "is_cached"]

HUB_PROBE_TIMEOUT_S = 1.0  # bound on the whole probe (name resolution included); refused / unresolvable fail at once
_TRUE = {"1", "ON", "YES", "TRUE"}
_DEFAULT_ENDPOINT = "https://huggingface.co"


def _offline_switch() -> str | None:
    """The environment variable that puts `datasets` in offline mode, if any (same precedence as `datasets`)."""
    value = os.environ.get("HF_DATASETS_OFFLINE")
    if value is not None:
        return "HF_DATASETS_OFFLINE" if value.upper() in _TRUE else None
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # huggingface_hub: the first one that is set decides
        if os.environ.get(var):
            return var if os.environ[var].upper() in _TRUE else None
    return None


def _cache_dirs() -> tuple[Path, Path]:
    """(hub cache, datasets cache), resolved from the environment as `huggingface_hub` and `datasets` do."""
    xdg = os.environ.get("XDG_CACHE_HOME", os.path.join("~", ".cache"))
    home = Path(os.path.expanduser(os.environ.get("HF_HOME", os.path.join(xdg, "huggingface"))))
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or home / "hub"
    return Path(os.path.expanduser(hub)), Path(
        os.path.expanduser(os.environ.get("HF_DATASETS_CACHE", home / "datasets"))
    )


def is_cached(repo_id: str) -> bool:
    """Whether a copy of the Hub dataset `repo_id` (e.g. `"Salesforce/wikitext"`) may be in the local caches."""
    hub, datasets_cache = _cache_dirs()
    if (hub / f"datasets--{repo_id.replace('/', '--')}").is_dir():
        return True
    prefix = repo_id.replace("/", "___").lower()
    return datasets_cache.is_dir() and any(p.name.lower().startswith(prefix) for p in datasets_cache.iterdir())


def _endpoint() -> tuple[str, int, str]:
    """(host, port, what) to connect to: the proxy of the environment when one applies, else the Hub endpoint."""
    url = urlsplit(os.environ.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(url.scheme or "https")
    if proxy and not urllib.request.proxy_bypass(host):
        proxy_url = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        return proxy_url.hostname or "", proxy_url.port or 8080, "the proxy"
    return host, port, "the Hub"


def _connect_error(host: str, port: int, timeout: float) -> str | None:
    """`None` if a TCP connection to `host:port` opens within `timeout` seconds, else why not."""
    outcome: list[str | None] = []

    def attempt() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                outcome.append(None)
        except OSError as e:  # unresolvable name, refused, unreachable network, timeout
            outcome.append(f"{type(e).__name__}: {e}")

    thread = threading.Thread(target=attempt, name="optimum-prune-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)  # name resolution ignores the socket timeout; the thread bounds it
    return outcome[0] if outcome else f"no answer within {timeout:g} s"


def hub_unavailable(repo_id: str, timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why `datasets` cannot get `repo_id` now, or `None` when it should be tried (cached, or the Hub answers).

    Args:
        repo_id (`str`): the dataset repository, e.g. `"Salesforce/wikitext"`.
        timeout (`float`, defaults to `HUB_PROBE_TIMEOUT_S`): bound on the connection probe, in seconds.

    Returns:
        `str | None`: e.g. `"offline mode is on (HF_HUB_OFFLINE)"` or `"the Hub (huggingface.co:443) is unreachable
        (gaierror: ...)"`; `None` when a cached copy exists or the endpoint accepts a connection.
    """
    if is_cached(repo_id):
        return None
    switch = _offline_switch()
    if switch is not None:
        return f"offline mode is on ({switch})"
    host, port, what = _endpoint()
    error = _connect_error(host, port, timeout)
    return None if error is None else f"{what} ({host}:{port}) is unreachable ({error})"
