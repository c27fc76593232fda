"""Every registered method on a CUDA device gives what it gives on the CPU.

Two ways a user prunes on a GPU: the model already on it (`model.cuda()`, calibration ids on the CPU), and a CPU model
pruned block by block on the GPU (`device="cuda"`, the low-memory path). Both must run and decide what the CPU run
decides: the same per-layer shapes (structured) or nearly the same masks (unstructured: float32 sums in another order
can swap near-ties), and logits that match the CPU result. Skipped where torch sees no CUDA device (CI has none); run
on a GPU machine with `python -m pytest tests/test_cuda.py`.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_common import CASE_IDS, METHOD_CASES, _calibration, _is_structured
from testing_utils import calibration_ids, tiny_model

from optimum_prune import prune_
from optimum_prune.modeling.architectures import get_layers, get_spec, layer_view

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ARCHS_ON_GPU = ["llama_gqa", "qwen3", "opt"]
SEARCHES = {"spp", "spp_ria"}  # stochastic training on the task loss: the GPU's kernels give another path


def _shapes(model) -> list[tuple[int, int]]:
    spec = get_spec(model)
    views = [layer_view(layer, i, spec, model.config) for i, layer in enumerate(get_layers(model, spec))]
    return [(v.num_heads, v.intermediate_size) for v in views]


def _zeros(model) -> dict[str, torch.Tensor]:
    return {n: (p.detach() == 0).cpu() for n, p in model.named_parameters() if p.dim() == 2}


@torch.no_grad()
def _logits(model, device) -> torch.Tensor:
    ids = calibration_ids(2, 12, seed=123).to(device)
    return model(input_ids=ids, use_cache=False).logits.float().cpu()


@pytest.fixture(autouse=True)
def _exact_float32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("placement", ["model_on_gpu", "device_arg"])
@pytest.mark.parametrize("arch", ARCHS_ON_GPU)
@pytest.mark.parametrize(("cfg_cls", "kwargs", "tol"), METHOD_CASES, ids=CASE_IDS)
def test_gpu_run_matches_cpu(cfg_cls, kwargs, tol, arch, placement):
    config = cfg_cls(**kwargs)
    ids = _calibration(arch, config)
    cpu = tiny_model(arch)
    cpu_report = prune_(cpu, copy.deepcopy(config), ids)

    model = tiny_model(arch)
    if placement == "model_on_gpu":
        model = model.cuda()
        report = prune_(model, copy.deepcopy(config), ids)
        assert all(p.device.type == "cuda" for p in model.parameters()), "the pruned model left the GPU"
        device = "cuda"
    else:
        report = prune_(model, copy.deepcopy(config), ids, device="cuda")
        assert all(p.device.type == "cpu" for p in model.parameters()), (
            "device= must give the model back on its device"
        )
        device = "cpu"
    assert abs(report.measured - report.target) <= tol, report
    out = _logits(model, device)
    assert torch.isfinite(out).all()
    if config.method in SEARCHES:
        return
    if _is_structured(cfg_cls, kwargs):
        assert _shapes(model) == _shapes(cpu)
        torch.testing.assert_close(out, _logits(cpu, "cpu"), rtol=1e-3, atol=1e-3)
    else:
        zc, zg = _zeros(cpu), _zeros(model)
        agree = sum(int((zc[n] == zg[n]).sum()) for n in zc) / sum(zc[n].numel() for n in zc)
        assert agree >= 0.99, f"masks agree on {agree:.4f} of the weights"
        assert cpu_report.measured == pytest.approx(report.measured, abs=0.01)


def _has_24_kernels() -> bool:
    from optimum_prune.modeling.semi_structured import check_semi_structured_support

    try:
        check_semi_structured_support()
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(not _has_24_kernels(), reason="needs compute capability >= 8.0")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("backend", ["cusparselt", "cutlass"])
def test_semi_structured_model_replays_in_a_cuda_graph(backend, dtype):
    """A 2:4 model on each backend and dtype computes the dense model's logits, eagerly and replayed from a CUDA
    graph (how `benchmarks/semi_structured.py` times it without the per-call host work)."""
    import inspect

    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    from optimum_prune import MagnitudeConfig, to_semi_structured_

    if backend == "cusparselt" and not torch.backends.cusparselt.is_available():
        pytest.skip("this torch has no cuSPARSELt")
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, vocab_size=128
    )
    model = LlamaForCausalLM(config).eval()
    prune_(model, MagnitudeConfig(pattern="2:4", sparsity=0.5))
    ids = calibration_ids(2, 64).cuda() % 128
    model = model.to(device="cuda", dtype=dtype)

    # a static cache, rewound by the call itself: a capture then allocates nothing and reads nothing on the host
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1])
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def forward():
        with torch.inference_mode():
            for layer in getattr(cache, "layers", []):
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                    layer.cumulative_length.fill_(0)
            return model(input_ids=ids, use_cache=True, logits_to_keep=1, **{name: cache}).logits.float()

    dense = forward().clone()
    assert len(to_semi_structured_(model, dtype=dtype, backend=backend)) == 2 * 7
    eager = forward().clone()
    torch.testing.assert_close(eager, dense, rtol=3e-2, atol=3e-2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = forward()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(replayed, eager, rtol=1e-3, atol=1e-3)
