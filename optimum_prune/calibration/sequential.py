"""The one layer-by-layer calibration runner shared by every method.

Block-0 inputs (and the keyword arguments every layer receives: masks, rotary embeddings, which can differ per
layer, e.g. Gemma-3 sliding-window layers) are captured once by a forward in which every decoder layer is
temporarily an identity. Then one block at a time runs on the working device; only one block's activations are
ever held besides the inputs of the current layer; those go to disk beyond an `ActivationBudget`
(`calibration.offload`). In a `torch.distributed` process group, each rank runs its own share of the samples
(`distributed.local_samples`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ..modeling.architectures import ArchitectureSpec, get_layers
from ..utils.distributed import local_samples
from ..utils.phases import phased
from ..utils.tensors import move_to
from .hooks import capture_inputs
from .offload import ActivationBudget, ChunkList

__all__ = ["LayerwiseRunner", "runner_factory"]

logger = logging.getLogger(__name__)


class LayerwiseRunner:
    """Runs calibration sequences through a decoder one layer at a time.

    Args:
        model (`PreTrainedModel`): a `*ForCausalLM` model (or an image model: `*ForImageClassification`, backbone).
        spec (`ArchitectureSpec`): its architecture entry.
        input_ids (`torch.LongTensor` of shape `(num_samples, seq_len)`): calibration sequences; for an image model,
            pixel values of shape `(num_samples, channels, height, width)`.
        batch_size (`int`): sequences per forward pass.
        device (`torch.device | str | None`): where each block runs (default: where the model's weights are).
        offload_device (`str`, defaults to `"cpu"`): where activations between blocks are kept.
        activations (`ActivationBudget | None`): in-memory budget of those activations (beyond it: on disk).
    """

    @phased("embed calibration")
    def __init__(
        self,
        model: nn.Module,
        spec: ArchitectureSpec,
        input_ids: torch.Tensor,
        batch_size: int = 8,
        device: torch.device | str | None = None,
        offload_device: torch.device | str = "cpu",
        activations: ActivationBudget | None = None,
    ) -> None:
        self.model, self.spec = model, spec
        self.layers = get_layers(model, spec)
        self.device = torch.device(device) if device is not None else input_embedding_weight(model).device
        self.offload = torch.device(offload_device)
        self.activations = activations
        self.hidden: Sequence[torch.Tensor] = self._chunk_list()
        self.layer_args: list[list[tuple[tuple, dict]]] = []  # [chunk][layer] -> (extra args, kwargs)
        self._ids, self._batch_size = local_samples(input_ids), batch_size
        self._capture(self._ids, batch_size)

    def _chunk_list(self):
        """Per-chunk activations: a plain list, or one that spills to disk beyond the activation budget."""
        return [] if self.activations is None else ChunkList(self.activations)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def embeddings(self) -> Sequence[torch.Tensor]:
        """The first layer's inputs of every chunk (the embeddings), computed again: the runner's own were replaced
        by later layers' inputs (`advance`). For a second stream of hidden states, e.g. the dense model's."""
        return self._capture(self._ids, self._batch_size, hidden_only=True)

    @torch.no_grad()
    def _capture(self, input_ids: torch.Tensor, batch_size: int, hidden_only: bool = False):
        """Record the first layer's input and every layer's extra arguments per chunk (`hidden_only`: return a new
        list of the first layer's inputs and record nothing)."""
        hidden = self._chunk_list() if hidden_only else self.hidden
        originals = {}
        records: list[tuple[torch.Tensor, tuple, dict]] = []

        def make_stub(idx: int):
            def stub(*args, **kwargs):
                h = args[0] if args else kwargs.pop("hidden_states")
                records.append((h, tuple(args[1:]), kwargs))
                return h

            return stub

        base = self.model.base_model
        try:
            for i, layer in enumerate(self.layers):
                originals[i] = layer.forward
                layer.forward = make_stub(i)
            for start in range(0, input_ids.shape[0], batch_size):
                records.clear()
                _embed_forward(base, input_ids[start : start + batch_size])
                if len(records) != len(self.layers):
                    raise RuntimeError(f"Captured {len(records)} layer calls, expected {len(self.layers)}.")
                hidden.append(records[0][0].to(self.offload))
                if hidden_only:
                    continue
                kept = []
                for _, args, kwargs in records:
                    kwargs = {
                        k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value", "cache")
                    }
                    kept.append((move_to(args, self.offload), move_to(kwargs, self.offload)))
                self.layer_args.append(kept)
        finally:
            for i, layer in enumerate(self.layers):
                if i in originals:
                    del layer.forward  # restores the class method
        logger.debug("Captured inputs of %d chunk(s) for %d layers", len(hidden), len(self.layers))
        return hidden

    @torch.no_grad()
    @phased("forward", block_arg=1)
    def run_layer(
        self,
        index: int,
        inputs: Sequence[torch.Tensor] | None = None,
        observe: dict[str, nn.Module] | None = None,
        callback: Callable[[str, torch.Tensor], None] | None = None,
        layer: nn.Module | None = None,
        keep_outputs: bool = True,
        chunks: list[int] | None = None,
    ) -> Sequence[torch.Tensor]:
        """Run layer `index` (or `layer`, e.g. a dense copy) over every chunk.

        Args:
            index (`int`): decoder-layer index (selects the captured keyword arguments).
            inputs (`list[torch.Tensor] | None`): hidden states per chunk (default: the runner's current ones).
            observe (`dict[str, nn.Module] | None`): modules whose inputs are passed to `callback(name, x)`.
            layer (`nn.Module | None`): module to run instead of the model's layer `index`.
            keep_outputs (`bool`): return the outputs (on the offload device).
            chunks (`list[int] | None`): run only these chunks (`inputs` then holds just their hidden states).
        """
        layer = self.layers[index] if layer is None else layer
        every = chunks is None
        chunks = list(range(len(self.layer_args))) if every else chunks
        if inputs is None:  # read lazily: spilled chunks come back from disk one at a time
            inputs = self.hidden if every else [self.hidden[c] for c in chunks]
        outputs = self._chunk_list()
        hooks = capture_inputs(observe, callback) if observe else _null()
        with self.on_device(layer):
            self._run_chunks(layer, index, inputs, chunks, outputs, keep_outputs, hooks)
        return outputs

    @contextmanager
    def on_device(self, module: nn.Module) -> Iterator[None]:
        """Run `module` (a block, or part of one) on the working device: an offloaded model's block visits it only
        for the duration, and goes back home after, error or not."""
        home = next(module.parameters()).device
        if home != self.device:
            module.to(self.device)
        try:
            yield
        finally:
            if home != self.device:
                module.to(home)

    def _run_chunks(self, layer, index, inputs, chunks, outputs, keep_outputs, hooks) -> None:
        with hooks:
            for hidden, (args, kwargs) in zip(inputs, (self.layer_args[c][index] for c in chunks)):
                out = layer(hidden.to(self.device), *move_to(args, self.device), **move_to(kwargs, self.device))
                if isinstance(out, tuple):
                    out = out[0]
                if keep_outputs:
                    outputs.append(out.to(self.offload))

    def paired_inputs(
        self,
        index: int,
        path: str,
        dense: nn.Module,
        pruned: nn.Module | None,
        dense_inputs: Sequence[torch.Tensor] | None = None,
        pruned_inputs: Sequence[torch.Tensor] | None = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Per chunk, the input `x` of submodule `path` in the `dense` copy of layer `index` and the input `x*` of the
        same submodule in the partially `pruned` layer, on the same tokens (for cross Grams `X X*ᵀ`).

        One chunk's activations are held at a time. `pruned=None` yields `(x, x)`. `dense_inputs` / `pruned_inputs`
        are the layer inputs of every chunk (default: the runner's current hidden states for both).
        """
        for c in range(len(self.layer_args)):
            seen: dict[str, torch.Tensor] = {}
            for name, layer, inputs in (("x", dense, dense_inputs), ("xs", pruned, pruned_inputs)):
                if layer is None:
                    continue
                self.run_layer(
                    index,
                    inputs=None if inputs is None else [inputs[c]],
                    chunks=[c],
                    layer=layer,
                    observe={name: layer.get_submodule(path)},
                    callback=seen.__setitem__,
                    keep_outputs=False,
                )
            yield seen["x"], seen.get("xs", seen["x"])

    def advance(self, outputs: Sequence[torch.Tensor]) -> None:
        """Make `outputs` the inputs of the next layer."""
        self.hidden = outputs


def input_embedding_weight(model: nn.Module) -> torch.Tensor:
    """The input embedding's weight (token embeddings), or its first parameter (an image model's patch embedding);
    in memory even in a low-memory model, whose blocks may sit on the meta device."""
    embeddings = model.get_input_embeddings()
    weight = getattr(embeddings, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else next(embeddings.parameters())


def _embed_forward(base: nn.Module, chunk: torch.Tensor) -> None:
    """The base model's forward on one chunk (its layers are stubs): token ids, or pixel values for image models."""
    device = input_embedding_weight(base).device
    if chunk.is_floating_point():  # pixel values: encoder-only image models take no cache
        base(pixel_values=chunk.to(device))
    else:
        base(input_ids=chunk.to(device), use_cache=False)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def runner_factory(model: nn.Module, spec, ids, batch_size: int, device, activations=None):
    """A factory of `LayerwiseRunner`s over `ids` (`None` without calibration data)."""
    if ids is None:
        return None

    def factory():
        return LayerwiseRunner(model, spec, ids, batch_size=batch_size, device=device, activations=activations)

    return factory
