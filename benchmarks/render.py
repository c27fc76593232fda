"""The one renderer: a results JSON -> its markdown tables.

Every results file names its renderer (`"renderer"`: the module of the script that wrote it, whose `markdown(result)`
lays out its tables); files written before the harness are mapped by name (`LEGACY_RENDERERS`). Scripts write through
`harness.write_results`, which calls `render`; `tests/test_generated_tables.py` re-renders every committed JSON and
fails when its `.md` (or a `<!-- BEGIN GENERATED: ... -->` block of the README / docs) differs.

    python benchmarks/render.py benchmarks/results/*.json     # rewrite the .md of each JSON
    python benchmarks/render.py --check benchmarks/results/*.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

# results-file name prefix -> renderer module, for files written before results recorded their renderer
LEGACY_RENDERERS = {
    "alignment_": "alignment",
    "amp_regimes_": "amp_regimes",
    "amp_synthetic": "amp_synthetic",
    "attention_": "attention",
    "demo_": "optimum_prune.cli.demo:format_demo_markdown",  # `make demo`'s results file (written by the library)
    "deploy_": "deploy",
    "fista_calibration_size": "fista_calibration_size",
    "fista_generalization_": "fista_generalization",
    "np_allocation_": "np_allocation",
    "np_grid_": "np_allocation",
    "recovery_": "recovery",
    "scale": "scale",
    "semi_structured_": "semi_structured",
    "spp_": "spp",
    "structured_": "structured",
    "unstructured_": "unstructured",
    "vision_": "vision",
}


def renderer_name(result: dict[str, Any], stem: str | None = None) -> str:
    """The module that renders `result` (its `"renderer"`, else by the file name `stem`)."""
    if result.get("renderer"):
        return result["renderer"]
    if stem is not None:
        for prefix, module in sorted(LEGACY_RENDERERS.items(), key=lambda kv: -len(kv[0])):
            if stem.startswith(prefix):
                return module
    raise KeyError(f"no renderer recorded for {stem or 'this result'}; add 'renderer' or a LEGACY_RENDERERS entry")


def render(result: dict[str, Any], stem: str | None = None) -> str:
    """The markdown of `result` (a loaded results JSON): its renderer's `markdown(result)`, or the function a
    `"module:function"` renderer names."""
    module, _, function = renderer_name(result, stem).partition(":")
    return getattr(importlib.import_module(module), function or "markdown")(result)


def render_file(path: Path) -> str:
    path = Path(path)
    return render(json.loads(path.read_text(encoding="utf-8")), path.stem)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="results JSON files")
    p.add_argument("--check", action="store_true", help="only report the files whose .md differs (exit 1 if any)")
    args = p.parse_args(argv)
    stale = []
    for path in args.files:
        text = render_file(path)
        md = path.with_suffix(".md")
        if args.check:
            if not md.is_file() or md.read_text(encoding="utf-8") != text:
                stale.append(md)
        else:
            md.write_text(text, encoding="utf-8")
    for md in stale:
        print(f"stale: {md}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
