"""MkDocs hook: `docs/results.md` shows every `benchmarks/results/*.md` file exactly as the benchmarks wrote it.

The page holds the line `<!-- benchmark results -->`; at build time it is replaced by each results file in name order,
its headings moved one level down and its title anchored by the file's stem (so a method page links to
`results.md#structured_smollm2`). No number is copied into the docs by hand, and a results file added by a
benchmark appears without editing the page.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.exceptions import PluginError

DIRECTIVE = "<!-- benchmark results -->"
RESULTS_DIR = Path("benchmarks") / "results"
_HEADING = re.compile(r"^(#{1,5}) ")


def _section(path: Path) -> str:
    """The file with every heading one level deeper (outside fenced code); its title gets the anchor `path.stem` and
    a line naming the file."""
    out, fenced, titled = [], False, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and _HEADING.match(line):
            line = "#" + line
            if not titled:
                line += f" {{#{path.stem}}}\n\n`{RESULTS_DIR.as_posix()}/{path.name}`"
                titled = True
        out.append(line)
    if not titled:
        raise PluginError(f"{path} has no title heading.")
    return "\n".join(out) + "\n"


def results_markdown(root: Path) -> str:
    paths = sorted((root / RESULTS_DIR).glob("*.md"))
    if not paths:
        raise PluginError(f"No results files under {root / RESULTS_DIR}.")
    return "\n".join(_section(path) for path in paths)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if DIRECTIVE not in markdown:
        return markdown
    root = Path(config.config_file_path).parent
    return markdown.replace(DIRECTIVE, results_markdown(root))
