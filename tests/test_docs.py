"""The documentation site covers the code: every option of every registered method is on its method page, every
public name is in the API reference, every page is in the navigation, and the results page's files exist.

The full check (links, anchors, the API reference resolving) is `make docs-build` (`mkdocs build --strict`); these
tests need no MkDocs and fail fast in `make test` when a change to the code leaves the docs behind.
"""

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

import optimum_prune
from optimum_prune import PruningConfig, StructuredPruningConfig, WandaConfig
from optimum_prune.methods.registry import available_methods, get_config_class

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
METHODS = DOCS / "methods"
# Methods documented on another method's page.
PAGE_OF = {"spp_ria": "spp", "serving": "numerical"}
# The base classes whose fields methods/index.md documents once: Wanda's base is the unstructured one.
SHARED_BASES = (PruningConfig, StructuredPruningConfig, WandaConfig.__bases__[0])


def _page(name: str) -> str:
    return (METHODS / f"{PAGE_OF.get(name, name)}.md").read_text(encoding="utf-8")


def _table_options(text: str) -> set[str]:
    """Option names in the first column of the page's Markdown tables (`| \\`name\\` | default | meaning |`)."""
    return set(re.findall(r"^\| `(\w+)` \|", text, re.M))


def _shared_defaults() -> dict[str, object]:
    """Fields the shared base classes declare, with their defaults (documented once, on methods/index.md)."""
    out = {}
    for base in SHARED_BASES:
        for f in dataclasses.fields(base):
            out[f.name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return out


def _default(f: dataclasses.Field) -> object:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@pytest.mark.parametrize("method", available_methods())
def test_every_option_is_on_its_method_page(method):
    """A field a method adds (or whose shared default it changes) is a row of its page's options table; a field it
    inherits unchanged is a row of the shared tables of methods/index.md."""
    config_cls = get_config_class(method)
    page, shared_page = _table_options(_page(method)), _table_options((METHODS / "index.md").read_text("utf-8"))
    shared = _shared_defaults()
    missing = {"index": [], PAGE_OF.get(method, method): []}
    for f in dataclasses.fields(config_cls):
        if f.name in shared and _default(f) == shared[f.name]:
            if f.name not in shared_page:
                missing["index"].append(f.name)
        elif f.name not in page:
            missing[PAGE_OF.get(method, method)].append(f.name)
    missing = {f"docs/methods/{name}.md": names for name, names in missing.items() if names}
    assert not missing, f"options of {config_cls.__name__} missing from the options tables: {missing}"


@pytest.mark.parametrize("method", available_methods())
def test_method_page_documents_no_stale_option(method):
    """An options-table row of a method page names a field of that page's configurations (or a shared one)."""
    pages = {PAGE_OF.get(m, m): [] for m in available_methods()}
    for m in available_methods():
        pages[PAGE_OF.get(m, m)].append(get_config_class(m))
    page = PAGE_OF.get(method, method)
    fields = {f.name for cls in pages[page] for f in dataclasses.fields(cls)}
    stale = _table_options(_page(method)) - fields
    assert not stale, f"docs/methods/{page}.md documents options no configuration has: {sorted(stale)}"


def test_api_reference_covers_the_public_api():
    documented = set()
    for path in (DOCS / "reference").glob("*.md"):
        documented |= set(re.findall(r"^::: optimum_prune\.(\w+)\s*$", path.read_text("utf-8"), re.M))
    public = set(optimum_prune.__all__) - {"__version__"}
    assert public - documented == set(), f"public names missing from docs/reference/: {sorted(public - documented)}"
    assert documented - public == set(), f"docs/reference/ documents non-public names: {sorted(documented - public)}"


def _nav_pages() -> set[str]:
    text = (REPO / "mkdocs.yml").read_text("utf-8")
    nav = text[text.index("\nnav:") :]
    return set(re.findall(r"([\w/-]+\.md)\s*$", nav, re.M))


def test_every_page_is_in_the_navigation_and_exists():
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    nav = _nav_pages()
    assert pages - nav == set(), f"pages missing from the nav of mkdocs.yml: {sorted(pages - nav)}"
    assert nav - pages == set(), f"nav entries without a page: {sorted(nav - pages)}"


def test_every_method_has_a_page_in_the_navigation():
    nav = _nav_pages()
    for method in available_methods():
        assert f"methods/{PAGE_OF.get(method, method)}.md" in nav


def _docs_module(name: str):
    """A helper module of the site's build (docs/*.py: loaded by path, as MkDocs loads docs/hooks.py)."""
    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as e:  # mkdocs, matplotlib, latex2mathml: the [docs] extra
        pytest.fail(f"needs the [docs] extra (make install installs it): {e}")
    return module


def test_results_links_name_the_records_page_of_an_existing_results_file():
    """A link to a results file's anchor (`results/records/<study>.md#<stem>`) names an existing file, on its study's
    records page (a study's summary page, `results/<study>.md`, holds no results file)."""
    results = _docs_module("_results")
    stems = {p.stem for p in (REPO / "benchmarks" / "results").glob("*.md")}
    assert stems
    found = 0
    for path in [*DOCS.rglob("*.md"), *(REPO / "benchmarks" / "notes").glob("*.md")]:
        for records, study, anchor in re.findall(r"results/(records/)?(\w+)\.md#([\w.-]+)\)", path.read_text("utf-8")):
            if anchor in stems:
                found += 1
                where = f"{records}{study}.md"
                assert records, f"{path.relative_to(REPO)}: #{anchor} is on records/{study}.md, not on {where}"
                assert results.study_of(anchor) == study, f"{path.relative_to(REPO)}: #{anchor} is on {where}?"
    assert found, "the method pages link the results files behind their defaults"


def test_every_results_file_is_on_one_records_page_as_written():
    results = _docs_module("_results")
    files = results.results_files(REPO)
    nav = _nav_pages()
    shown = {}
    for study in results.STUDIES:
        records = f"results/{results.RECORDS}/{study}.md"
        assert records in nav, f"the records page {records} is not in mkdocs.yml's nav"
        assert f"<!-- study: {study} -->" in (DOCS / records).read_text("utf-8")
        text = results.study_markdown(REPO, study)
        for path in files[study]:
            assert path.stem not in shown, f"{path.name} is on two pages"
            shown[path.stem] = study
            assert f"{{#{path.stem}}}" in text
            body = [line for line in path.read_text("utf-8").splitlines() if line.startswith("|")]
            assert all(line in text for line in body), f"{path.name}: a table row is not shown as written"
        # each results file's title is a level-3 section of the page (the table of contents stops there)
        assert not re.search(r"^#{1,2} .*\{#", text, re.M)
    assert set(shown) == {p.stem for p in (REPO / "benchmarks" / "results").glob("*.md")}


# A study's summary page, as the site shows it, in lines: what it asked, what it found, its key tables (the records
# are one link further). The records of the largest study run to thousands of lines.
SUMMARY_LINES = 250


def test_study_pages_summarise_and_link_their_records_once():
    """Each study with results files has a summary page in the nav, `results/<study>.md`: no `<!-- study -->` (the
    records are on `results/records/<study>.md`), one link to its records page, and short once assembled."""
    results = _docs_module("_results")
    files = results.results_files(REPO)
    nav = _nav_pages()
    for study in results.STUDIES:
        if not files[study]:
            continue
        page = DOCS / "results" / f"{study}.md"
        assert f"results/{study}.md" in nav and page.is_file(), f"the study {study} has no summary page in the nav"
        text = page.read_text("utf-8")
        assert "<!-- study:" not in text, f"results/{study}.md renders its records: they go on records/{study}.md"
        links = re.findall(rf"\]\({results.RECORDS}/{study}\.md\)", text)
        assert len(links) == 1, f"results/{study}.md links its records page {len(links)} times, not once"
        shown = results.expand(text, REPO, f"results/{study}.md")
        assert len(shown.splitlines()) <= SUMMARY_LINES, f"results/{study}.md shows {len(shown.splitlines())} lines"


def test_provenance_is_folded_and_headline_tables_come_from_their_file(tmp_path):
    results = _docs_module("_results")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "np_x.md").write_text(
        "# Title\n\nGenerated by `x.py` on today (load 3).\n\n- Command: `x.py --output /tmp/a.json`\n"
        "- Calibration: 8 x 128\n\nDense: **10.0**\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n## Second\n\n"
        "| c |\n|---|\n| 3 |\n"
    )
    text = results.study_markdown(tmp_path, "numerical")
    after = text.split('??? info "How this was run"')[1].splitlines()[1:]
    folded = "\n".join(line for line in after[: next(k for k, x in enumerate(after) if x.startswith("- Cal"))])
    assert "Generated by" in folded and "    - Command: `x.py --output /tmp/a.json`" in folded
    assert "Dense: **10.0**" in text and "| 1 | 2 |" in text
    page = results.expand("<!-- results-table: np_x.md#2 -->", tmp_path, "results/index.md")
    assert "| 3 |" in page and "| 1 | 2 |" not in page and "](records/numerical.md#np_x)" in page
    page = results.expand("<!-- results-section: np_x.md#Second -->", tmp_path, "methods/x.md")
    assert "| 3 |" in page and "](../results/records/numerical.md#np_x)" in page
    page = results.expand("<!-- results-table: np_x.md#2 -->", tmp_path, "results/records/numerical.md")
    assert "](../records/numerical.md#np_x)" in page
    with pytest.raises(results.ResultsError, match="not a table #3"):
        results.expand("<!-- results-table: np_x.md#3 -->", tmp_path, "results/index.md")


def test_a_headline_table_narrows_to_the_columns_and_rows_it_names(tmp_path):
    results = _docs_module("_results")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "np_x.md").write_text(
        "# Title\n\n| ratio | model | ppl | Δ |\n|---:|---|---:|---|\n| 0.1 | NP | 10.0 | -1% |\n"
        "| 0.1 | FLAP | 11.0 |  |\n| 0.1 | SPP | 9.0 | -2% |\n"
    )
    marker = "<!-- results-table: np_x.md#1; columns: model | ppl; rows: model = SPP | NP -->"
    page = results.expand(marker, tmp_path, "x.md")  # the file's row order, the marker's column order
    assert page.splitlines()[:4] == ["| model | ppl |", "| --- | ---: |", "| NP | 10.0 |", "| SPP | 9.0 |"]
    for bad, error in (
        ("columns: model | loss", "no column"),
        ("rows: model = NP | RIA", "no row"),
        ("rows: method = NP", "no column"),
        ("colums: model", "unknown option"),
    ):
        with pytest.raises(results.ResultsError, match=error):
            results.expand(f"<!-- results-table: np_x.md#1; {bad} -->", tmp_path, "x.md")


def test_plots_draw_from_the_committed_results():
    plots = _docs_module("_plots")
    for name in plots.PLOTS:
        svg = plots.plot(REPO, name)
        assert svg.startswith('<figure class="op-plot">') and "<svg" in svg and "</figcaption>" in svg
        assert plots.plot(REPO, name) == svg, f"plot {name} is not deterministic"


def test_formulas_become_mathml():
    hooks = _docs_module("hooks")
    html = (
        '<p><span class="arithmatex">\\(\\gamma = \\texttt{compensation\\_damping}\\)</span></p>'
        '<div class="arithmatex">\\[\\tfrac12 \\lVert W \\rVert^2\\]</div>'
    )
    out = hooks.on_page_content(html, None, None, None)
    assert "arithmatex" not in out and out.count("<math") == 2 and 'display="block"' in out
    assert "compensation_damping" in out and "\\" not in out


def _written_sources():
    """The package, the benchmark scripts and their notes, and the docs sources (the results files are records of a
    run, their commands as they were typed, and stay as written)."""
    yield from (REPO / "optimum_prune").rglob("*.py")
    yield from (REPO / "benchmarks").glob("*.py")
    yield from (REPO / "benchmarks").glob("*.md")
    yield from (REPO / "benchmarks" / "notes").rglob("*.md")
    yield from (p for p in DOCS.rglob("*") if p.suffix in (".md", ".py", ".yml"))


def test_no_references_outside_the_repository():
    """The code, the benchmarks and the docs point to the docs pages and results files, not to a specification
    document or an issue tracker outside the repository (links to other projects' issues are fine)."""
    offenders = [
        f"{path.relative_to(REPO)}:{i}"
        for path in _written_sources()
        for i, line in enumerate(path.read_text("utf-8").splitlines(), 1)
        if re.search(r"\bSPEC\b|spec §|the spec's|\b[Ii]ssues? #?\d+\b", line) and "github.com" not in line
    ]
    assert not offenders, f"references outside the repository: {offenders}"


def test_no_measurements_in_the_configurations():
    """A configuration's docstring says what each option does; the measurements behind a default live on the
    method's page (its "The paper's setting and our defaults" section)."""
    for config_cls in map(get_config_class, available_methods()):
        doc = config_cls.__doc__ or ""
        found = re.findall(r"SmolLM2|DINOv2|BBC|benchmarks/results|perplexity \d|\d+(?:\.\d+)? vs \d", doc)
        assert not found, f"{config_cls.__name__}'s docstring carries measurements: {found}"


def test_docs_paths_in_docstrings_exist():
    """`docs/...md` pages named in the package's docstrings and comments exist."""
    for path in (REPO / "optimum_prune").rglob("*.py"):
        for ref in re.findall(r"\bdocs/[\w/-]+\.md\b", path.read_text("utf-8")):
            assert (REPO / ref).is_file(), f"{path.relative_to(REPO)} names {ref}, which does not exist"


def test_hf_args_blocks_become_lists():
    spec = importlib.util.spec_from_file_location("griffe_hf_args", DOCS / "griffe_hf_args.py")
    ext = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(ext)
    except ModuleNotFoundError as e:  # griffe comes with the [docs] extra
        pytest.fail(f"needs the [docs] extra (make install installs it): {e}")
    doc = (
        "Summary.\n\nArgs:\n    a (`int`, defaults to `1`) / b (`str`): both\n        continued.\n"
        "    kwargs: the rest.\n\nReturns:\n    `int`: one."
    )
    assert ext.hf_args_to_markdown(doc).splitlines() == [
        "Summary.",
        "",
        "",
        "**Arguments:**",
        "",
        "- **a** (`int`, defaults to `1`) / **b** (`str`): both",
        "  continued.",
        "- **kwargs**: the rest.",
        "",
        "Returns:",
        "    `int`: one.",
    ]
