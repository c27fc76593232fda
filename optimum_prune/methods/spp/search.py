"""The SPP search: a `transformers.Trainer` loop whose only trainable parameters are the masks, with our optimizer
for the Linearized-Bregman steps (`functional.bregman_step_`), recording when every unit enters the path.

Mixed precision, gradient accumulation, devices and progress come from `Trainer` (pass `TrainingArguments` through
`SPPConfig.training_args`). The model is left as it was: hooks, the masks module, frozen flags, training mode, device
and `use_cache` are restored whatever happens; a NaN loss stops the search with `SPPSearchError`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import tempfile
import time
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

from ...modeling.architectures import ArchitectureSpec, get_layers, get_spec, layer_view
from ...utils.training import build_training_arguments, quiet
from .functional import auto_nu, bregman_step_, init_state
from .masks import MaskSet, SearchMasks, attach_masks, layer_units
from .path import SolutionPath, model_identity
from .search_data import LayerwiseLoss, SPPSearchError, restored, search_dataset, teacher_kl

__all__ = ["BregmanOptimizer", "run_search", "search_views", "train_masks"]

logger = logging.getLogger(__name__)

_MASKS_ATTR = "spp_search_masks"
# `search_labels="layers"` with `nu="auto"`: the size of the ±1 perturbation of the masks whose gradient sets ν, and
# the factor on ν. That loss is flat at `M = 1`; near a unit's minimum it is ~h·(1 − M)², so the pull M/ν holds a
# mask at M = hν/(1 + hν), and a q/k mask (squared in the logits, so its loss flattens again towards 0) stays up only
# where hν > 2: at the factor 1 no q/k unit of the tiny planted Llama enters (v/o 6%, MLP 63%), at 4 a third of the
# q/k units and nearly all others do (the planted dead units still first)
NU_PROBE = 0.1
NU_PROBE_FACTOR = 4.0


class BregmanOptimizer(torch.optim.Optimizer):
    """Runs `bregman_step_` on every mask; keeps, per step, how many units of each kind are in the support.

    With `nu="auto"`, the first step sets one ν per unit kind (`qk`, `vo`, `mlp`, or a search's own keys) from the
    RMS of that kind's mask gradients at `M = 1` (`functional.auto_nu`): the one backward pass it costs is the first
    step's own. `total_steps` (when known) lets the first step refuse a `"paper"` search whose measured ν leaves it
    too short for any unit to enter."""

    def __init__(self, masks: MaskSet, settings: dict[str, Any], total_steps: int | None = None) -> None:
        self.keys = [(i, kind) for i, kind, _ in masks.items()]
        super().__init__([p for _, _, p in masks.items()], {"lr": settings["lr"]})
        self.settings = {k: settings[k] for k in ("faithful_to", "lambda_", "kappa", "eps", "interval")}
        self.settings["coupling"] = bool(settings.get("coupling"))
        self.settings["betas"] = tuple(settings["betas"])
        self._nu_setting, self._nu_scale = settings.get("nu", 100.0), float(settings.get("nu_scale", 1.0))
        self._check = settings.get("check_search_length")
        self.total_steps = total_steps
        self.nu: dict[str, float] = {}
        self.support: dict[str, list[int]] = {kind: [] for _, kind in self.keys}

    @property
    def nu_is_auto(self) -> bool:
        return self._nu_setting == "auto"

    def resolve_nu(self, grads: list[torch.Tensor]) -> None:
        """Set ν per kind from the mask gradients `grads` (`nu="auto"`) or the configured number."""
        kinds = list(self.support)
        if self._nu_setting == "auto":
            self.nu = {k: auto_nu([g for (_, kind), g in zip(self.keys, grads) if kind == k], self._nu_scale)
                       for k in kinds}  # fmt: skip
        else:
            self.nu = dict.fromkeys(kinds, float(self._nu_setting))
        logger.info("SPP search: nu per kind %s", {k: round(v, 4) for k, v in self.nu.items()})
        if self._check is not None and self.settings["faithful_to"] == "paper":
            self._check(self.total_steps, nu=min(self.nu.values()))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        counts = dict.fromkeys(self.support, 0)
        params = [p for g in self.param_groups for p in g["params"]]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        for (layer, kind), grad in zip(self.keys, grads):
            if not torch.isfinite(grad).all():
                raise SPPSearchError(
                    f"The mask gradient of layer {layer} ({kind}) is NaN/Inf at step {self.steps + 1}; the search "
                    "stopped and the model was left unchanged. Lower `lr`, or search in float32."
                )
        if not self.nu:
            self.resolve_nu(grads)
        for (_, kind), p, grad in zip(self.keys, params, grads):
            state = self.state[p]
            if not state:
                state.update(init_state(p, self.settings["faithful_to"]))
            bregman_step_(p, grad.to(p.dtype), state, lr=self.param_groups[0]["lr"], nu=self.nu[kind], **self.settings)
            counts[kind] += int((state["gamma"] != 0).sum())
        for kind, n in counts.items():
            self.support[kind].append(n)
        return loss

    @property
    def steps(self) -> int:
        return len(next(iter(self.support.values()), []))

    def density(self) -> float:
        """Fraction of all units currently in the support."""
        total = sum(p.numel() for g in self.param_groups for p in g["params"])
        return sum(v[-1] for v in self.support.values() if v) / max(total, 1)

    def statistics(self) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
        params = [p for g in self.param_groups for p in g["params"]]
        out = {}
        for key, p in zip(self.keys, params):
            st = self.state.get(p) or init_state(p.detach(), self.settings["faithful_to"])
            out[key] = {
                "entry": st["entry"].cpu(), "record": st["record"].cpu(), "z": st["z"].float().cpu(),
                "gamma": st["gamma"].float().cpu(), "mask": p.detach().float().cpu(),
            }  # fmt: skip
        return out


class _SearchTrainer(Trainer):
    """`Trainer` that runs the model in eval mode (unless dropout is wanted), computes the `"dense"` and `"layers"`
    losses (`layerwise`: a `LayerwiseLoss`) and stops on a non-finite loss."""

    def __init__(
        self,
        *args: Any,
        dropout: bool = False,
        bregman: BregmanOptimizer | None = None,
        layerwise: LayerwiseLoss | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self._dropout, self._bregman, self._layerwise = dropout, bregman, layerwise
        free_memory = self.accelerator.free_memory

        def reset_without_gc(*objects):
            """The loop's opening `free_memory()` runs a full `gc.collect()` (seconds in a large process) to drop
            references this fresh accelerator does not hold yet; reset its lists without it."""
            if objects or getattr(self.accelerator, "deepspeed_engine_wrapped", None) is not None:
                return free_memory(*objects)
            acc = self.accelerator
            acc._schedulers, acc._optimizers, acc._models, acc._dataloaders, acc.step = [], [], [], [], 0
            return ()

        self.accelerator.free_memory = reset_without_gc

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self._dropout:
            model.eval()
        if self._layerwise is not None:  # search_labels="layers"
            if self._bregman is not None and not self._bregman.nu and self._bregman.nu_is_auto:
                self._set_nu_by_probe(inputs)
            loss = self._layerwise(inputs)
            out = (loss, None) if return_outputs else loss
        elif "teacher_ids" in inputs:  # search_labels="dense"
            ids, logp = inputs.pop("teacher_ids"), inputs.pop("teacher_logp")
            outputs = model(**inputs)
            logits = outputs.logits if "pixel_values" in inputs else outputs.logits[:, :-1]
            loss = teacher_kl(logits, ids, logp)
            if self._bregman is not None and not self._bregman.nu and self._bregman.nu_is_auto:
                self._set_nu(logits, ids)
            out = (loss, outputs) if return_outputs else loss
        else:
            out = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        loss = out[0] if return_outputs else out
        if not torch.isfinite(loss.detach()).all():
            raise SPPSearchError(
                f"The search loss became {float(loss.detach().float().mean())} at step {self.state.global_step + 1}; "
                "the search stopped and the model was left unchanged. Lower `lr`, check the calibration data, or "
                "search in float32 (no fp16/bf16 in `training_args`)."
            )
        return out

    def _set_nu(self, logits: torch.Tensor, ids: torch.Tensor) -> None:
        """`nu="auto"` with the `"dense"` loss: its gradient is zero at `M = 1`, so ν comes from the gradient of the
        cross-entropy against the dense model's most likely outputs on the same batch (one more backward pass)."""
        params = [p for g in self._bregman.param_groups for p in g["params"]]
        ce = nn.functional.cross_entropy(logits.flatten(0, -2).float(), ids[..., 0].flatten())
        grads = torch.autograd.grad(ce, params, retain_graph=True, allow_unused=True)
        self._bregman.resolve_nu([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)])

    def _set_nu_by_probe(self, inputs: dict[str, Any]) -> None:
        """`nu="auto"` with the `"layers"` loss: its gradient is zero at `M = 1`, so ν comes from its gradient at
        `M = 1 ± NU_PROBE` (independent random signs per unit, seeded), divided by `NU_PROBE`: the curvature's scale,
        the gradient a unit meets once its mask has moved; ν = `NU_PROBE_FACTOR · nu_scale / RMS` of that. One probe
        per unit kind, that kind's masks moved alone (a kind's gradient would otherwise carry the other kinds'
        moves); the masks are put back before the first step."""
        opt = self._bregman
        params = [p for g in opt.param_groups for p in g["params"]]
        gen = torch.Generator().manual_seed(self.args.seed)
        signs = [(torch.randint(0, 2, p.shape, generator=gen) * 2 - 1).to(p) for p in params]
        grads: list[torch.Tensor | None] = [None] * len(params)
        for kind in opt.support:
            probed = [j for j, (_, k) in enumerate(opt.keys) if k == kind]
            with restored([params[j] for j in probed]):
                with torch.no_grad():
                    for j in probed:
                        params[j].add_(NU_PROBE * signs[j])
                out = torch.autograd.grad(self._layerwise(inputs), [params[j] for j in probed], allow_unused=True)
            for j, g in zip(probed, out):
                grads[j] = torch.zeros_like(params[j]) if g is None else g / (NU_PROBE * NU_PROBE_FACTOR)
        opt.resolve_nu(grads)


class _PathCallback(TrainerCallback):
    def __init__(self, optimizer: BregmanOptimizer, stop_at: float | None) -> None:
        self.optimizer, self.stop_at = optimizer, stop_at

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop_at is not None and self.optimizer.density() >= self.stop_at:
            logger.info("support density %.3f >= %.3f at step %d: stopping", self.optimizer.density(), self.stop_at,
                        state.global_step)  # fmt: skip
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            logs["support_density"] = round(self.optimizer.density(), 4)


def search_views(
    model: nn.Module, spec: ArchitectureSpec, config, attention: bool | None = None
) -> tuple[list, dict[int, dict[str, int]]]:
    """The layer views and the units the search puts masks on (skipped layers excluded; the attention's where
    `attention`, by default `config.prune_attention`)."""
    attention = bool(config.prune_attention) if attention is None else attention
    views = [layer_view(layer, i, spec, model.config) for i, layer in enumerate(get_layers(model, spec))]
    units = {v.index: layer_units(v, attention, config.prune_mlp) for v in views if v.index not in config.skip_layers}
    return views, {i: u for i, u in units.items() if u}


def _training_arguments(config, output_dir: str) -> TrainingArguments:
    kwargs = {
        "output_dir": output_dir,
        "max_steps": config.steps if config.epochs is None else -1,
        "num_train_epochs": config.epochs or 1.0,
        "per_device_train_batch_size": config.batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "learning_rate": config.lr,
        "lr_scheduler_type": "constant",
        "weight_decay": 0.0,
        "max_grad_norm": 0.0,
        "logging_steps": max(1, min(50, config.steps // 10)),
        "seed": config.seed,
        "data_seed": config.seed,
    }
    return build_training_arguments(kwargs, config.training_args, type(config).__name__)


@contextlib.contextmanager
def _search_session(model: nn.Module, masks: nn.Module):
    """Freeze the weights and register the masks as the model's only trainable parameters; undo it all after."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    was_training, device = model.training, next(model.parameters()).device
    had_forward = "forward" in model.__dict__
    checkpointing = getattr(model, "is_activation_checkpointing", False)
    use_cache = getattr(model.config, "use_cache", None)
    for p, _ in flags:
        p.requires_grad_(False)
    model.add_module(_MASKS_ATTR, masks.to(device))
    if use_cache is not None:
        model.config.use_cache = False
    try:
        yield
    finally:
        model._modules.pop(_MASKS_ATTR, None)
        for p, flag in flags:
            p.requires_grad_(flag)
        if not had_forward and "forward" in model.__dict__:  # accelerate's mixed-precision wrapper
            del model.forward
        if getattr(model, "is_activation_checkpointing", False) and not checkpointing:
            model.activation_checkpointing_disable()
        if use_cache is not None:
            model.config.use_cache = use_cache
        if next(model.parameters()).device != device:
            model.to(device)
        model.train(was_training)


def train_masks(model: nn.Module, config, data: Any, masks: MaskSet, attach) -> dict[str, Any]:
    """Train `masks` (attached to the model by the context manager `attach`) with the Bregman dynamics of `config`
    on `data`; returns the optimizer's statistics, the support history, steps, seconds and the loss log."""
    labels = config.labels_for(get_spec(model).modality)
    if isinstance(data, torch.Tensor):  # (image models, sampled labels: see `search_dataset`)
        data = search_dataset(model, data, labels=labels, seed=config.seed, seq_len=config.search_seq_len)
    dataset = data
    if len(dataset) == 0:
        raise ValueError("The calibration data is empty.")
    per_epoch = math.ceil(len(dataset) / (config.batch_size * config.gradient_accumulation_steps))
    total = config.steps if config.epochs is None else math.ceil(per_epoch * config.epochs)
    config.check_search_length(total)  # before any step (an `epochs` search is checked here, on the data's size)
    settings = {**config.search_settings(), "check_search_length": config.check_search_length}
    optimizer = BregmanOptimizer(masks, settings, total)
    t0, c0 = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory(prefix="optimum_prune_spp_") as tmp, _search_session(model, masks):
        args = _training_arguments(config, tmp)
        with attach, torch.enable_grad():
            trainer = _SearchTrainer(
                model=model, args=args, train_dataset=dataset, data_collator=default_data_collator,
                optimizers=(optimizer, None), callbacks=[_PathCallback(optimizer, config.stop_at_density)],
                dropout=config.dropout, bregman=optimizer,
                layerwise=LayerwiseLoss(model, masks) if labels == "layers" else None,
            )  # fmt: skip
            quiet(trainer)
            trainer.train()
        losses = [{"step": h["step"], "loss": h["loss"]} for h in trainer.state.log_history if "loss" in h]
        del trainer
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    logger.info("SPP search: %d steps in %.1f s, final support density %.3f", optimizer.steps, seconds,
                optimizer.density())  # fmt: skip
    return {
        "stats": optimizer.statistics(),
        "nu": optimizer.nu,
        "support": {k: torch.tensor(v) for k, v in optimizer.support.items()},
        "steps": optimizer.steps,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "losses": losses,
    }


def _windows(data: Any) -> list[int] | None:
    """`[examples, tokens each]` of token windows the search trained on (`[examples]` for images)."""
    if isinstance(data, torch.Tensor) or not len(data):
        return None
    first = data[0]
    ids = first.get("input_ids") if isinstance(first, dict) else None
    return [len(data)] + ([int(ids.shape[-1])] if isinstance(ids, torch.Tensor) else [])


def run_search(
    model: nn.Module,
    spec: ArchitectureSpec,
    config,
    data: Any,
    calibration: dict | None = None,
    attention: bool | None = None,
) -> SolutionPath:
    """Run the search of `config` (an `SPPConfig`) on `data` and return its `SolutionPath`.

    Args:
        model (`PreTrainedModel`): the model (unchanged on return, also on error).
        spec (`ArchitectureSpec`): its architecture entry.
        config (`SPPConfig`): search settings and the units to search over.
        data (`torch.LongTensor` of shape `(N, L)` | `torch.utils.data.Dataset` | `list[dict]`): calibration token
            windows (causal LM: the LM loss on them), or examples the model computes its loss on (with `labels`:
            labelled images for an image classifier, see `search_dataset`).
        calibration (`dict | None`): description recorded in the path.
        attention (`bool | None`): mask the attention's units (`None`: where `config.prune_attention`).
    """
    views, units = search_views(model, spec, config, attention)
    if not units:
        raise ValueError("Nothing to search: every layer is skipped or neither attention nor MLP is pruned.")
    identity = model_identity(model, spec)
    masks = SearchMasks(units)
    out = train_masks(model, config, data, masks, attach_masks(views, spec, masks))
    meta = {
        "model": identity,
        "search": config.search_settings(spec.modality),
        "units": {str(i): u for i, u in units.items()},
        "rotary": spec.rotary,
        "steps": out["steps"],
        "search_seconds": out["seconds"],
        "search_cpu_seconds": out["cpu_seconds"],
        "seed": config.seed,
        "calibration": calibration,
        "windows": _windows(data),
        "loss_history": out["losses"],
        "nu": out["nu"],
    }
    return SolutionPath(out["stats"], meta, out["support"])
