"""What SPP's search trains the masks on: calibration windows or images with their targets (the data's own, ones
drawn from the dense model, the dense model's top outputs for a KL divergence, or its hidden states layer by layer),
and the losses' shared pieces."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ...calibration.images import LabelledImages, calibration_labels, check_labels, require_classifier
from ...modeling.architectures import get_layers, get_spec, is_image_model

__all__ = [
    "LayerwiseLoss", "SPPSearchError", "TEACHER_TOP_K", "sampled_labels", "search_dataset", "search_windows",
    "restored", "teacher_kl", "teacher_targets",
]  # fmt: skip

# outputs of the dense model kept per position for `search_labels="dense"` (the rest share one bucket)
TEACHER_TOP_K = 64


class SPPSearchError(FloatingPointError, ValueError):
    """The search diverged (a NaN / Inf loss or mask gradient); the model is left unchanged."""


def search_windows(ids: torch.Tensor, seq_len: int | None, bos: int | None = None) -> torch.Tensor:
    """The calibration windows `ids` `(N, L)` cut into the search's windows: each into `n = round(L / seq_len)`
    consecutive pieces of `L // n` tokens (the `L % n` left at its end dropped), window 0's pieces first. When every
    window starts with `bos`, the pieces are cut from the tokens after it (`round((L - 1) / (seq_len - 1))` of them)
    and each starts with `bos`. `seq_len=None`, or `n <= 1`, returns `ids` as they are.

    So a `(32, 512)` tensor and its `(128, 128)` or `(64, 256)` reshape give the same windows."""
    if seq_len is None or ids.ndim != 2:
        return ids
    lead = int(bos is not None and ids.shape[1] > 1 and bool((ids[:, 0] == bos).all()))
    body = ids[:, lead:]
    n = int(body.shape[1] / (seq_len - lead) + 0.5)
    if n <= 1:
        return ids
    piece = body.shape[1] // n
    out = body[:, : n * piece].reshape(-1, piece)
    return torch.cat([ids[:1, :1].expand(out.shape[0], 1), out], dim=1) if lead else out


def _bos(model: nn.Module) -> int | None:
    bos = getattr(getattr(model, "config", None), "bos_token_id", None)
    return bos if isinstance(bos, int) else None


def search_dataset(
    model: nn.Module,
    data: Any,
    source: Any = None,
    what: str = "SPP's search",
    labels: str = "data",
    seed: int = 0,
    seq_len: int | None = None,
) -> Any:
    """What a search trains the masks on: causal-LM windows of the token ids `data` (the model shifts the labels), cut
    into windows of about `seq_len` tokens (`search_windows`; `None`: as given), or, for an image classifier, the
    calibration images `data` with the labels of `source` (the `calibration` argument they came from) for its
    cross-entropy. A dataset / list of examples is passed through. Raises a `ValueError` for an image model without
    a classification head or images without labels.

    `labels="sampled"`: every next token (every image's class) is drawn from the dense model's own prediction
    (`sampled_labels`), so the loss is an unbiased sample of the cross-entropy against the model itself: its
    expected gradient at `M = 1` is zero and it grows with how much removing a unit changes the model's output, not
    with how well the unit fits the calibration text (or labels). `labels="dense"`: the KL divergence from the dense
    model's top outputs (`teacher_targets`, `teacher_kl`). `labels="layers"`: the inputs alone; the loss is the
    dense model's hidden states, layer by layer (`LayerwiseLoss`)."""
    if not isinstance(data, torch.Tensor):
        if labels not in ("data", "layers"):
            raise ValueError(f"{what}: search_labels={labels!r} needs the calibration inputs as a tensor (token ids or "
                             "pixel values), not ready-made examples; pass them as a tensor or use 'data'.")  # fmt: skip
        return data
    if not is_image_model(model):
        data = search_windows(data, seq_len, _bos(model))
        if labels == "layers":
            return _Windows(data)
        if labels == "sampled":
            return _Windows(data, sampled_labels(model, data, seed))
        return _Windows(data) if labels == "data" else _Teacher(_Windows(data), teacher_targets(model, data))
    if labels == "layers":
        return _Images(data)
    require_classifier(model, what)
    if labels == "sampled":
        return LabelledImages(data, sampled_labels(model, data, seed))
    if labels == "dense":
        return _Teacher(_Images(data), teacher_targets(model, data))
    labels = calibration_labels(source) if source is not None else None
    check_labels(model, labels, what)
    if len(labels) != len(data):
        raise ValueError(f"{len(labels)} labels for {len(data)} calibration images.")
    return LabelledImages(data, labels)


def _dense_logits(model: nn.Module, inputs: torch.Tensor, batch_size: int, labels: str) -> Iterator[torch.Tensor]:
    """The model's float32 logits on `inputs` (token windows `(N, L)`: the `L - 1` positions that predict a next
    token; images `(N, C, H, W)`: one row per image), `batch_size` at a time, in eval mode without gradients (the
    mode restored after); NaN/Inf outputs raise `SPPSearchError` (the `labels` pass has no targets)."""
    was_training, device = model.training, next(model.parameters()).device
    image = is_image_model(model)
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, inputs.shape[0], batch_size):
                chunk = inputs[start : start + batch_size].to(device)
                out = model(pixel_values=chunk) if image else model(chunk, use_cache=False)
                logits = (out.logits if image else out.logits[:, :-1]).float().cpu()
                if not torch.isfinite(logits).all():
                    raise SPPSearchError(
                        f"The dense model's outputs on the calibration data are NaN/Inf, so search_labels={labels!r} "
                        "has no targets; the search did not start and the model was left unchanged. Check the "
                        "model's weights and the calibration data, or search in float32."
                    )
                yield logits
    finally:
        model.train(was_training)


def teacher_targets(
    model: nn.Module, inputs: torch.Tensor, top_k: int = TEACHER_TOP_K, batch_size: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own predictions on `inputs` (token windows `(N, L)` or images `(N, C, H, W)`), for the `"dense"`
    search loss: the ids and log-probabilities of its `top_k` most likely outputs at every position that predicts a
    next token (`(N, L - 1, k)`; `(N, k)` for a classifier), `k = min(top_k, outputs)`. One no-grad pass."""
    ids, logps = [], []
    for logits in _dense_logits(model, inputs, batch_size, "dense"):
        logp, idx = torch.log_softmax(logits, dim=-1).topk(min(top_k, logits.shape[-1]), dim=-1)
        ids.append(idx)
        logps.append(logp)
    return torch.cat(ids), torch.cat(logps)


def teacher_kl(logits: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Mean KL divergence from the teacher to the model, over every position, on the teacher's `k` most likely
    outputs plus one bucket for all the others: exactly 0, with a zero gradient, while the model still gives the
    teacher's outputs (at `M = 1`). `logits`: `(..., V)`; `ids` / `logp`: `(..., k)` from `teacher_targets`."""
    logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids)
    p = logp.exp()
    kl = (p * (logp - logq)).sum(-1)
    if ids.shape[-1] < logits.shape[-1]:  # the bucket of the outputs outside the teacher's top k
        p_rest = (1 - p.sum(-1)).clamp_min(1e-12)
        q_rest = (1 - logq.exp().sum(-1)).clamp_min(1e-12)
        kl = kl + p_rest * (p_rest.log() - q_rest.log())
    return kl.mean()


def sampled_labels(model: nn.Module, inputs: torch.Tensor, seed: int = 0, batch_size: int = 8) -> torch.Tensor:
    """Labels drawn from the model's own distribution (temperature 1, generator seeded by `seed`), one no-grad pass.
    Token windows `(N, L)`: position `t + 1` holds a token drawn after `inputs[:, : t + 1]`, position 0 is ignored
    (-100). Images `(N, C, H, W)` for a classifier: `(N,)` classes drawn from its prediction for each image."""
    g = torch.Generator().manual_seed(seed)
    drawn = [
        torch.multinomial(torch.softmax(logits, dim=-1).reshape(-1, logits.shape[-1]), 1, generator=g).view(
            logits.shape[:-1]
        )
        for logits in _dense_logits(model, inputs, batch_size, "sampled")
    ]
    if is_image_model(model):
        return torch.cat(drawn)
    out = torch.full_like(inputs, -100)
    out[:, 1:] = torch.cat(drawn)
    return out


@contextlib.contextmanager
def restored(params: Sequence[torch.Tensor]):
    """Within the block `params` (the search's masks) may be changed in place; their values are put back after."""
    values = [p.detach().clone() for p in params]
    try:
        yield params
    finally:
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v)


class LayerwiseLoss:
    """The `"layers"` search loss: every searched layer, run with the masks on the dense model's own input to that
    layer, against the dense layer's output. For a batch, one no-grad pass of the base model (no output head) with
    every mask at 1 records each layer's inputs and output; then each searched layer runs again on those inputs with
    the masks as they are, and the loss is the mean over the layers of

        mean_t ‖layer_M(x_l)_t − layer(x_l)_t‖² / max(‖u_t‖², median_s ‖u_s‖²),   u_t = layer(x_l)_t − x_l,t

    (each token's squared error relative to the layer's own update of the residual stream at that token, floored at
    the median token's: a few tokens, a window's first one above all, carry updates orders of magnitude larger than
    the rest, and measured against one scale they would set the loss, and through the probe ν, alone). Each layer's
    masks then see only their own layer's error, as a layer-wise reconstruction does, and the masks of the other
    units of a layer can rise to make up for a unit that goes. Zero, with a zero gradient, at `M = 1`.

    `masks`: the search's `MaskSet` (keys `(layer index, ...)`)."""

    def __init__(self, model: nn.Module, masks: Any) -> None:
        layers = get_layers(model, get_spec(model))
        self.layers = {i: layers[i] for i in sorted({key[0] for key in masks.keys})}
        self.base, self.masks = model.base_model, masks
        self.extra = {} if is_image_model(model) else {"use_cache": False}  # no cache for the layers' second run

    def __call__(self, inputs: dict[str, Any]) -> torch.Tensor:
        inputs = {k: v for k, v in inputs.items() if k != "labels"}
        seen: dict[int, list] = {}

        def record_inputs(i):
            def hook(module, args, kwargs):
                seen[i] = [args, kwargs]

            return hook

        def record_output(i):
            def hook(module, args, kwargs, out):
                seen[i].append(out[0] if isinstance(out, tuple) else out)

            return hook

        handles = []
        for i, layer in self.layers.items():
            handles.append(layer.register_forward_pre_hook(record_inputs(i), with_kwargs=True))
            handles.append(layer.register_forward_hook(record_output(i), with_kwargs=True))
        try:
            with restored([p for _, _, p in self.masks.items()]) as params, torch.no_grad():
                for p in params:
                    p.fill_(1.0)
                self.base(**inputs, **self.extra)
        finally:
            for h in handles:
                h.remove()
        terms = []
        for i, layer in self.layers.items():
            args, kwargs, dense = seen.pop(i)
            out = layer(*args, **kwargs)
            out = out[0] if isinstance(out, tuple) else out
            x = args[0] if args else kwargs["hidden_states"]
            update = (dense.float() - x.float()).pow(2).sum(-1)
            floor = update.median().clamp_min(torch.finfo(torch.float32).tiny)
            terms.append(((out.float() - dense.float()).pow(2).sum(-1) / update.clamp_min(floor)).mean())
        return torch.stack(terms).mean()


class _Windows(torch.utils.data.Dataset):
    """Calibration token windows as causal-LM examples (the model shifts the labels); `labels`: other targets."""

    def __init__(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        self.ids, self.labels = ids, ids if labels is None else labels

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class _Images(torch.utils.data.Dataset):
    def __init__(self, pixel_values: torch.Tensor) -> None:
        self.pixel_values = pixel_values

    def __len__(self) -> int:
        return self.pixel_values.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixel_values[i]}


class _Teacher(torch.utils.data.Dataset):
    """Examples of `base` (without labels) with the dense model's top outputs (`teacher_targets`) attached."""

    def __init__(self, base: torch.utils.data.Dataset, targets: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.base, (self.ids, self.logp) = base, targets

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = {k: v for k, v in self.base[i].items() if k != "labels"}
        return {**item, "teacher_ids": self.ids[i], "teacher_logp": self.logp[i]}
