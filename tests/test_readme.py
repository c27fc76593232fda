"""The README and the docs pages, read as a new user would: every snippet, command, name, option and link works.

The quickstart runs with SmolLM2-135M and the BBC articles from their wheels (what a pip user runs first), at the
demo's settings made small, and prints what the demo prints at those; its settings as written are the demo's, and
the figures it quotes the committed demo run's. The docs pages' other python blocks and the command-line
examples run as written on a tiny random Llama (with SmolLM2's tokenizer) that stands in for "path/to/model" / MODEL, in a directory holding the texts they name
(`texts/`, `held_out/`, `held_out.txt`); a few long settings are shortened (`_SHORTER`, and `_run_command` for the CLI). A block that
cannot run here says why in a `<!-- docs-test: skip (reason) -->` comment right above it (the Hub, a GPU); it is
still compiled and its imports resolved. The demo itself (SmolLM2, minutes) is only parsed, and the duration `make help`
quotes comes from the committed run's results file.
"""

import ast
import copy
import dataclasses
import importlib
import importlib.util
import inspect
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
from testing_utils import SMALL_DEMO

import optimum_prune
from optimum_prune import AutoPruner
from optimum_prune.calibration.data import bbc_news_dir
from optimum_prune.cli import build_parser, main
from optimum_prune.methods.registry import get_config_class

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
README = (REPO / "README.md").read_text(encoding="utf-8")
# Pages another branch of the docs work writes (docs/methods/<method>.md, results, design, contributing, reference):
# until the site exists (mkdocs.yml), a link to one of them may point to a page not written yet. Once mkdocs.yml is
# there, every link must resolve.
PLANNED = {
    *(f"docs/methods/{m}.md" for m in ("numerical", "fista", "amp", "spp", "wanda", "sparsegpt", "flap", "ria")),
    "docs/methods/magnitude.md",
    "docs/design.md",
    "docs/contributing/adding-a-method.md",
    "docs/contributing/adding-an-architecture.md",
}
SKIP = re.compile(r"<!-- docs-test: skip \((.+?)\) -->\n```")
# Long settings of the python examples, shortened for the tiny model.
_SHORTER = {
    # FinetuneConfig: two steps of 128-token sequences, 1,024 held-out tokens scored
    "max_steps=200": "max_steps=2, eval_max_tokens=1024",
    "learning_rate=2e-4, seq_len=512": "learning_rate=2e-4, seq_len=128",
    "AMPConfig(sparsity=0.5)": "AMPConfig(sparsity=0.5, cg_steps=3, refit_steps=5)",  # its default solver is "cg"
    "limit=20": "limit=5",
    # the method pages' calibration, sized for a real model (the tiny model's SPP search would hold GBs of logits)
    "num_samples=64, seq_len=512": "num_samples=8, seq_len=128",
    "num_samples=8, seq_len=512": "num_samples=8, seq_len=128",  # AMP's cost grows with the square of the window
    # SPP's default search, its 120 steps on 2 of those windows each instead of 8 (the tiny model's 49k-word head
    # makes a step of 8 windows cost a second)
    "SPPConfig(), calibration": "SPPConfig(batch_size=2), calibration",
    # the quickstart's speed comparison of SmolLM2 (10 rounds of 32 tokens: a minute), one short round
    'compare_speed({"dense": dense, "pruned": model}, pruner.tokenizer)': (
        'compare_speed({"dense": dense, "pruned": model}, pruner.tokenizer, prompt_len=16, new_tokens=2, warmup=0,'
        " repeats=2)"
    ),
}


def _name(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _fenced(text: str) -> list[tuple[str, str, str | None]]:
    """(language, code, skip reason or None) of every fenced block, in page order."""
    blocks = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        skip = SKIP.search(text, max(0, match.start() - 300), match.start() + 3)
        reason = skip.group(1) if skip and skip.end() == match.start() + 3 else None
        blocks.append((match.group(1), match.group(2), reason))
    return blocks


def _blocks(language: str, text: str = README) -> list[str]:
    return [code for lang, code, _ in _fenced(text) if lang == language]


def _command_lines(code: str) -> list[str]:
    """The lines of a bash block, continuation lines joined and comments dropped."""
    lines = code.replace("\\\n", " ").splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def _cli_argv(line: str) -> list[str] | None:
    """The `optimum-prune` arguments of a command line: `optimum-prune ...`, `... -m optimum_prune.cli ...` (torchrun,
    accelerate launch) or `optimum-cli prune ...` (the same options); None for any other command."""
    words = shlex.split(line)
    if words[0] == "optimum-prune":
        return words[1:]
    if words[0] == "optimum-cli":
        return words[1:]
    if "optimum_prune.cli" in words and words[words.index("optimum_prune.cli") - 1] == "-m":
        return words[words.index("optimum_prune.cli") + 1 :]
    return None


def _commands(program: str, text: str = README) -> list[str]:
    return [line for code in _blocks("bash", text) for line in _command_lines(code) if line.startswith(program + " ")]


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_python_snippets_compile_and_import_existing_names(page):
    blocks = _blocks("python", _text(page))
    if page.name == "README.md":
        assert blocks, "the README has no python snippet"
    for i, block in enumerate(blocks):
        tree = ast.parse(compile(block, f"{_name(page)} python block {i}", "exec", ast.PyCF_ONLY_AST))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{_name(page)} block {i}: {node.module} has no {alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)


def test_every_code_block_is_python_or_bash_and_skips_say_why():
    for page in PAGES:
        text = _text(page)
        for language, _code, _ in _fenced(text):
            if language == "py":  # a source file of the package included verbatim (pymdownx.snippets)
                assert re.fullmatch(r'(\s*--8<-- "[^"]+"\s*)+', _code), (
                    f"{_name(page)}: a ```py block that is not an include"
                )
                continue
            assert language in ("python", "bash"), f"{_name(page)}: a ```{language} block the tests do not check"
        for match in re.finditer(r"<!-- docs-test: skip", text):
            assert SKIP.match(text, match.start()), f"{_name(page)}: a skip comment not right above a block"
    for long in _SHORTER:
        assert any(long in _text(page) for page in PAGES), f"_SHORTER: no example has {long} any more"


def test_inline_code_names_exist_and_calls_construct():
    """`optimum_prune.x(...)` names resolve; `SomeConfig(...)` examples construct; `name=value` options are accepted."""
    spans = [(_name(p), s) for p in PAGES for s in re.findall(r"`([^`\n]+)`", _text(p))]
    dotted = {(page, m) for page, s in spans for m in re.findall(r"\boptimum_prune(?:\.\w+)+", s)}
    assert dotted
    for page, name in dotted:
        parts = name.split(".")
        obj = importlib.import_module(parts[0])
        for part in parts[1:]:
            try:
                obj = getattr(obj, part, None) or importlib.import_module(f"{obj.__name__}.{part}")
            except ImportError:
                pytest.fail(f"{page}: `{name}` does not exist")
    public = {n: getattr(optimum_prune, n) for n in optimum_prune.__all__}
    calls = [(page, s) for page, s in spans if re.fullmatch(r"[A-Z]\w*Config\(.*\)", s)]
    assert calls
    for page, call in calls:
        try:
            eval(call, {}, public)  # noqa: S307 - the pages' own examples, e.g. FISTAConfig(spectral=False)
        except Exception as error:
            pytest.fail(f"{page}: `{call}` fails: {error!r}")
    configs = [get_config_class(m) for m in optimum_prune.available_methods()]
    configs += [optimum_prune.FinetuneConfig, optimum_prune.CalibrationConfig]
    api = {
        p
        for f in (AutoPruner.from_pretrained, optimum_prune.save_pruned_model, optimum_prune.prune_)
        for p in inspect.signature(f).parameters
    }
    for page, span in spans:  # e.g. `standardize_per_layer=True`, `solver="newton", lambda_=10`
        if not re.match(r"\w+=[^=]", span):
            continue  # not an option (`model_type = "..."`, `torch==2.13.0`)
        try:
            call = ast.parse(f"_({span})", mode="eval").body
        except SyntaxError:
            continue
        if not isinstance(call, ast.Call) or call.args or not call.keywords:
            continue
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if isinstance(k.value, ast.Constant)}
        if set(kwargs) & api or len(kwargs) < len(call.keywords):
            continue  # AutoPruner arguments (`gguf_file=...`, `overwrite=True`)
        owners = [c for c in configs if set(kwargs) <= {f.name for f in dataclasses.fields(c)}]
        assert owners, f"{page}: `{span}`: no config has the option(s) {sorted(kwargs)}"
        errors = []
        for owner in owners:  # an option name two configs share (`momentum`) needs one that takes the value
            try:
                owner(**kwargs)
            except (TypeError, ValueError) as error:
                errors.append(f"{owner.__name__}: {error}")
        assert len(errors) < len(owners), f"{page}: `{span}`: " + "; ".join(errors)


def _slugs(text: str) -> set[str]:
    """The anchors of a page's headings: their slugs, and explicit ids (`## Title {#id}`, attr_list)."""
    titles = re.findall(r"^#+ (.+)$", text, re.M)
    explicit = {m for t in titles for m in re.findall(r"\{#([\w-]+)\}", t)}
    return explicit | {re.sub(r"[^\w\- ]", "", t.lower()).replace(" ", "-") for t in titles}


def _generated_anchors(target: Path) -> bool:
    """Pages whose headings exist only once the site is built (API reference entries): `mkdocs build --strict`
    checks the anchors into them."""
    text = _text(target) if target.suffix == ".md" else ""
    return DOCS in target.parents and re.search(r"^::: ", text, re.M) is not None


def _study_anchors(target: Path) -> set[str]:
    """The anchors a Results records page (`docs/results/records/<study>.md`, the one holding `<!-- study: -->`) gets
    when docs/hooks.py assembles it: its notes' headings and one per results file of the study (`docs/_results.py`
    says which)."""
    match = re.search(r"<!-- study: (\w+) -->", _text(target))
    if not match:
        return set()
    spec = importlib.util.spec_from_file_location("_results", DOCS / "_results.py")
    results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results)
    files = results.results_files(REPO)[match.group(1)]
    notes = REPO / results.NOTES_DIR / f"{match.group(1)}.md"
    return {p.stem for p in files} | (_slugs(_text(notes)) if notes.exists() else set())


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_links_point_to_existing_files_and_headings(page):
    """Relative links resolve from the page; a docs page links only inside docs/ (what `mkdocs build --strict` sees)."""
    text = _text(page)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    if page.name == "README.md":
        assert links
    site = (REPO / "mkdocs.yml").exists()
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        assert not link.startswith("/"), f"{_name(page)}: use a relative link, not {link}"
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if DOCS in page.parents:
            assert DOCS in target.parents, f"{_name(page)} links to {link}, outside docs/ (a broken link on the site)"
        if not target.exists() and not site and target.relative_to(REPO).as_posix() in PLANNED:
            continue
        assert target.exists(), f"{_name(page)} links to {link}, which does not exist"
        if anchor and not _generated_anchors(target):
            anchors = _slugs(_text(target)) | _study_anchors(target)
            assert anchor in anchors, f"{_name(page)}: no heading for #{anchor} in {target.name}"


def test_every_planned_page_of_this_guide_exists_and_the_readme_links_them():
    ours = ["docs/index.md", "docs/quickstart.md", "docs/methods/index.md"]
    ours += [f"docs/guides/{g}.md" for g in ("recipes", "recovery-and-hub", "large-models", "deployment", "vision")]
    ours += ["docs/guides/cli.md"]
    for page in ours:
        assert (REPO / page).is_file(), page
        assert f"]({page})" in README or page == "docs/index.md", f"the README does not link {page}"


def test_make_targets_exist():
    makefile = (REPO / "Makefile").read_text()
    targets = {"install", "style", "quality", "bench"}  # named in the README's prose
    for page in PAGES:
        lines = [line for code in _blocks("bash", _text(page)) for line in _command_lines(code)]
        found = [word for line in lines if line.startswith("make ") for word in line.split()[1:]]
        if page.name == "README.md":
            assert "demo" in found and "test" in found
        targets.update(found)
    for target in targets:
        assert re.search(rf"^{target}:", makefile, re.M), f"the docs name `make {target}`, the Makefile lacks it"


def test_demo_duration_comes_from_the_results_file():
    """No hand-written duration: `make help` quotes the wall time of the committed demo run's results file."""
    result = json.loads((REPO / "benchmarks/results/demo_smollm2.json").read_text(encoding="utf-8"))
    duration = f"{result['timings_s']['total_s'] / 60:.1f} min"
    make = subprocess.run(["make", "-s", "-C", str(REPO), "help"], capture_output=True, text=True, timeout=60)
    assert make.returncode == 0 and duration in make.stdout, make.stdout + make.stderr


def _read(rel: str) -> str:
    return (REPO / rel).read_text(encoding="utf-8")


def _figures(text: str) -> list[str]:
    """Every number of a text (integers and decimals; `1.16×`, `+6%`, `0.1` all count)."""
    return re.findall(r"(?<![\w.])\d+(?:\.\d+)?", text)  # not the 32 of float32 or the 8 of q8_0


def _table_cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []


def _holds(cells: list[str], figures: list[str]) -> bool:
    """Whether every figure is a number of one of `cells` (a whole number there: 1.1 is not in 1.16)."""
    return all(any(f in _figures(c) for c in cells) for f in figures)


def quoted_figures_errors(page: str, files: list[str], block: str, read) -> list[str]:
    """What is wrong with one FIGURES block of `page`: each row names one of `files` as its source, and every number
    of each of its cells (derived ones such as a hand-computed `+6%` included) stands in the cells of one table row
    of that file, so the quoted cell is tied to the results row it comes from."""
    errors = []
    lines = block.splitlines()
    body = lines[next((i + 1 for i, line in enumerate(lines) if re.match(r"^\|[-:| ]+\|$", line)), 0) :]
    rows = [row for row in body if _table_cells(row) and _figures(row)]  # the header row excluded
    if not rows:
        return [f"{page}: a FIGURES block without figures"]
    for row in rows:
        named = [f for f in files if f"`{f}`" in row]
        if len(named) != 1:
            errors.append(f"{page}: the row does not name one of {files} as its source: {row}")
            continue
        source = [_table_cells(line) for line in read(named[0]).splitlines() if _table_cells(line)]
        for cell in _table_cells(row):
            figures = [] if f"`{named[0]}`" in cell else _figures(cell)
            if figures and not any(_holds(cells, figures) for cells in source):
                errors.append(f"{page}: no table row of {named[0]} holds the figures {figures} of the cell {cell!r}")
    return errors


def test_quoted_figures_come_from_their_results_files():
    """Figures quoted by hand sit in a table between `<!-- FIGURES FROM: file ... -->` and `<!-- END FIGURES -->`;
    each row names its source (one of those files) and the figures of each of its cells must be numbers of one table
    row of that file, so a re-run that changes the file makes this fail until the page follows."""
    blocks = [
        (_name(page), m)
        for page in PAGES
        for m in re.finditer(r"<!-- FIGURES FROM: (.+?) -->\n(.*?)<!-- END FIGURES -->", _text(page), re.S)
    ]
    assert blocks, "the README's deployment matrix quotes its speedups from results files"
    errors = []
    for page, match in blocks:
        errors += quoted_figures_errors(page, match.group(1).split(), match.group(2), _read)
    assert not errors, "\n".join(errors)


def test_quoted_figures_check_catches_drift():
    """The check above ties a number to a results row: a figure found only elsewhere in the file, or a derived one
    the file does not hold, fails it."""
    source = "# t\n\n| ratio | method | ppl |\n|---|---|---|\n| 0.1 | SPP | 33.70 / 18.62 |\n| 0.2 | NP | 17.02 |\n"
    ok = "| 0.1 | SPP | 33.70 / 18.62 | `r.md` |\n"
    assert quoted_figures_errors("p", ["r.md"], ok, lambda _: source) == []
    split = "| 0.1 | SPP | 33.70 / 17.02 | `r.md` |\n"  # both figures exist, but not in one row
    derived = "| 0.1 | SPP vs NP | +6% | `r.md` |\n"
    drift = "| 0.1 | SPP | 33.71 | `r.md` |\n"
    for bad in (split, derived, drift):
        assert quoted_figures_errors("p", ["r.md"], bad, lambda _: source), bad


@pytest.fixture
def readme_world(tmp_path, monkeypatch, tiny_llama, smollm2_tokenizer):
    """A working directory holding what the examples name: a model, texts/, held_out/, held_out.txt. The model is the
    tiny Llama with MLP widths of 512, so that the servable allocation (blocks of 256 channels) has blocks to remove."""
    from transformers import LlamaForCausalLM

    model = tmp_path / "model"
    config = copy.deepcopy(tiny_llama.config)
    config.intermediate_size = 512
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(model)
    smollm2_tokenizer.save_pretrained(model)
    articles = sorted(bbc_news_dir().glob("business/*.txt"))
    (tmp_path / "texts").mkdir()
    (tmp_path / "held_out").mkdir()
    for i, article in enumerate(articles[:60]):
        (tmp_path / "texts" / f"{i}.txt").write_bytes(article.read_bytes())
    for i, article in enumerate(articles[60:64]):
        (tmp_path / "held_out" / f"{i}.txt").write_bytes(article.read_bytes())
    (tmp_path / "held_out.txt").write_bytes(b"\n\n".join(a.read_bytes() for a in articles[60:64]))
    monkeypatch.chdir(tmp_path)
    return model


def test_the_readme_quickstart_is_the_quickstart_pages_example():
    """The README's quickstart is docs/quickstart.md's first example, which `test_docs_page_examples_run_as_written`
    runs exactly as written (SmolLM2-135M and the BBC articles from the two wheels, a pip user's first run) and
    checks against the committed demo run (`_check_quickstart_output`)."""
    block = _blocks("python")[0]
    assert block == _blocks("python", _text(DOCS / "quickstart.md"))[0], "the README's quickstart and the page differ"
    assert "path/to/" not in block and "smollm2_gguf()" in block


def _demo_settings() -> dict:
    """`run_demo`'s default settings: the demo's, which the quickstart writes out."""
    from optimum_prune.cli.demo import run_demo

    return {k: p.default for k, p in inspect.signature(run_demo).parameters.items()}


def _quickstart_shorter() -> dict[str, str]:
    """The quickstart's settings (the demo's), as written -> `SMALL_DEMO`'s: the test runs it at those, against the
    demo at those (`smollm2_small_demo`)."""
    full, small = _demo_settings(), SMALL_DEMO
    calib, evaluation = (
        "num_samples={num_samples}, seq_len={seq_len}",
        "seq_len={eval_seq_len}, max_tokens={eval_tokens}",
    )
    return {calib.format(**full): calib.format(**small), evaluation.format(**full): evaluation.format(**small)}


def test_the_quickstart_writes_the_demos_settings_and_quotes_its_committed_figures():
    """The quickstart's example is the demo's run (`run_demo`'s defaults), and the perplexities its comments quote
    are the committed demo run's (`benchmarks/results/demo_smollm2.json`, made by `make demo` at those defaults).
    With `test_docs_page_examples_run_as_written` (the example and the demo give the same figures at small settings)
    this ties the quoted figures to what the example prints, without running the full settings in every test run."""
    block, full = _blocks("python", _text(DOCS / "quickstart.md"))[0], _demo_settings()
    calibration, evaluation = _quickstart_shorter()  # as written: once for the calibration, twice for perplexity
    written = [calibration, evaluation, evaluation, f"NumericalConfig(pruning_ratio={full['ratio']})",
               f"split_documents(load_texts(bbc_news_dir()), holdout_fraction={full['holdout_fraction']}, "
               f"seed={full['seed']})", f"{calibration}, seed={full['seed']})"]  # fmt: skip
    for setting in set(written):
        assert block.count(setting) == written.count(setting), f"the quickstart no longer writes the demo's {setting}"
    demo = json.loads((REPO / "benchmarks/results/demo_smollm2.json").read_text(encoding="utf-8"))
    committed = demo["settings"]
    assert committed["method"]["pruning_ratio"] == full["ratio"]
    assert {k: committed["calibration"][k] for k in ("num_samples", "seq_len", "seed")} == {
        "num_samples": full["num_samples"], "seq_len": full["seq_len"], "seed": full["seed"]}  # fmt: skip
    assert committed["evaluation"]["seq_len"] == full["eval_seq_len"]
    assert committed["evaluation"]["max_tokens"] == full["eval_tokens"]
    for side in ("dense", "pruned"):
        quoted = re.search(rf"# {side}: about ([\d.]+)", block)
        committed_ppl = demo[side]["perplexity"]
        assert quoted and float(quoted.group(1)) == round(committed_ppl, 1), (side, committed_ppl)


def _check_quickstart_output(printed: str, directory: Path, demo: dict) -> None:
    """The quickstart, at `SMALL_DEMO`'s settings, prints the demo's dense and pruned perplexities at those settings
    and the report with its time, and saves out/."""
    out = printed.strip().splitlines()
    dense, pruned = float(out[0]), float(out[-1])
    assert dense == pytest.approx(demo["dense"]["perplexity"], rel=1e-5), (dense, demo["dense"]["perplexity"])
    assert pruned == pytest.approx(demo["pruned"]["perplexity"], rel=1e-4), (pruned, demo["pruned"]["perplexity"])
    assert re.search(r"^PruningReport\(method='numerical', target=0.200, .* s\)$", out[1]), out
    assert (directory / "out" / "pruning_config.json").is_file()


def _run_command(argv: list[str], model: Path, command: str) -> None:
    """Run one command line as written, on the tiny model; long or networked steps shortened or left out."""
    argv = [str(model) if a in ("MODEL", "path/to/model") else a for a in argv]
    build_parser().parse_args(argv)  # every flag shown exists
    if argv[0] in ("demo", "push") or command.startswith(("optimum-cli", "torchrun", "accelerate")):
        return  # demo: SmolLM2 end to end (minutes); push: the Hub (tests/test_hub.py); launchers: tests of their own
    if argv[0] == "prune":  # as written, but at most 8 calibration windows of 128 tokens (the later flags win)
        for flag, most in (("--num-samples", 8), ("--seq-len", 128)):
            argv += [flag, str(min(int(argv[argv.index(flag) + 1]), most) if flag in argv else most)]
    if argv[0] == "bench":  # as written, but one short round (the later flags win): timing is not tested here
        argv += ["--warmup", "0", "--repeats", "1", "--new-tokens", "2"]
    if argv[0] in ("finetune", "recover"):  # sequences of 128 tokens, 1,024 held-out tokens scored (later flags win)
        argv += ["--seq-len", "128", "--set", "eval_max_tokens=1024"]
    if argv[0] in ("finetune", "recover") and "--tokens" in argv:  # as written, 64 training tokens
        argv[argv.index("--tokens") + 1] = "64"
    elif argv[0] in ("finetune", "recover"):  # as written, two steps
        argv += ["--steps", "2"]
    if argv[0] == "search":  # as written, but a 10-step search sized for the tiny model (the later flags win)
        argv += ["--steps", "10", "--num-samples", "8", "--seq-len", "64"]
        argv += ["--set", "lr=0.08", "--set", "lambda_=0.7", "--set", "betas=[0.5, 0.9]"]
    if argv[0] == "eval" and "--tasks" in argv:  # as written, on a few documents
        argv += ["--limit", "5"]
    assert main(argv) == 0, command


def test_command_line_examples_run_as_written(readme_world, capsys):
    commands = _commands("optimum-prune")
    assert {c.split()[1] for c in commands} >= {"prune", "eval", "bench", "demo"}
    for command in commands:
        _run_command(_cli_argv(command), readme_world, command)
    capsys.readouterr()


DOC_PAGES = sorted(
    p for p in DOCS.rglob("*.md") if any(skip is None and lang != "py" for lang, _, skip in _fenced(_text(p)))
)


@pytest.mark.parametrize("page", DOC_PAGES, ids=_name)
def test_docs_page_examples_run_as_written(page, readme_world, capsys, request):
    """Every python block and command line of the page, in page order, in one namespace and one directory. The
    quickstart's example runs on SmolLM2 at `SMALL_DEMO`'s settings and must print the demo's figures at those."""
    namespace: dict = {}
    ran = 0
    for i, (language, code, skip) in enumerate(_fenced(_text(page))):
        if skip is not None:
            continue
        if language == "python":
            quickstart = page.name == "quickstart.md" and ran == 0
            for long, short in {**_SHORTER, **(_quickstart_shorter() if quickstart else {})}.items():
                code = code.replace(long, short)
            code = code.replace('"path/to/model"', repr(str(readme_world)))
            capsys.readouterr()
            try:
                exec(compile(code, f"{_name(page)} python block {i}", "exec"), namespace)  # noqa: S102
            except Exception as error:
                hint = "a block that cannot run on the tiny model says why: <!-- docs-test: skip (reason) --> above it"
                raise AssertionError(f"{_name(page)} python block {i} fails ({hint})") from error
            if quickstart:
                demo = request.getfixturevalue("smollm2_small_demo")[1]
                _check_quickstart_output(capsys.readouterr().out, readme_world.parent, demo)
            ran += 1
        elif language == "bash":
            for line in _command_lines(code):
                if line.startswith("make "):
                    continue  # test_make_targets_exist; `make test` / `make demo` are not run from the tests
                argv = _cli_argv(line)
                assert argv is not None, f"{_name(page)}: `{line}` is neither make nor an optimum-prune command"
                _run_command(argv, readme_world, line)
                ran += 1
    assert ran, f"{_name(page)}: no example ran"
    capsys.readouterr()


def test_readme_stays_a_front_page():
    """The README is what it is, how to install and start, which method, and links: at most 12 KB. Everything else
    (method details, guides, results) lives in docs/ and benchmarks/, where it is generated or tested."""
    size = (REPO / "README.md").stat().st_size
    assert size <= 12_000, f"README.md is {size} bytes: move the detail into a docs page and link it"
