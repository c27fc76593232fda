"""Large models: peak memory, time per block and disk traffic of low-memory pruning on Llama-shaped checkpoints (CPU).

Models: random weights with the real shapes (std 1/sqrt(fan_in), so activations keep their scale through the blocks),
generated once under `--work-dir` one block per shard, never whole in memory:
  - `1b`: Llama-3.2-1B (16 blocks, hidden 2048, MLP 8192, 32 query / 8 KV heads, 128,256-token vocabulary, tied
    embeddings), float32 (4.9 GB on disk);
  - `acct`: its first 4 blocks, float32: the per-method accounting;
  - `3b`: Llama-3.2-3B (28 blocks, hidden 3072, MLP 8192, 24 / 8 heads, tied), bfloat16 (6.4 GB);
  - `8b`: Llama-3.1-8B (32 blocks, hidden 4096, MLP 14336, 32 / 8 heads, untied), bfloat16 (16.1 GB).
Calibration: 8 windows of 256 tokens of the protocol's BBC calibration split, tokenized by SmolLM2's tokenizer (its
ids are valid rows of the 128k vocabulary; only the shapes matter here).

Every run is a fresh child process (`python benchmarks/scale.py --child RUN.spec.json`), run under `nice` with the threads
asked (`--threads`). It reports its peak resident memory (VmHWM: anonymous memory plus resident pages of mapped
files, libraries included), the peaks of the anonymous and file-backed parts sampled every 20 ms and, at the largest
sample, what it was doing (the innermost of: loading a block, forward, the method's decision, writing a block,
measuring, saving) and which files its file-backed pages belonged to; the wall and CPU seconds of every block visit
(`report.info["progress"]`); what it wrote to disk (`/proc/self/io`); with `digest`, a hash of every saved tensor
(the 1b in-memory and low-memory runs are compared by them).

`--src DIR` runs the children on another checkout's `optimum_prune` (the `before` runs: the commit before the memory
work); the run records it. A `resume` run is killed (SIGKILL) once `kill_after` blocks are recorded in its
checkpoint directory, then started again with the same arguments: it resumes, and both parts are recorded.

`--model DIR` runs every run on that local checkpoint instead (smoke runs).

Usage (from the repository root)::

    python benchmarks/scale.py --runs acct-wanda acct-numerical --threads 1
    python benchmarks/scale.py --runs acct-wanda --src /path/to/old/checkout --label before
    python benchmarks/scale.py --markdown-only

Results go to benchmarks/results/scale.{json,md}, written after every run; a run already there is skipped unless
`--force`. Long runs do not take the timing lock (they would hold it for hours): their times are CPU seconds per block
besides wall seconds, and the machine's load average is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
# `harness` (torch, optimum_prune) is imported inside the parent's functions only: a child process measures its own
# imports, so this module must not import them at the top.

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results" / "scale"
CALIB = (8, 256)  # calibration windows x tokens
LLAMA = {"vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5}
SHAPES = {  # hidden, MLP, blocks, query heads, KV heads, tied embeddings
    "Llama-3.2-1B": (2048, 8192, 16, 32, 8, True),
    "Llama-3.2-3B": (3072, 8192, 28, 24, 8, True),
    "Llama-3.1-8B": (4096, 14336, 32, 32, 8, False),
    "Llama-3.1-70B": (8192, 28672, 80, 64, 8, False),
}
MODELS = {  # name: (shape, blocks kept, dtype)
    "acct": ("Llama-3.2-1B", 4, "float32"),
    "1b": ("Llama-3.2-1B", None, "float32"),
    "3b": ("Llama-3.2-3B", None, "bfloat16"),
    "8b": ("Llama-3.1-8B", None, "bfloat16"),
}
WANDA, NP = {"method": "wanda", "sparsity": 0.5}, {"method": "numerical", "pruning_ratio": 0.2}
RUNS = {  # name: (model, low_memory, method config, options)
    "acct-wanda": ("acct", True, WANDA, {"digest": True}),
    "acct-sparsegpt": ("acct", True, {"method": "sparsegpt", "sparsity": 0.5}, {}),
    "acct-numerical": ("acct", True, NP, {"digest": True}),
    "acct-flap": ("acct", True, {"method": "flap", "pruning_ratio": 0.2}, {}),
    "acct-fista": ("acct", True, {"method": "fista", "sparsity": 0.5, "max_outer": 1}, {}),
    "acct-mem-wanda": ("acct", False, WANDA, {"digest": True}),
    "acct-mem-numerical": ("acct", False, NP, {"digest": True}),
    "1b-mem-wanda": ("1b", False, WANDA, {"digest": True}),
    "1b-low-wanda": ("1b", True, WANDA, {"digest": True}),
    "1b-mem-numerical": ("1b", False, NP, {"digest": True}),
    "1b-low-numerical": ("1b", True, NP, {"digest": True}),
    "3b-low-wanda": ("3b", True, WANDA, {}),
    "3b-low-numerical": ("3b", True, NP, {}),
    "8b-low-wanda": ("8b", True, WANDA, {}),
    "8b-low-numerical": ("8b", True, NP, {"checkpoint": True, "kill_after": 12}),
}


# ------------------------------------------------------------------------------------------------------ models
def _tokenizer(local: Path | None = None):
    from transformers import AutoTokenizer

    from optimum_prune.samples import SMOLLM2_GGUF_FILE, smollm2_dir

    if local is not None:
        return AutoTokenizer.from_pretrained(local)
    return AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF_FILE)


def llama_config(shape: str, blocks: int | None = None, dtype: str = "bfloat16"):
    from transformers import LlamaConfig

    hidden, mlp, layers, heads, kv, tied = SHAPES[shape]
    return LlamaConfig(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=blocks or layers,
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                       tie_word_embeddings=tied, dtype=dtype, bos_token_id=1, eos_token_id=2, **LLAMA)  # fmt: skip


def _random(shape: list[int], dtype, gen):
    """Random weights (std 1/sqrt(fan_in)) made a band of rows at a time: never a float32 copy of a large matrix."""
    import torch

    out = torch.empty(shape, dtype=dtype)
    if len(shape) == 1:  # norms
        return out.fill_(1)
    step = max((16 << 20) // shape[-1], 1)
    for r in range(0, shape[0], step):
        out[r : r + step] = torch.randn(min(step, shape[0] - r), shape[-1], generator=gen) * shape[-1] ** -0.5
    return out


def make_model(path: Path, name: str) -> Path:
    """The random checkpoint `name` of `MODELS`, generated and written one shard at a time: one per block, one per
    tensor outside the blocks (the largest matrix in memory at once: the embeddings)."""
    if (path / "model.safetensors.index.json").is_file():
        return path
    import torch
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    from optimum_prune.storage.streaming import write_safetensors

    shape, blocks, dtype = MODELS[name]
    config = llama_config(shape, blocks, dtype)
    with init_empty_weights():
        skeleton = LlamaForCausalLM(config)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    groups: dict[str, dict[str, list[int]]] = {}
    for n, t in skeleton.state_dict().items():
        if n == "lm_head.weight" and config.tie_word_embeddings:
            continue
        key = ".".join(n.split(".")[:3]) if n.startswith("model.layers.") else n
        groups.setdefault(key, {})[n] = list(t.shape)
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for k, shapes in enumerate(groups.values()):
        tensors = {n: _random(shape, getattr(torch, dtype), gen) for n, shape in shapes.items()}
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(tensors, tmp / file)
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    index = {"metadata": {"total_size": sum((tmp / f).stat().st_size for f in set(weight_map.values()))},
             "weight_map": weight_map}  # fmt: skip
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(tmp)
    _tokenizer().save_pretrained(tmp)
    os.rename(tmp, path)
    return path


# ----------------------------------------------------------------------------------------------- child process
SAMPLED = ("VmRSS", "RssAnon", "RssFile", "VmHWM", "VmSwap")


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key = line.split(":")[0]
            if key in SAMPLED:
                out[key] = int(line.split()[1]) * 1024
    return out


def _swap_used() -> int:
    """Swap in use on the whole machine (bytes): pages of any process, this one's are its VmSwap."""
    with open("/proc/meminfo", encoding="ascii") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["SwapTotal"] - info["SwapFree"]


def _file_pages() -> dict[str, int]:
    """Resident bytes of mapped files by kind: the checkpoint's shards, libraries, anything else."""
    out: dict[str, int] = {}
    current = None
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                path = parts[5] if len(parts) > 5 else ""
                kind = "checkpoint" if path.endswith(".safetensors") else "libraries" if ".so" in path else "other"
                current = kind if path.startswith("/") else None
            elif current and parts and parts[0] == "Rss:":
                out[current] = out.get(current, 0) + int(parts[1]) * 1024
    return out


class _Sampler(threading.Thread):
    """Peaks of VmRSS / RssAnon / RssFile / VmSwap (the process's pages in swap) every 20 ms, overall and per phase,
    and of the machine's swap in use; at each new peak of VmRSS (by 16 MB), the phase and the file-backed pages by
    kind."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0, "VmSwap": 0}
        self.swap_start = self.swap_peak = _swap_used()
        self.phases: dict[str, dict[str, int]] = {}
        self.phase = ["import"]
        self.at_peak: dict = {}
        self.running = True

    def run(self) -> None:
        while self.running:
            s, phase = _status(), self.phase[-1]
            self.swap_peak = max(self.swap_peak, _swap_used())
            if s["VmRSS"] > self.peak["VmRSS"] + (16 << 20):
                self.at_peak = {"rss": s["VmRSS"], "anon": s["RssAnon"], "file": s["RssFile"], "phase": phase,
                                "file_pages": _file_pages()}  # fmt: skip
            per = self.phases.setdefault(phase, dict.fromkeys(self.peak, 0))
            for k in self.peak:
                self.peak[k] = max(self.peak[k], s[k])
                per[k] = max(per[k], s[k])
            time.sleep(0.02)


def _phase_observer(sampler: _Sampler):
    """Label what the process is doing (the innermost phase the library marks, `optimum_prune.utils.phases`), for
    the sample at the peak."""

    def observe(event: str, name: str, block: int | None) -> None:
        if event == "start":
            sampler.phase.append(name)
        else:
            sampler.phase.pop()

    return observe


def _io() -> dict[str, int]:
    with open("/proc/self/io", encoding="ascii") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _digest(directory: Path) -> dict[str, str]:
    """sha256 of every saved tensor's bytes (read by `safetensors`, one tensor at a time)."""
    import torch
    from safetensors import safe_open

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                t = f.get_tensor(name).contiguous().reshape(-1)
                out[name] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def _commit_of(module_file: str) -> str | None:
    """The commit of the checkout a module was imported from (its code at the start of this process)."""
    try:
        out = subprocess.run(["git", "-C", str(Path(module_file).parent), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=30)  # fmt: skip
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def child(spec: dict) -> None:
    sampler = _Sampler()
    sampler.start()
    io0, t0 = _io(), time.perf_counter()
    from optimum_prune.utils.phases import observe_phases

    with observe_phases(_phase_observer(sampler)):
        _child(spec, sampler, io0, t0)


def _child(spec: dict, sampler: _Sampler, io0: dict[str, int], t0: float) -> None:
    import logging

    import torch
    from safetensors.torch import load_file

    from optimum_prune import AutoPruner, PruningConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    torch.set_num_threads(spec["threads"])
    imported = _status()
    library_commit = _commit_of(__import__("optimum_prune").__file__)
    sampler.phase.append("load model")
    pruner = AutoPruner.from_pretrained(spec["model"], low_memory=spec["low_memory"])
    sampler.phase.pop()
    loaded = _status()
    ids = load_file(spec["ids"])["ids"]
    t_prune, c_prune = time.perf_counter(), time.process_time()
    kwargs = {"checkpoint_dir": spec["checkpoint_dir"]} if spec.get("checkpoint_dir") else {}
    sampler.phase.append("prune")
    report = pruner.prune(PruningConfig.from_dict(spec["config"]), calibration=ids, batch_size=spec["batch_size"],
                          **kwargs)  # fmt: skip
    t_save, c_save = time.perf_counter(), time.process_time()
    sampler.phase[-1] = "save"
    pruner.save_pretrained(spec["out"], overwrite=True, model_card=False)
    sampler.phase.pop()
    t_end = time.perf_counter()
    sampler.running = False
    sampler.join()
    io1 = _io()
    result = {
        "library_commit": library_commit,
        "vmhwm": _status()["VmHWM"],
        "peak_sampled": sampler.peak,
        "vmswap_end": _status().get("VmSwap", 0),
        "machine_swap_used": {"start": sampler.swap_start, "peak": sampler.swap_peak},
        "at_peak": sampler.at_peak,
        "phases": sampler.phases,
        "after_import": imported,
        "after_load": loaded,
        "seconds": {"load": t_prune - t0, "prune": t_save - t_prune, "save": t_end - t_save, "total": t_end - t0},
        "cpu_seconds": {"prune": c_save - c_prune, "total": time.process_time()},
        "io": {k: io1[k] - io0[k] for k in ("read_bytes", "write_bytes", "rchar", "wchar")},
        "block_io": report.info.get("block_io"),
        "activations": report.info.get("activations"),
        "progress": report.info.get("progress"),
        "params_before": report.params_before,
        "params_after": report.params_after,
        "measured": report.measured,
        "digest": _digest(Path(spec["out"])) if spec.get("digest") else None,
    }
    Path(spec["report"]).write_text(json.dumps(result, indent=1))


# ------------------------------------------------------------------------------------------------------ parent
def calibration_ids(work: Path, protocol, local: Path | None = None) -> Path:
    """The calibration windows from the protocol's BBC calibration split, tokenized once (the children read them)."""
    from safetensors.torch import save_file

    path = work / f"ids-seed{protocol.seed}.safetensors"
    ids = protocol.calibration_ids(_tokenizer(local), *CALIB)  # also recorded in the protocol
    if not path.is_file():
        save_file({"ids": ids.contiguous()}, str(path))
    return path


def _sample_line(pid: int) -> str | None:
    """One line of the child's memory and CPU (`HH:MM:SS pid=P VmHWM=kB ... cpu_s=S machine_swap_kB=kB`), or None."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            mem = {k: v.split()[0] for k, v in (line.split(":", 1) for line in f) if k in SAMPLED}
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    cells = " ".join(f"{k}={v}" for k, v in mem.items())
    swap = _swap_used() // 1024
    return f"{time.strftime('%H:%M:%S', time.gmtime())} pid={pid} {cells} cpu_s={cpu:.2f} machine_swap_kB={swap}"


def _launch(cmd: list[str], env: dict, log: Path, kill_when=None) -> tuple[int, float]:
    """Run `cmd` (stderr to `log`; every 5 s a line of its memory and CPU to `log` with suffix `.samples`, for a run
    that never finishes: see `salvage`); with `kill_when()` true, SIGKILL it. Returns (exit status, seconds)."""
    t0 = time.perf_counter()
    with open(log, "a") as err, open(log.with_suffix(".samples"), "a") as samples:
        proc = subprocess.Popen(cmd, env=env, stdout=err, stderr=err)
        tick = 0
        while proc.poll() is None:
            if kill_when is not None and kill_when():
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                break
            line = _sample_line(proc.pid) if tick % 5 == 0 else None
            if line:
                print(line, file=samples, flush=True)
            tick += 1
            time.sleep(1)
    return proc.returncode, time.perf_counter() - t0


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def _wait_for_memory(name: str, want: float, minutes: int) -> None:
    """Wait until `want` bytes are available (never risk the OOM killer on a shared machine)."""
    from optimum_prune.storage.memory import available_memory

    for _ in range(minutes):
        free = available_memory()
        if free is None or free >= want:
            return
        print(f"   {name}: {free / 1e9:.1f} GB available, {want / 1e9:.1f} GB wanted: waiting", file=sys.stderr)
        time.sleep(60)
    raise RuntimeError(f"{name}: {want / 1e9:.1f} GB of memory never became available")


def run_one(name: str, work: Path, models: dict[str, Path], protocol, args) -> dict:
    """One measured run in a fresh process (a `resume` run: killed part way, then run again)."""
    model, low, config, options = RUNS[name]
    out, ckpt = work / "out" / name, work / "checkpoint" / name
    report = work / f"{name}.result.json"
    spec = {"model": str(models[model]), "low_memory": low, "config": config, "ids": str(calibration_ids(work, protocol, args.model)),
            "batch_size": 4, "threads": args.threads, "out": str(out), "report": str(report),
            "digest": options.get("digest", False), "checkpoint_dir": str(ckpt) if options.get("checkpoint") else None}  # fmt: skip
    spec_file = work / f"{name}.spec.json"
    spec_file.write_text(json.dumps(spec))
    cmd = ["nice", "-n", str(args.nice), sys.executable, str(Path(__file__).resolve()), "--child", str(spec_file)]
    src = str(Path(args.src).resolve()) if args.src else str(REPO_ROOT)
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{REPO_ROOT / 'benchmarks'}",
           "OMP_NUM_THREADS": str(args.threads)}  # fmt: skip
    on_disk = sum(f.stat().st_size for f in models[model].glob("*.safetensors"))
    want = 1.5 * on_disk + 2e9 if not low else max(0.25 * on_disk, 1.5e9)  # the targets
    _wait_for_memory(name, want, args.wait_minutes)
    shutil.rmtree(ckpt, ignore_errors=True)
    report.unlink(missing_ok=True)
    log = work / f"{name}.log"
    log.unlink(missing_ok=True)
    log.with_suffix(".samples").unlink(missing_ok=True)  # appended to by `_launch`: a salvage reads this run's only
    load = os.getloadavg()
    parts = []
    kill_after = options.get("kill_after")
    if kill_after:  # the resume demonstration: killed once `kill_after` blocks are finished

        def finished() -> bool:
            return len(list((ckpt / "stage0").glob("block*.json"))) >= kill_after

        status, seconds = _launch(cmd, env, log, kill_when=finished)
        parts.append({"killed": status == -signal.SIGKILL, "exit_status": status, "wall_seconds": seconds,
                      "blocks_finished": len(list((ckpt / "stage0").glob("block*.json")))})  # fmt: skip
    for _ in range(5):  # the machine is shared: memory can run out between the check above and the run's own
        status, seconds = _launch(cmd, env, log)
        if not (status and "InsufficientMemoryError" in log.read_text()[-2000:]):
            break
        _wait_for_memory(name, want, args.wait_minutes)
    if status:
        raise RuntimeError(f"{name} failed (exit status {status}); see {log}:\n{log.read_text()[-4000:]}")
    parts.append({"exit_status": status, "wall_seconds": seconds})
    result = json.loads(report.read_text())
    text = log.read_text()
    resumed = [line for line in text.splitlines() if "already finished" in line]
    result.update({
        "model": model, "low_memory": low, "config": config, "calibration": list(CALIB), "threads": args.threads,
        "code": args.label, "src": None if args.src is None else str(args.src), "parts": parts,
        "resumed": resumed[-1].split(" ", 3)[-1] if resumed else None,
        "wall_seconds": sum(p["wall_seconds"] for p in parts), "loadavg_before": load, "loadavg_after": os.getloadavg(),
        "output_bytes": _dir_bytes(out), "checkpoint_bytes": _dir_bytes(ckpt),
    })  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(ckpt, ignore_errors=True)
    return result


def salvage(name: str, work: Path, args) -> dict:
    """What a run that has not finished (still running at a deadline, or killed) measured so far, from its log and
    samples: the blocks each process logged (wall seconds between its progress lines; CPU seconds from the samples,
    the logged ones where no sample falls between), and the largest sampled VmHWM, RssAnon, RssFile, VmSwap."""
    import re

    progress = re.compile(r"^(\S+ \S+),\d+ optimum_prune\.pipeline\.progress pass (\d+), block (\d+)/\d+: "
                          r"([\d.]+) (s|min|h) \(CPU ([\d.]+) (s|min|h)\)")  # fmt: skip
    memory = re.compile(r"memory ([\d.]+) GB \(anonymous ([\d.]+), file ([\d.]+)\), peak ([\d.]+) GB")
    unit = {"s": 1, "min": 60, "h": 3600}
    samples = []  # (seconds of the day, pid, values); a run started before the parent sampled has none
    sample_file = work / f"{name}.samples"
    for line in sample_file.read_text().splitlines() if sample_file.is_file() else []:
        stamp, *cells = line.split()
        h, m, sec = (int(x) for x in stamp.split(":"))
        values = {k.rstrip(":"): float(v) for k, v in (c.split("=") for c in cells)}
        samples.append((3600 * h + 60 * m + sec, int(values.pop("pid")), values))

    def cpu_at(t: float) -> tuple[int, float] | None:  # the last sample at or before t: (pid, CPU seconds)
        before = [(pid, v["cpu_s"]) for ts, pid, v in samples if ts <= t and "cpu_s" in v]
        return before[-1] if before else None

    blocks, process, last, resumed = [], -1, None, None
    for line in (work / f"{name}.log").read_text().splitlines():
        if "with low_memory=True" in line and "Loaded" in line:  # a process starts
            process, last = process + 1, None
        if "already finished" in line:  # a process resumed the run from its checkpoint directory
            resumed = line.split(" ", 3)[-1]
        match = progress.match(line)
        if not match:
            continue
        clock = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S")
        t = 3600 * clock.hour + 60 * clock.minute + clock.second
        logged = float(match[4]) * unit[match[5]]
        same_pass = last is not None and last["pass"] == int(match[2]) - 1
        seconds = t - last["t"] if same_pass else logged
        cpu = float(match[6]) * unit[match[7]]
        now, then = cpu_at(t), cpu_at(last["t"]) if same_pass else None
        if now and then and now[0] == then[0] and now[1] > then[1]:
            cpu = now[1] - then[1]
        last = {"t": t, "pass": int(match[2]) - 1}
        blocks.append({"process": process, "pass": int(match[2]) - 1, "block": int(match[3]) - 1,
                       "seconds": seconds, "cpu_seconds": round(cpu, 2), "logged_seconds": logged})  # fmt: skip
        mem = memory.search(line)
        if mem and not samples:  # the process's memory at the end of the block, and its peak so far
            rss, anon, file, high = (1e9 * float(x) for x in mem.groups())
            blocks[-1].update({"rss": rss, "anon": anon, "file": file, "peak": high})
    if samples:
        keys = ("VmRSS", "RssAnon", "RssFile", "VmSwap", "VmHWM", "machine_swap_kB")
        top = {k: 1024 * max(v.get(k, 0) for _, _, v in samples) for k in keys}
    else:  # what the progress lines say (at the end of each block; the peak is the kernel's VmHWM)
        top = {k: max(b.get(key, 0) for b in blocks) for k, key in (("VmRSS", "rss"), ("RssAnon", "anon"),
                                                                     ("RssFile", "file"), ("VmHWM", "peak"))}  # fmt: skip
    model, low, config, _ = RUNS[name]
    spec = json.loads((work / f"{name}.spec.json").read_text())
    return {
        "partial": True, "library_commit": _commit_of(str(Path(args.src or REPO_ROOT) / "optimum_prune" / "x")),
        "model": model, "low_memory": low, "config": config, "calibration": list(CALIB),
        "threads": spec["threads"], "code": args.label, "src": None,
        "vmhwm": top.pop("VmHWM"), "machine_swap_used": {"peak": top.pop("machine_swap_kB", None)},
        "peak_sampled": top, "samples": {"count": len(samples)},
        "progress": {"blocks": blocks}, "processes": process + 1, "resumed": resumed,
        "loadavg_before": list(os.getloadavg()),
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------- tables
def _gb(b: float | None) -> str:
    return "" if b is None else f"{b / 1e9:.2f}"


def _key(name: str, label: str) -> str:
    return name if label == "after" else f"{name}@{label}"


def markdown(results: dict) -> str:
    from _scale_report import render

    return render(results)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--work-dir", default="/tmp/optimum_prune_scale", help="models and outputs (~40 GB for 8b)")
    parser.add_argument("--output", default=str(RESULTS), help="results prefix (.json / .md)")
    parser.add_argument("--force", action="store_true", help="re-run runs already in the results")
    parser.add_argument("--markdown-only", action="store_true", help="rewrite the .md from the .json; run nothing")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document split and calibration windows")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    parser.add_argument("--nice", type=int, default=5, help="niceness of each run")
    parser.add_argument("--src", default=None, help="run the children on this checkout's optimum_prune")
    parser.add_argument("--label", default="after", help="the code the runs measure ('after', 'before')")
    parser.add_argument("--keep-models", action="store_true", help="keep the generated checkpoints afterwards")
    parser.add_argument("--wait-minutes", type=int, default=120, help="wait for memory to be free for so long")
    parser.add_argument("--model", type=Path, default=None, help="a local model directory for every run (smoke runs)")
    parser.add_argument("--salvage", action="store_true",
                        help="record what the runs (still running or killed) measured so far, from their logs")  # fmt: skip
    args = parser.parse_args(argv)
    if args.child:  # measures its own imports: no harness (torch) before
        return child(json.loads(Path(args.child).read_text()))
    import harness

    out = Path(args.output)
    if args.markdown_only:
        harness.write_results(_load(out), out, "scale")
        return None
    protocol = harness.Protocol(split="test", seed=args.seed, eval_texts=())  # no text is scored: memory and time
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    for name in args.runs:
        key = _key(name, args.label)
        if key in _load(out).get("runs", {}) and not args.force:
            continue
        model = RUNS[name][0]
        path = args.model or (work / model if args.salvage else make_model(work / model, model))
        shape = (str(args.model), None, None) if args.model else MODELS[model]
        print(f"== {key}", file=sys.stderr, flush=True)
        try:
            result = salvage(name, work, args) if args.salvage else run_one(name, work, {model: path}, protocol, args)
        except RuntimeError as e:  # the next runs still run
            print(f"   {key} failed: {e}", file=sys.stderr, flush=True)
            continue
        with _locked(out):  # another scale.py may write the same file: add this run to what is there now
            results = _load(out)
            results.setdefault("models", {})[model] = {"shape": shape[0], "blocks": shape[1], "dtype": shape[2],
                                    "bytes": sum(f.stat().st_size for f in path.glob("*.safetensors"))}  # fmt: skip
            results.setdefault("runs", {})[key] = result
            results["date"] = datetime.datetime.now().isoformat(timespec="seconds")
            if not args.salvage or "environment" not in results:  # else: the file's record of the code that ran
                results["environment"] = harness.environment(argv, "scale.py")
            results["protocol"] = protocol.record(results.get("protocol"))
            harness.write_results(results, out, "scale")
        later = any(RUNS[r][0] == model for r in args.runs[args.runs.index(name) + 1 :])
        if not (args.keep_models or args.model or args.salvage or later):  # a salvage never deletes a model
            shutil.rmtree(path, ignore_errors=True)
    print(markdown(_load(out)))


def _load(out: Path) -> dict:
    return json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").is_file() else {}


@contextlib.contextmanager
def _locked(out: Path):
    with open(Path(tempfile.gettempdir()) / f"optimum_prune_{out.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


if __name__ == "__main__":
    main()
