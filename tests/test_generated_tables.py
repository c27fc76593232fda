"""Published tables are generated: every committed `benchmarks/results/*.md` is what the one renderer
(`benchmarks/render.py`) makes of its `.json`, and every `<!-- BEGIN GENERATED: path -->` block of the README or a
docs page is the text of the file it names."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))

# Results whose markdown cannot be regenerated faithfully from their JSON (written before the harness): the reason.
# A file listed here that renders identically again fails `test_legacy_list_is_current` (drop it from the list).
LEGACY = {
    "unstructured_smollm2.json": "the first unstructured run: an older JSON layout (no OOD text, no per-run setup) "
    "whose markdown the current renderer lays out differently",
    "np_allocation_smollm2.json": "holds variants (np_std, ...) since removed from the script; the JSON does not "
    "record their labels",
    "np_allocation_gemma3.json": "holds variants (np_std_bias, ...) since removed from the script; the JSON does not "
    "record their labels",
    "vision_dinov2s_cifar10.json": "its markdown quotes the library versions of the run, which the JSON does not record",
    "vision_dinov2s_cifar10_spp.json": "its markdown quotes the library versions of the run, which the JSON does not "
    "record",
    "vision_dinov2s_cifar10_lr1e-5.json": "its markdown's title and notes were written by hand (a 40%-only rerun), and "
    "it quotes library versions the JSON does not record",
}

BEGIN = re.compile(r"^<!-- BEGIN GENERATED: (?P<path>[^ #]+)(?:#(?P<section>[^>]+?))? -->\n", re.M)
END = "<!-- END GENERATED -->"


def _render(path: Path) -> str:
    import render

    return render.render(json.loads(path.read_text(encoding="utf-8")), path.stem)


RESULT_FILES = sorted(RESULTS.glob("*.json"))


@pytest.mark.parametrize("path", [p for p in RESULT_FILES if p.name not in LEGACY], ids=lambda p: p.name)
def test_results_markdown_is_rendered_from_its_json(path):
    md = path.with_suffix(".md")
    assert md.is_file(), f"{md.name} missing: python benchmarks/render.py {path.relative_to(ROOT)}"
    assert md.read_text(encoding="utf-8") == _render(path), (
        f"{md.relative_to(ROOT)} differs from what benchmarks/render.py makes of {path.name}: edit the JSON or the "
        f"script's markdown(), then run python benchmarks/render.py {path.relative_to(ROOT)}"
    )


@pytest.mark.parametrize("name", sorted(LEGACY))
def test_legacy_list_is_current(name):
    path = RESULTS / name
    assert path.is_file(), f"{name} is listed as legacy but no longer exists: drop it from LEGACY"
    rendered = _render(path)  # every legacy file still renders (its layout differs): a renderer crash fails here
    assert rendered != path.with_suffix(".md").read_text(encoding="utf-8"), (
        f"{name} renders identically now: drop it from LEGACY"
    )


def _section(text: str, heading: str) -> str:
    """The lines from the markdown heading `heading` (any level) to the next heading of the same or a higher level."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        m = re.match(r"^(#+) (.*)$", line.rstrip("\n"))
        if m and m.group(2).strip() == heading.strip():
            level, out = len(m.group(1)), [line]
            for rest in lines[i + 1 :]:
                n = re.match(r"^(#+) ", rest)
                if n and len(n.group(1)) <= level:
                    break
                out.append(rest)
            return "".join(out)
    raise AssertionError(f"no heading {heading!r}")


def generated_blocks(text: str):
    """`(path, section, content)` of every generated block of a markdown text."""
    for m in BEGIN.finditer(text):
        end = text.find(END, m.end())
        assert end >= 0, f"<!-- BEGIN GENERATED: {m.group('path')} --> has no {END}"
        yield m.group("path"), m.group("section"), text[m.end() : end]


def _pages() -> list[Path]:
    pages = [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
    docs = ROOT / "docs"
    if docs.is_dir():
        pages += sorted(docs.rglob("*.md"))
    return [p for p in pages if p.is_file()]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_generated_blocks_match_their_files(page):
    text = page.read_text(encoding="utf-8")
    for rel, section, content in generated_blocks(text):
        source = ROOT / rel
        assert source.is_file(), f"{page.name}: generated block names {rel}, which does not exist"
        want = source.read_text(encoding="utf-8")
        if section:
            want = _section(want, section)
        assert content.strip("\n") == want.strip("\n"), (
            f"{page.relative_to(ROOT)}: the block generated from {rel}{'#' + section if section else ''} differs from "
            "the file; copy the file's text between the markers"
        )


def test_block_checker_catches_drift():
    """The block parser finds a block and its content (so the check above is not vacuous)."""
    page = "intro\n<!-- BEGIN GENERATED: benchmarks/results/x.md#Two -->\n| a |\n<!-- END GENERATED -->\nend\n"
    assert list(generated_blocks(page)) == [("benchmarks/results/x.md", "Two", "| a |\n")]
    md = "# One\nx\n## Two\n| a |\n## Three\ny\n"
    assert _section(md, "Two") == "## Two\n| a |\n"
