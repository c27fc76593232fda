"""Configuration of the serving-shape search: one variant per sublayer of the DeciLM format, chosen under a target."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ...config import choice
from ...evaluation.cost_model import CostTable, Workload
from .config import NumericalConfig

__all__ = ["CANDIDATES", "ServingConfig"]

# the assemblies `ServingConfig.candidates` may build beside the solve
CANDIDATES = ("mlp_only",)


@dataclass
class ServingConfig(NumericalConfig):
    """The shapes a serving engine loads, chosen for a target at a workload: per layer, the attention's KV-head count
    (the KV heads of query heads that will share one merged: their key / value weights averaged, `o_proj` refitted)
    or no attention, and the MLP's width in the format's steps of 256 or no MLP. Every variant of every sublayer is
    scored on the calibration data by its layer-wise error after its closed-form refit, relative to the residual
    stream's energy at the layer; one variant per layer is then chosen to minimise the summed error under the target
    (an exact multiple-choice knapsack on a cost grid, its optimality gap bounded by the Lagrangian dual and reported),
    and the chosen model is refitted block by block (`compensation_inputs`, defaults to `"dense"`, chosen on the
    selection split: docs/guides/deployment.md): each block on the dense network's inputs, NP's default refit, which
    on NP's servable allocation gives NP's servable model; `"sequential"`: each on the inputs of the network pruned so
    far, NP's sequential refit and this config's behaviour before config_version 4).

    Exactly one target: `speedup` (the step time of `workload` divided by this, predicted by `cost_table`),
    `memory_gb` (weights plus the KV cache of `workload`'s batch and context), or else `pruning_ratio` (the share of
    attention + MLP parameters removed). The MLP channels of a layer are ranked by NP's scores (`NumericalConfig`'s
    fields, at `pruning_ratio`). Every output is written in the DeciLM format (`save_pretrained(format="decilm")`).

    Args:
        workload (`str`, defaults to `"decode:16:2048"`): `phase:batch:context` (`Workload.parse`), the step the
            speed target and the memory budget are about.
        speedup (`float | None`, defaults to `None`): the target: the dense model's predicted step time at
            `workload` over the pruned model's is at least this (> 1). Needs `cost_table`.
        memory_gb (`float | None`, defaults to `None`): the target: weights plus the KV cache at `workload`'s batch
            and context, in GB (1e9 bytes), at `memory_dtype_bytes` per value, at most this.
        cost_table (`str | dict | None`, defaults to `None`): the `CostTable` (a JSON path, or its dict) measured for
            this model's decoder at `workload` (`optimum-prune cost-model`); needed by `speedup`.
        memory_dtype_bytes (`int`, defaults to `2`): bytes per weight and per KV-cache value where served (bf16).
        kv_merge (`bool`, defaults to `True`): consider fewer KV heads per layer (not on layers whose k/v
            projections have biases: Qwen2's).
        remove_sublayers (`bool`, defaults to `True`): consider layers without attention (never layer 0: vLLM and
            SGLang start the residual stream there) and, in a layer without attention, without MLP.
        reader (`str`, defaults to `"all"`): the readers the assembly stays loadable by. `"all"` (vLLM, SGLang,
            TensorRT-LLM, MLX, llama.cpp): one KV-head count for every layer with attention (a count per layer is
            not verified in SGLang, TensorRT-LLM and MLX); `"vllm"` or `"llama.cpp"`: a KV-head count per layer
            (vLLM 0.32's `DeciLMForCausalLM` computes such a model's log-probabilities as transformers does,
            `benchmarks/vllm_reader.py`; llama.cpp's converter reads one count per layer). A Qwen2 model needs
            `"vllm"`: its q/k/v biases load in vLLM, SGLang and MLX only. Under `"all"` and `"llama.cpp"` the last
            layer keeps its attention or its MLP: llama.cpp aborts on a model whose last layer has neither.
        error_scale (`str`, defaults to `"end_to_end"`, chosen on the selection split: docs/guides/deployment.md): how the layer-wise errors of different layers and sublayers
            compare. `"end_to_end"`: each sublayer's errors are scaled so that its removal's error equals what its
            removal alone costs the whole model, the KL divergence of its next-token distribution from the dense
            model's on `probe_tokens` calibration tokens (one probe per sublayer; the layer-wise error of a smaller
            change is taken as proportional); `"residual"` divides each by the energy `E‖h‖²` of the residual stream
            leaving the layer; `"absolute"` adds them as they are.
        probe_tokens (`int`, defaults to `1024`): calibration tokens (whole sequences, the first ones) the
            `"end_to_end"` probes run on.
        joint_probe_rounds (`int`, defaults to `0`): re-solves after measuring the attention removals of the
            assembly together (needs `error_scale="end_to_end"`). Removing attention in many layers together may
            cost the model more (or less) than the sum of their removals alone: per round, the whole model's KL
            divergence on the probe tokens is measured with every attention the assembly removes removed at once,
            every layer's attention-removal loss is multiplied by the measured KL over the predicted sum, and the
            knapsack solves again; of the assemblies measured, the one whose measured KL plus the predicted losses
            of its other variants is lowest is kept. Each round costs one forward pass of `probe_tokens`.
        mlp_widths (`str`, defaults to `"knapsack"`): how the MLP widths of different layers are chosen.
            `"knapsack"`: each layer's width is its own option in the knapsack, weighed by its layer-wise loss;
            `"ranked"`: the widths follow NP's servable allocation (channel blocks of every layer ranked together by
            NP's scores, `functional.allocation.channel_block_path`), so the knapsack chooses how far along that
            ranking to cut (one solve per position) and the attention variants and removed layers beside it.
        candidates (`tuple[str, ...]`, defaults to `()`): assemblies built beside the solve, each refitted (as
            `compensation_inputs` says) and measured as a whole with the solve, the KL divergence of the whole model's
            next-token distribution from the dense model's on the probe sequences; the lowest is kept (ties: the
            solve). `"mlp_only"`: every attention kept whole and the MLP widths along NP's servable ranking of
            channel blocks as far as the target needs (NP's servable allocation at the target), where that reaches
            it. Each costs one refit pass and one forward pass of `probe_tokens`; needs `error_scale="end_to_end"`
            (the probe sequences) and a run without `checkpoint_dir`.
        resolution (`int`, defaults to `4000`): cells of the knapsack's cost grid (costs round up to whole cells).
    """

    method = "serving"
    config_version: ClassVar[int] = 4
    migrations: ClassVar[dict[int, dict[str, Any]]] = {
        2: {"joint_probe_rounds": 0},
        3: {"candidates": ()},
        4: {"compensation_inputs": "sequential"},  # (the field was there, its default changed)
    }

    allocation: str = "servable"
    compensation_inputs: str = "dense"
    workload: str = "decode:16:2048"
    speedup: float | None = None
    memory_gb: float | None = None
    cost_table: str | dict | None = None
    memory_dtype_bytes: int = 2
    kv_merge: bool = True
    remove_sublayers: bool = True
    reader: str = "all"
    error_scale: str = "end_to_end"
    probe_tokens: int = 1024
    joint_probe_rounds: int = 0
    mlp_widths: str = "knapsack"
    candidates: tuple[str, ...] = field(default_factory=tuple)
    resolution: int = 4000

    after_calibration_fields: ClassVar[tuple[str, ...]] = (
        *NumericalConfig.after_calibration_fields,
        "speedup",
        "memory_gb",
        "cost_table",
        "memory_dtype_bytes",
        "reader",
        "error_scale",
        "probe_tokens",
        "joint_probe_rounds",
        "mlp_widths",
        "candidates",
        "resolution",
    )

    @property
    def target(self) -> str:
        """`"speed"`, `"memory"` or `"params"`: what the assembly is constrained by."""
        return "speed" if self.speedup is not None else "memory" if self.memory_gb is not None else "params"

    @property
    def parsed_workload(self) -> Workload:
        return Workload.parse(self.workload)

    def load_cost_table(self) -> CostTable:
        """The `cost_table` (raises with how to make one where it is missing)."""
        if self.cost_table is None:
            raise ValueError(
                "ServingConfig(speedup=...) needs the cost of each variant where the model will be served: measure a "
                f"table with `optimum-prune cost-model MODEL --workload {self.workload} -o DIR` (or "
                "`evaluation.cost_model.measure_cost_table`) and pass `cost_table=DIR/<file>.json`."
            )
        if isinstance(self.cost_table, dict):
            return CostTable.from_dict(self.cost_table)
        return CostTable.load(self.cost_table)

    @property
    def allocation_mode(self) -> str:
        return "variants"

    @property
    def own_allocation(self) -> str | None:
        return "ServingConfig chooses one variant per sublayer under its target"

    def components(self) -> dict:
        out = super().components()
        out.update(allocation=f"variants ({self.target})", variants={"kv_merge": self.kv_merge,
                   "remove_sublayers": self.remove_sublayers, "reader": self.reader,
                   "mlp_widths": self.mlp_widths, "candidates": list(self.candidates)})  # fmt: skip
        return out

    def __post_init__(self) -> None:
        super().__post_init__()
        choice("allocation", self.allocation, ("servable",))
        choice("compensation_inputs", self.compensation_inputs, ("sequential", "dense"))
        choice("reader", self.reader, ("all", "vllm", "llama.cpp"))
        choice("error_scale", self.error_scale, ("end_to_end", "residual", "absolute"))
        choice("mlp_widths", self.mlp_widths, ("knapsack", "ranked"))
        if not isinstance(self.probe_tokens, int) or self.probe_tokens < 1:
            raise ValueError(f"`probe_tokens` must be an int >= 1, got {self.probe_tokens!r}.")
        rounds = self.joint_probe_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"`joint_probe_rounds` must be an int >= 0, got {self.joint_probe_rounds!r}.")
        if isinstance(self.candidates, str) or not all(isinstance(c, str) for c in self.candidates):
            raise ValueError(f"`candidates` is a tuple of names, e.g. ('mlp_only',); got {self.candidates!r}.")
        self.candidates = tuple(dict.fromkeys(self.candidates))
        for name in self.candidates:
            choice("candidates", name, CANDIDATES)
        if self.candidates and self.error_scale != "end_to_end":
            raise ValueError(
                "`candidates` are compared by the whole model's KL divergence on the probe sequences of "
                f"error_scale='end_to_end'; with error_scale={self.error_scale!r} set candidates=()."
            )
        if self.joint_probe_rounds and self.error_scale != "end_to_end":
            raise ValueError(
                "`joint_probe_rounds` reprices attention removals by the whole model's measured KL divergence, "
                f"the units of error_scale='end_to_end'; with error_scale={self.error_scale!r} set "
                "joint_probe_rounds=0."
            )
        Workload.parse(self.workload)
        if self.speedup is not None and self.memory_gb is not None:
            raise ValueError("ServingConfig takes one target: `speedup` or `memory_gb` (or neither: pruning_ratio).")
        for name in ("speedup", "memory_gb"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):  # fmt: skip
                raise ValueError(f"`{name}` must be a positive number or None, got {value!r}.")
        if self.speedup is not None and self.speedup <= 1:
            raise ValueError(f"`speedup` is dense time over pruned time: it must exceed 1, got {self.speedup}.")
        if not isinstance(self.memory_dtype_bytes, int) or self.memory_dtype_bytes < 1:
            raise ValueError(f"`memory_dtype_bytes` must be an int >= 1, got {self.memory_dtype_bytes!r}.")
        if not isinstance(self.resolution, int) or self.resolution < 10:
            raise ValueError(f"`resolution` must be an int >= 10, got {self.resolution!r}.")
        if self.cost_table is not None and not isinstance(self.cost_table, (str, dict)):
            raise ValueError("`cost_table` is a path to a cost-table JSON file or its dict (CostTable.to_dict()).")
