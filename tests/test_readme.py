"""The README, read as a new user would: every snippet, command, name, option and link in it works on this checkout.

The quickstart and the command-line examples run as written on a tiny random Llama (with SmolLM2's tokenizer) that
stands in for "path/to/model" / MODEL; the demo itself (SmolLM2, minutes) is only parsed, and the duration `make help`
quotes comes from the committed run's results file.
"""

import ast
import dataclasses
import importlib
import inspect
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

import optimum_prune
from optimum_prune import AutoPruner
from optimum_prune.calibration.data import bbc_news_dir
from optimum_prune.cli import build_parser, main
from optimum_prune.registry import get_config_class

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def _commands(program: str) -> list[str]:
    """The `program ...` lines of the bash blocks, continuation lines joined and comments dropped."""
    lines = "\n".join(_blocks("bash")).replace("\\\n", " ").splitlines()
    return [line.split("#")[0].strip() for line in lines if line.startswith(program + " ")]


def test_python_snippets_compile_and_import_existing_names():
    blocks = _blocks("python")
    assert blocks, "the README has no python snippet"
    for i, block in enumerate(blocks):
        tree = ast.parse(compile(block, f"README python block {i}", "exec", ast.PyCF_ONLY_AST))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"block {i}: {node.module} has no {alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)


def test_inline_code_names_exist_and_calls_construct():
    """`optimum_prune.x(...)` names resolve; `SomeConfig(...)` examples construct; `name=value` options are accepted."""
    spans = re.findall(r"`([^`\n]+)`", README)
    dotted = {m for s in spans for m in re.findall(r"\boptimum_prune(?:\.\w+)+", s)}
    assert dotted
    for name in dotted:
        parts = name.split(".")
        obj = importlib.import_module(parts[0])
        for part in parts[1:]:
            obj = getattr(obj, part, None) or importlib.import_module(f"{obj.__name__}.{part}")
    public = {n: getattr(optimum_prune, n) for n in optimum_prune.__all__}
    calls = [s for s in spans if re.fullmatch(r"[A-Z]\w*Config\(.*\)", s)]
    assert calls
    for call in calls:
        eval(call, {}, public)  # noqa: S307 - the README's own examples, e.g. FistaConfig(spectral=False)
    configs = [get_config_class(m) for m in optimum_prune.available_methods()]
    configs += [optimum_prune.FinetuneConfig, optimum_prune.CalibrationConfig]
    api = {
        p
        for f in (AutoPruner.from_pretrained, AutoPruner.save_pretrained, optimum_prune.prune_)
        for p in inspect.signature(f).parameters
    }
    for span in spans:  # e.g. `standardize_per_layer=True`, `solver="newton", lambda_=10`
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
        assert owners, f"`{span}`: no config has the option(s) {sorted(kwargs)}"
        for owner in owners:
            owner(**kwargs)


def test_links_point_to_existing_files_and_headings():
    def slugs(text: str) -> set[str]:
        titles = re.findall(r"^#+ (.+)$", text, re.M)
        return {re.sub(r"[^\w\- ]", "", t.lower()).replace(" ", "-") for t in titles}

    links = re.findall(r"\]\(([^)\s]+)\)", README)
    assert links
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = REPO / path if path else REPO / "README.md"
        assert target.exists(), f"README links to {link}, which does not exist"
        if anchor:
            assert anchor in slugs(target.read_text(encoding="utf-8")), f"no heading for #{anchor} in {target.name}"


def test_make_targets_exist():
    makefile = (REPO / "Makefile").read_text()
    lines = "\n".join(_blocks("bash")).splitlines()
    targets = [word for line in lines if line.startswith("make ") for word in line.split("#")[0].split()[1:]]
    assert "demo" in targets and "test" in targets
    for target in targets + ["install", "style", "quality", "bench"]:  # the last ones: named in the prose
        assert re.search(rf"^{target}:", makefile, re.M), f"the README names `make {target}`, the Makefile lacks it"


def test_demo_duration_comes_from_the_results_file():
    """No hand-written duration: `make help` quotes the wall time of the committed demo run's results file."""
    result = json.loads((REPO / "benchmarks/results/demo_smollm2.json").read_text(encoding="utf-8"))
    duration = f"{result['timings_s']['total_s'] / 60:.1f} min"
    make = subprocess.run(["make", "-s", "-C", str(REPO), "help"], capture_output=True, text=True, timeout=60)
    assert make.returncode == 0 and duration in make.stdout, make.stdout + make.stderr


@pytest.fixture
def readme_world(tmp_path, monkeypatch, tiny_llama, smollm2_tokenizer):
    """A working directory holding what the README's examples name: a model, texts/, held_out/, held_out.txt."""
    model = tmp_path / "model"
    tiny_llama.save_pretrained(model)
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


def test_quickstart_runs_as_written(readme_world, capsys):
    block = _blocks("python")[0]
    assert '"path/to/model"' in block
    exec(compile(block.replace('"path/to/model"', repr(str(readme_world))), "README quickstart", "exec"), {})  # noqa: S102
    out = capsys.readouterr().out
    assert "numerical" in out and re.search(r"^\d+\.\d+$", out.strip().splitlines()[-1]), out  # report, perplexity
    assert (readme_world.parent / "out" / "pruning_config.json").is_file()


def test_command_line_examples_run_as_written(readme_world, capsys):
    commands = _commands("optimum-prune")
    assert {c.split()[1] for c in commands} >= {"prune", "eval", "bench", "demo"}
    parser = build_parser()
    for command in commands:
        argv = [str(readme_world) if a in ("MODEL", "path/to/model") else a for a in shlex.split(command)[1:]]
        parser.parse_args(argv)  # every flag the README shows exists
        if argv[0] == "demo":
            continue  # SmolLM2 end to end takes minutes; `make demo` is measured separately
        if argv[0] == "bench":  # as written, but one short round (the later flags win): timing is not tested here
            argv += ["--warmup", "0", "--repeats", "1", "--new-tokens", "2"]
        if argv[0] == "push":
            continue  # needs the Hub; tests/test_hub.py covers it with the network call replaced
        if argv[0] == "finetune":  # as written, two steps
            argv += ["--steps", "2"]
        if argv[0] == "search":  # as written, but a 10-step search sized for the tiny model (the later flags win)
            argv += ["--steps", "10", "--num-samples", "8", "--seq-len", "64"]
            argv += ["--set", "lr=0.08", "--set", "lambda_=0.7", "--set", "betas=[0.5, 0.9]"]
        if argv[0] == "eval" and "--tasks" in argv:  # as written, on a few documents
            argv += ["--limit", "5"]
        assert main(argv) == 0, command
    capsys.readouterr()
