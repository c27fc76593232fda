"""Memory of low-memory runs: blocks read by plain file I/O and released after their visit, saves that copy from the
files, float64 solves that hold one matrix, progress lines, and the default activation budget."""

from __future__ import annotations

import gc
import json
import logging
import os
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from scale_utils import assert_same_state, prune_and_save, saved_state, write_checkpoint
from testing_utils import calibration_ids, tiny_model

from optimum_prune import NumericalConfig, SparseGPTConfig, WandaConfig
from optimum_prune.calibration.stats import GramStats
from optimum_prune.functional import compensation as C
from optimum_prune.methods.numerical import functional as F
from optimum_prune.storage import memory
from optimum_prune.storage.streaming import LayerStore, get_store, write_safetensors
from optimum_prune.storage.tensorfile import read_header, read_tensors, tensor_chunks, write_tensors

HIDDEN, MLP = 72, 96  # llama_gqa's tiny shapes: (MLP, HIDDEN) weights exist only inside the blocks


def _resident_of(fragment: str) -> int:
    """Resident bytes of this process's mappings of files whose path contains `fragment` (/proc/self/smaps)."""
    total, current = 0, None
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                current = parts[5] if len(parts) > 5 else ""
            elif parts and parts[0] == "Rss:" and current and fragment in current:
                total += int(parts[1]) * 1024
    return total


def _mapped(fragment: str) -> bool:
    with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
        return any(fragment in line for line in f)


def write_sharded(model, path):
    """`model` as a checkpoint with one shard per decoder block (the layout of large checkpoints) and one for the rest."""
    path.mkdir(parents=True)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        key = "block" + name.split(".")[2] if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, {})[name] = t
    weight_map = {}
    for key, tensors in groups.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / f"{key}.safetensors"), {"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, f"{key}.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model.config.save_pretrained(path)
    return path


def _block_weights() -> int:
    """Distinct live CPU storages of `(MLP, HIDDEN)` / `(HIDDEN, MLP)` tensors: gate/up/down weights of blocks."""
    gc.collect()
    seen = set()
    for obj in gc.get_objects():
        if (
            isinstance(obj, torch.Tensor)
            and obj.device.type == "cpu"
            and tuple(obj.shape) in ((MLP, HIDDEN), (HIDDEN, MLP))
        ):
            seen.add(obj.untyped_storage().data_ptr())
    return len(seen)


# ------------------------------------------------------------------------------------------------- tensor files
def test_tensor_files_round_trip_with_safetensors(tmp_path):
    tensors = {
        "w": torch.randn(5, 3),
        "b": torch.randn(7).bfloat16(),
        "h": torch.randn(2).half(),
        "scalar": torch.tensor(3),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(4, 6).T,
    }
    write_tensors(tmp_path / "ours.safetensors", tensors, {"format": "pt"})
    back = load_file(str(tmp_path / "ours.safetensors"))  # the reference reader reads ours
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "ref.safetensors"))
    ours = read_tensors(tmp_path / "ref.safetensors")  # ours reads the reference's
    for k, t in tensors.items():
        assert ours[k].dtype == t.dtype and torch.equal(ours[k], t), k
    entries = read_header(tmp_path / "ref.safetensors")  # copied file to file, converted on the way
    write_tensors(tmp_path / "copy.safetensors", entries, {"format": "pt"}, dtype=torch.bfloat16)
    copied = load_file(str(tmp_path / "copy.safetensors"))
    for k, t in tensors.items():
        assert torch.equal(copied[k], t.to(torch.bfloat16) if t.is_floating_point() else t), k
    assert list(entries["w"].chunks(chunk_bytes=8))[0].numel() == 2  # bounded chunks
    zeros = [
        sum(int((c == 0).sum()) for c in chunks)
        for chunks in (entries["mask"].chunks(), tensor_chunks(tensors["mask"]))
    ]
    assert zeros == [1, 1]


def test_a_damaged_tensor_file_is_a_clear_error(tmp_path):
    write_safetensors({"w": torch.randn(64, 64)}, tmp_path / "w.safetensors")
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(OSError, match="damaged or incomplete"):
        read_tensors(tmp_path / "cut.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(OSError, match="damaged or incomplete"):
        read_header(tmp_path / "junk.safetensors")


# ------------------------------------------------------------------------------------------- blocks and saving
@pytest.mark.parametrize(
    "config",
    [WandaConfig(sparsity=0.5), SparseGPTConfig(sparsity=0.5), NumericalConfig(pruning_ratio=0.3, round_to=1)],
    ids=lambda c: c.method,
)
def test_a_block_maps_no_file_and_leaves_nothing_behind(config, tmp_path, monkeypatch):
    """Blocks are read by plain I/O (no page of their shard is ever mapped), a visit holds a bounded number of copies
    of the block, and once the block is put back none of its tensors is alive; the result is the in-memory one."""
    src = write_sharded(tiny_model("llama_gqa", vocab_size=4096), tmp_path / "src")
    seen = {"visits": 0, "copies": 0}
    load, offload = LayerStore.load, LayerStore.offload

    def checked_load(self, i, stage=None):
        assert _block_weights() == 0, "a block's weights outlived its visit"
        load(self, i, stage)
        assert not _mapped("/src/block"), "a block's shard is memory-mapped"

    def checked_offload(self, i):
        if i in self.loaded:
            seen["visits"] += 1
            seen["copies"] = max(seen["copies"], _block_weights())
        offload(self, i)
        assert _block_weights() == 0, "a block's weights outlived its visit"

    monkeypatch.setattr(LayerStore, "load", checked_load)
    monkeypatch.setattr(LayerStore, "offload", checked_offload)
    ids = calibration_ids(8, 16)
    prune_and_save(src, config, tmp_path / "low", low_memory=True, calibration=ids, batch_size=4)
    assert seen["visits"] >= 3 and 2 <= seen["copies"] <= 2 * 3  # gate + up of at most three copies of a block
    monkeypatch.undo()
    prune_and_save(src, config, tmp_path / "mem", calibration=ids, batch_size=4)
    assert_same_state(saved_state(tmp_path / "mem"), saved_state(tmp_path / "low"))


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpoint_dir"])
def test_saving_and_measuring_read_the_embeddings_from_the_file(checkpointed, tmp_path):
    """The embeddings stay memory-mapped for calibration, which touches the rows of its tokens only; measuring the
    result and saving it read them from the file instead, and a checkpoint directory's fingerprint hashes their first
    values only, so the rest of their pages never becomes resident."""
    src = write_sharded(tiny_model("llama_gqa", vocab_size=8192), tmp_path / "src")
    embedding_bytes = 8192 * HIDDEN * 4
    from optimum_prune import AutoPruner

    pruner = AutoPruner.from_pretrained(src, low_memory=True)
    kwargs = {"checkpoint_dir": tmp_path / "run"} if checkpointed else {}
    pruner.prune(WandaConfig(sparsity=0.5), calibration=calibration_ids(8, 16), batch_size=4, **kwargs)  # < 128 tokens
    pruner.save_pretrained(tmp_path / "out", model_card=False)
    assert _mapped("/src/rest")  # calibration read the embedding rows through the map
    assert _resident_of("/src/rest") < embedding_bytes / 4
    assert torch.equal(saved_state(tmp_path / "out")["model.embed_tokens.weight"],
                       load_file(str(src / "rest.safetensors"))["model.embed_tokens.weight"])  # fmt: skip


def test_the_embedding_pages_calibration_read_are_released_with_each_block(tmp_path, monkeypatch):
    """Calibration reads embedding rows through the map (and read-ahead brings their neighbours in); once a block is
    done those pages leave the process, so they do not add to the peak of the blocks that follow."""
    src = write_sharded(tiny_model("llama_gqa", vocab_size=8192), tmp_path / "src")
    rest = str(src / "rest.safetensors")
    resident_after_offload = []
    offload = LayerStore.offload

    def measured_offload(self, i):
        loaded = i in self.loaded
        offload(self, i)
        if loaded:
            resident_after_offload.append(_resident_of(rest))

    monkeypatch.setattr(LayerStore, "offload", measured_offload)
    from optimum_prune import AutoPruner

    pruner = AutoPruner.from_pretrained(src, low_memory=True)
    store = get_store(pruner.model)
    embedding = store.mapped["model.embed_tokens.weight"]
    embedding[torch.arange(0, 8192, 64)].sum()  # touch rows all over the embedding
    assert _resident_of(rest) > 64 * 4096
    pruner.prune(WandaConfig(sparsity=0.5), calibration=calibration_ids(8, 16), batch_size=4)
    page = os.sysconf("SC_PAGE_SIZE")
    assert resident_after_offload and max(resident_after_offload) <= 2 * page * len(store.mapped), (
        resident_after_offload
    )


# ------------------------------------------------------------------------------------------- float64 solves
def _direct_cholesky_solve(A, B, damping, retries=4):
    """The textbook form: `A + γI` whole, `torch.cholesky_solve`."""
    mean_diag = A.diagonal().mean().clamp_min(1e-30)
    eye = torch.eye(A.shape[0], dtype=A.dtype)
    damp = damping
    for _ in range(retries + 1):
        L, info = torch.linalg.cholesky_ex(A + damp * mean_diag * eye)
        if int(info) == 0:
            return torch.cholesky_solve(B, L)
        damp = max(damp * 10, 1e-8)
    raise AssertionError("unreachable in these tests")


def _problem(D=60, d_out=24, n=400, rank=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, rank or D, generator=g) @ torch.randn(rank or D, D, generator=g) + 0.3
    return torch.randn(d_out, D, generator=g), (X.T @ X / n).float(), X.mean(0)


@pytest.mark.parametrize("rank", [None, 20], ids=["full_rank", "singular"])
def test_lean_solves_equal_the_direct_formulas(rank):
    """In place (the factor in the score matrix's own memory, retries rebuilding it) or on blocks of H, against the
    formulas written out whole in float64, including the retry path of a singular Gram: the score matrix and every
    single-column solve (the scores) bit for bit; a many-column solve (the refit) runs the two triangular solves of
    `torch.cholesky_solve` without its copy of the factor, equal to float64 rounding, and the refitted weights in the
    model's dtype are the same."""
    W, H, mu = _problem(rank=rank)
    Hd = H.double()
    A = (W.double().T @ W.double()) * Hd
    assert torch.equal(F.score_matrix(W, H), A)
    for damping in (1e-6, 0.0):
        for columns in (1, 3):
            B = torch.randn(A.shape[0], columns, dtype=torch.float64)
            want = _direct_cholesky_solve(A, B, damping)
            for got in (C.damped_cholesky_solve(A, B, damping),
                        C.damped_cholesky_solve(A.clone(), B, damping, rebuild=lambda: A.clone())):  # fmt: skip
                if columns == 1:
                    assert torch.equal(got, want)
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    ones = torch.ones(A.shape[0], 1, dtype=torch.float64)
    u = _direct_cholesky_solve(A, ones, 1e-6)[:, 0]
    z = 1 - (0.3 * A.shape[0] / u.sum()) * u
    assert torch.equal(F.numerical_scores(W, H, 0.3), z)
    keep = torch.tensor(sorted(set(range(60)) - set(range(0, 60, 4))))
    P = torch.tensor(sorted(set(range(60)) - set(keep.tolist())))
    for mean in (None, mu):
        G = Hd if mean is None else Hd - torch.outer(mean.double(), mean.double())
        delta = _direct_cholesky_solve(G[keep][:, keep], G[keep][:, P] @ W.double()[:, P].T, 0.1).T
        W_ref = torch.zeros_like(W, dtype=torch.float64)
        W_ref[:, keep] = W.double()[:, keep] + 0.7 * delta
        dW = W_ref - W.double()
        residual = float(torch.einsum("od,de,oe->", dW, G, dW))
        if mean is None:
            W_new, res = C.compensate(W, H, keep, 0.1, 0.7)
        else:
            W_new, b, res = C.compensate_with_bias(W, H, mean, keep, 0.1, 0.7)
            torch.testing.assert_close(b, ((W.double() - W_ref.float().double()) @ mean.double()).float())
        assert torch.equal(W_new, W_ref.float())
        assert res == pytest.approx(residual, rel=1e-9)


def test_a_refit_with_nothing_removed_builds_no_factor(monkeypatch):
    """A layer that keeps every input channel (a global allocation can leave one whole) gets its weight back
    unchanged with zero residual and no float64 (D, D) factor: at Llama-3.1-8B's MLP width that factor alone is
    1.6 GB of the low-memory run's peak."""
    W, H, mu = _problem()
    monkeypatch.setattr(C, "_damped_cholesky", lambda *a, **k: pytest.fail("a factor was built"))
    everything = torch.arange(W.shape[1])
    W_new, res = C.compensate(W, H, everything, 0.1, 1.0)
    assert torch.equal(W_new, W) and W_new.data_ptr() != W.data_ptr() and res == 0.0
    W_new, b, res = C.compensate_with_bias(W, H, mu, everything, 0.1, 1.0)
    assert torch.equal(W_new, W) and not b.any() and res == 0.0


def test_a_matrix_not_exactly_symmetric_is_factored_in_a_copy():
    """In-place factoring reads the matrix's memory transposed, which is the same matrix only when it is exactly
    symmetric; otherwise the solve copies it and reads its lower triangle, as `torch.linalg.cholesky` does."""
    W, H, _ = _problem()
    A = F.score_matrix(W, H)
    A[5, 2] *= 1 + 1e-9  # the upper triangle is left as it was
    B = torch.ones(A.shape[0], 1, dtype=torch.float64)
    want = _direct_cholesky_solve(A, B, 1e-6)
    before = A.clone()
    assert torch.equal(C.damped_cholesky_solve(A, B, 1e-6, rebuild=lambda: before.clone()), want)
    assert torch.equal(A, before)  # copied, not overwritten


def test_a_gram_normalised_in_place_is_held_once():
    x = torch.randn(50, 8)
    plain, lean = GramStats(8), GramStats(8, normalize_in_place=True)
    for stats in (plain, lean):
        stats.update(x[:30])
        stats.update(x[30:])
    assert torch.equal(lean.gram, plain.gram) and lean.gram is lean.gram
    assert torch.equal(lean.mean, plain.mean)
    with pytest.raises(RuntimeError, match="internal error"):
        lean.update(x)
    with pytest.raises(RuntimeError, match="internal error"):
        _ = lean.sum


# --------------------------------------------------------------------------------- progress and activations
def test_a_low_memory_run_reports_each_block_with_eta_and_memory(tmp_path, caplog):
    src = write_checkpoint(tmp_path / "src")
    with caplog.at_level(logging.INFO, logger="optimum_prune.pipeline.progress"):
        report = prune_and_save(src, NumericalConfig(pruning_ratio=0.3, round_to=1), tmp_path / "out",
                                low_memory=True, calibration=calibration_ids(8, 16), batch_size=4)  # fmt: skip
    progress = report.info["progress"]
    first_two = progress["passes"][:2]  # NP: the scoring pass, then the pass that refits and writes
    assert [p["blocks"] for p in first_two] == [3, 3]
    assert all(r["seconds"] >= 0 and r["peak"] >= r["rss"] > 0 for r in progress["blocks"])
    lines = [r.getMessage() for r in caplog.records]
    assert any("pass 1, block 1/3" in m and "pass done in ~" in m and "peak" in m for m in lines), lines[:3]
    assert any("pass 2, block 3/3" in m for m in lines)


_HEAP_PROBE = """
import ctypes, sys, torch
from optimum_prune.storage.streaming import load_low_memory

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] != "-":
    load_low_memory(sys.argv[1])
first = torch.empty(4 << 20)  # 16 MiB: mapped under glibc's starting threshold, which then rises to its size
del first
second = torch.empty(4 << 20)
print(libc.mallinfo2().hblkhd >= 16 << 20)
"""


@pytest.mark.parametrize("setting", ["loader", "default", "user"])
def test_low_memory_maps_large_temporaries_so_they_return_to_the_system(setting, tmp_path):
    """glibc puts a freed 16 MiB block's successors on the heap (its threshold rises); low-memory mode fixes the
    threshold at 4 MiB, so they are mapped and handed back when freed, unless the user chose a threshold."""
    src = write_checkpoint(tmp_path / "src")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if setting == "user":
        env["MALLOC_MMAP_THRESHOLD_"] = str(64 << 20)
    arg = "-" if setting == "default" else str(src)
    out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, arg], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(setting == "loader")


def test_activations_spill_by_default_when_memory_is_short(tmp_path, monkeypatch):
    """Without `activation_memory`, an in-memory run keeps activations in memory up to half of what is available
    when it starts, and writes the rest to disk: the same model."""
    src = write_checkpoint(tmp_path / "src")
    ids = calibration_ids(8, 16)
    prune_and_save(src, WandaConfig(sparsity=0.5), tmp_path / "ref", calibration=ids, batch_size=2)
    monkeypatch.setattr(memory, "available_memory", lambda: 20_000)
    monkeypatch.setattr("optimum_prune.pipeline.session.available_memory", lambda: 20_000)
    report = prune_and_save(src, WandaConfig(sparsity=0.5), tmp_path / "spilled", calibration=ids, batch_size=2)
    assert report.info["activations"]["activation_memory_limit"] == 10_000
    assert report.info["activations"]["spilled_chunks"] > 0
    assert_same_state(saved_state(tmp_path / "ref"), saved_state(tmp_path / "spilled"))
