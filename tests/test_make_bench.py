"""`make bench` runs every benchmark script, skipping (with a message) those marked `REQUIRES = "cuda"` on a machine
without CUDA instead of stopping at the first one."""

import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def test_make_bench_skips_cuda_only_scripts_without_cuda(tmp_path):
    gpu = tmp_path / "a_gpu.py"
    gpu.write_text('REQUIRES = "cuda"\nprint("gpu script ran")\n')
    cpu = tmp_path / "b_cpu.py"
    cpu.write_text('print("cpu script ran")\n')
    failing = tmp_path / "c_failing.py"
    failing.write_text("raise SystemExit(3)\n")
    run = lambda *scripts: subprocess.run(  # noqa: E731
        ["make", "-s", "-C", str(REPO), "bench", "BENCH_DEPS=", f"BENCH_SCRIPTS={' '.join(map(str, scripts))}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    make = run(gpu, cpu)
    assert make.returncode == 0, make.stdout + make.stderr
    assert "cpu script ran" in make.stdout
    if torch.cuda.is_available():
        assert "gpu script ran" in make.stdout
    else:
        assert f"== {gpu}: skipped (needs a CUDA GPU; torch sees none)" in make.stdout
        assert "gpu script ran" not in make.stdout
    # a script that fails still stops the run (only the marked ones are skipped)
    make = run(failing, cpu)
    assert make.returncode != 0 and "cpu script ran" not in make.stdout
    # every script the real target would skip on a CPU machine carries the marker on a line of its own
    marked = [p.name for p in (REPO / "benchmarks").glob("*.py") if 'REQUIRES = "cuda"' in p.read_text()]
    assert "semi_structured.py" in marked
