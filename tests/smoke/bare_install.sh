#!/usr/bin/env bash
# Bare-install smoke test: a fresh virtual environment, torch pinned first (a bare `torch` could pull a CUDA build),
# then this checkout installed WITHOUT extras (not editable), then every public entry point on tiny models
# (tests/smoke/bare_install.py). A third-party import that is neither a requirement nor behind an extra with our
# own error fails here. Usage: tests/smoke/bare_install.sh  (`make smoke`; PYTHON and TORCH_SPEC may be set).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/optimum-prune-smoke.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

start=$(date +%s)
"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
pip_install() {  # quiet, without the notices of a configured local index that lacks a package
    "$VPY" -m pip install -q --disable-pip-version-check --no-compile "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}
pip_install "$TORCH_SPEC"
# The checkout is copied first so that the build leaves nothing (build/, *.egg-info) in it.
mkdir "$WORK/src"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$WORK/src" 2>/dev/null) \
    || cp -r "$ROOT/." "$WORK/src"
pip_install "$WORK/src" "$TORCH_SPEC"
installed=$(date +%s)
echo "installed in $((installed - start))s"

# Run outside the checkout with a clean PYTHONPATH: the installed package is the one imported.
cd "$WORK"
env -u PYTHONPATH PATH="$WORK/venv/bin:$PATH" HF_HUB_OFFLINE=1 TQDM_DISABLE=1 "$VPY" "$ROOT/tests/smoke/bare_install.py" "$WORK/run"
echo "smoke test passed in $(($(date +%s) - start))s (install $((installed - start))s)"
