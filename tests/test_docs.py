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
PAGE_OF = {"spp_ria": "spp"}
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


def test_results_page_links_name_existing_results_files():
    """Links into the results page use a results file's stem as the anchor (docs/hooks.py makes them)."""
    stems = {p.stem for p in (REPO / "benchmarks" / "results").glob("*.md")}
    assert stems
    for path in DOCS.rglob("*.md"):
        for anchor in re.findall(r"results\.md#([\w.-]+)\)", path.read_text("utf-8")):
            assert anchor in stems, f"{path.relative_to(REPO)} links to results.md#{anchor}: no such results file"


def test_results_hook_shows_every_results_file(tmp_path):
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(hooks)
    except ModuleNotFoundError as e:  # mkdocs is the [docs] extra
        pytest.fail(f"needs the [docs] extra (make install installs it): {e}")
    text = hooks.results_markdown(REPO)
    for path in (REPO / "benchmarks" / "results").glob("*.md"):
        assert f"{{#{path.stem}}}" in text
        body = [line for line in path.read_text("utf-8").splitlines() if line.startswith("|")]
        assert all(line in text for line in body), f"{path.name}: a table row is not shown as written"
    # Headings move one level down, so each results file is a section of the page.
    assert not re.search(r"^# ", text, re.M)


def test_no_spec_section_references_in_the_package():
    """The code points to the docs pages, not to a specification document outside the repository."""
    offenders = [
        f"{path.relative_to(REPO)}:{i}"
        for path in (REPO / "optimum_prune").rglob("*.py")
        for i, line in enumerate(path.read_text("utf-8").splitlines(), 1)
        if re.search(r"\bSPEC\b|spec §|the spec's", line)
    ]
    assert not offenders, f"references to SPEC: {offenders}"


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
