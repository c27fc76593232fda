"""MkDocs hooks: the Results pages and plots assembled from `benchmarks/`, and the formulas rendered offline.

- Results (`docs/_results.py`): `<!-- study: NAME -->` (a study's notes and results files, on its records page
  `results/records/NAME.md`), `<!-- results-section: FILE.md#Section -->` (one section of a results file),
  `<!-- results-table: FILE.md#N -->` (its N-th table, optionally narrowed to named columns and rows), each with a
  link to the records page that shows the file. No number is copied into the docs by hand.
- Plots (`docs/_plots.py`): `<!-- plot: NAME -->` becomes an inline SVG drawn from the results JSON.
- Math: the `pymdownx.arithmatex` spans (`$...$`, `$$...$$`) become MathML at build time (`latex2mathml`), which
  browsers render natively: the site needs no script and no network to show a formula.
"""

from __future__ import annotations

import html
import importlib.util
import re
import sys
from pathlib import Path

from latex2mathml.converter import convert as latex_to_mathml
from mkdocs.exceptions import PluginError

_HERE = Path(__file__).resolve().parent
_PLOT = re.compile(r"<!-- plot: (\w+) -->")
_MATH = re.compile(r'<(span|div) class="arithmatex">(.*?)</\1>', re.S)


def _module(name: str):
    """A helper module beside this file (hooks are loaded by path, not as a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def on_page_markdown(markdown: str, page, config, files) -> str:
    root = Path(config.config_file_path).parent
    results, plots = _module("_results"), _module("_plots")
    try:
        markdown = results.expand(markdown, root, page.file.src_uri)
        return _PLOT.sub(lambda m: plots.plot(root, m.group(1)), markdown)
    except (results.ResultsError, plots.PlotError) as e:
        raise PluginError(f"{page.file.src_uri}: {e}") from e


def _mathml(match: re.Match) -> str:
    tag, body = match.group(1), html.unescape(match.group(2)).strip()
    display = tag == "div"
    for opening, closing in ((r"\[", r"\]"), (r"\(", r"\)")):
        if body.startswith(opening) and body.endswith(closing):
            body = body[len(opening) : -len(closing)]
    # \texttt{a\_b}: latex2mathml keeps the backslash of an escaped underscore inside text
    body = re.sub(r"\\texttt\{([^}]*)\}", lambda m: r"\texttt{" + m.group(1).replace(r"\_", "_") + "}", body)
    try:
        out = latex_to_mathml(body.strip(), display="block" if display else "inline")
    except Exception as e:  # noqa: BLE001 - any parse error of the converter
        raise PluginError(f"Cannot render the formula {body!r}: {e}") from e
    return f'<div class="op-math">{out}</div>' if display else out


def on_page_content(html_text: str, page, config, files) -> str:
    return _MATH.sub(_mathml, html_text)
