"""Spot check of the pruning pipeline: the exact models every method's pass kind produces, hashed, before and after
a change that must not change behaviour (a refactor of the runner, the passes or the configs).

Each case prunes a model and records the sha256 of the pruned state dict (every tensor's name, dtype, shape and
bytes), the report's measured ratio and the resolved config; the SmolLM2 cases add a perplexity. Cases cover every
pass kind in memory, low-memory (blocks on disk) and resumed after a crash (a checkpoint directory, the run
interrupted inside its calibration pass, then run again):

    PYTHONPATH=. python benchmarks/_pipeline_spot_check.py --output /tmp/after.json
    PYTHONPATH=. python benchmarks/_pipeline_spot_check.py --compare benchmarks/spot_checks/pipeline.json /tmp/after.json

`--compare` lists every case whose hash or numbers differ (and exits 1 if any does). The committed file is the
reference of the code before the change (its commit in `environment`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import harness  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from optimum_prune import (  # noqa: E402
    AMPConfig,
    AutoPrunedModelForCausalLM,
    AutoPruner,
    ExpertConfig,
    FISTAConfig,
    FLAPConfig,
    MagnitudeConfig,
    NumericalConfig,
    RIAConfig,
    SparseGPTConfig,
    SPPConfig,
    SPPRIAConfig,
    WandaConfig,
)
from optimum_prune.calibration.sequential import LayerwiseRunner  # noqa: E402

SPP_FAST = {"faithful_to": "code", "steps": 10, "batch_size": 1, "lr": 0.08, "lambda_": 0.7, "betas": (0.5, 0.9)}
NP = {"pruning_ratio": 0.3, "round_to": 1}


def tiny_llama(seed: int = 0) -> transformers.PreTrainedModel:
    """A 5-layer random Llama with SmolLM2's GQA shape (groups of 3 query heads), weights drawn so that pruning
    decisions are not ties."""
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=72, intermediate_size=96, num_attention_heads=6, num_key_value_heads=2,
        head_dim=12, num_hidden_layers=5, tie_word_embeddings=True,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
    return model


def tiny_moe(seed: int = 0) -> transformers.PreTrainedModel:
    """A 2-layer random Qwen3-MoE (6 experts, top 2), float32."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, num_experts_per_tok=2, tie_word_embeddings=False, moe_intermediate_size=24,
        intermediate_size=48, num_experts=6, head_dim=8, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router" in name or name.endswith("gate.weight") or "experts" in name:
                p.normal_(0, 0.3)
    return model


def ids(vocab: int, n: int = 8, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


def state_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class Crash(RuntimeError):
    pass


@contextlib.contextmanager
def crash_after(calls: int):
    """Raise inside the calibration runner's `run_layer` at its `calls`-th call (a crash mid-run)."""
    original, count = LayerwiseRunner.run_layer, [0]

    def run_layer(self, *args, **kwargs):
        count[0] += 1
        if count[0] == calls:
            raise Crash(f"crash at run_layer call {calls}")
        return original(self, *args, **kwargs)

    LayerwiseRunner.run_layer = run_layer
    try:
        yield
    finally:
        LayerwiseRunner.run_layer = original


def run_case(name: str, make, config, calibration, *, mode: str = "memory", work: Path) -> dict:
    """Prune `make()` with `config`; `mode`: "memory", "low_memory" (saved, reloaded with blocks on disk) or
    "resume" (a checkpointed run crashed mid-pass, then run again); returns the record."""
    model = make()
    t0 = time.perf_counter()
    if mode == "memory":
        pruner = AutoPruner.from_pretrained(model)
        report = pruner.prune(config, calibration=calibration, batch_size=3)
        out = pruner.model
    else:
        src = work / f"{name}-src"
        model.save_pretrained(src)
        low = mode == "low_memory"
        kwargs = {"checkpoint_dir": work / f"{name}-ckpt"} if mode == "resume" else {}
        if mode == "resume":
            with crash_after(4), contextlib.suppress(Crash):
                AutoPruner.from_pretrained(src).prune(config, calibration=calibration, batch_size=3, **kwargs)
        pruner = AutoPruner.from_pretrained(src, low_memory=low)
        report = pruner.prune(config, calibration=calibration, batch_size=3, **kwargs)
        saved = work / f"{name}-out"
        pruner.save_pretrained(saved)
        out = AutoPrunedModelForCausalLM.from_pretrained(saved)
    return {
        "hash": state_hash(out),
        "measured": report.measured,
        "params_after": report.params_after,
        "config": report.config,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def tiny_cases():
    llama, moe = tiny_llama, tiny_moe
    cal, moe_cal = ids(128), ids(256)
    amp = AMPConfig(targets=["q_proj", "k_proj"], cg_steps=2, refit_steps=3)
    rest = WandaConfig(sparsity=0.5, targets=["v_proj", "o_proj", "mlp"])
    amp_model = AMPConfig(cg_steps=2, refit_steps=3, refit_target="model")
    return [
        ("np_default", llama, NumericalConfig(pruning_ratio=0.3), cal, "memory"),
        ("np_round1", llama, NumericalConfig(**NP), cal, "memory"),
        ("np_owl", llama, NumericalConfig(**NP, allocation="owl"), cal, "memory"),
        ("np_uniform", llama, NumericalConfig(**NP, allocation="uniform"), cal, "memory"),
        ("np_loss", llama, NumericalConfig(**NP, ranking="loss"), cal, "memory"),
        ("np_paper", llama, NumericalConfig.paper(pruning_ratio=0.3), cal, "memory"),
        ("np_sequential", llama, NumericalConfig(**NP, compensation_inputs="sequential"), cal, "memory"),
        ("flap", llama, FLAPConfig(**NP), cal, "memory"),
        ("magnitude_structured", llama, MagnitudeConfig(pruning_ratio=0.3, round_to=1), None, "memory"),
        ("magnitude_unstructured", llama, MagnitudeConfig(sparsity=0.5), None, "memory"),
        ("wanda", llama, WandaConfig(sparsity=0.5), cal, "memory"),
        ("wanda_24", llama, WandaConfig(sparsity=0.5, pattern="2:4"), cal, "memory"),
        ("sparsegpt", llama, SparseGPTConfig(sparsity=0.5), cal, "memory"),
        ("ria", llama, RIAConfig(sparsity=0.5), cal, "memory"),
        ("fista", llama, FISTAConfig(sparsity=0.5, K=3, max_outer=2), cal, "memory"),
        ("amp_recipe", llama, [amp, rest], cal, "memory"),
        ("amp_model", llama, amp_model, cal, "memory"),
        (
            "np_wanda_recipe",
            llama,
            [NumericalConfig(pruning_ratio=0.2, round_to=1), WandaConfig(sparsity=0.5)],
            cal,
            "memory",
        ),  # fmt: skip
        ("experts", moe, ExpertConfig(expert_ratio=0.5), moe_cal, "memory"),
        ("experts_channels", moe, ExpertConfig(expert_ratio=0.34, channel_ratio=0.34, round_to=4), moe_cal, "memory"),
        ("experts_global", moe, ExpertConfig(expert_ratio=0.5, allocation="global"), moe_cal, "memory"),
        ("spp", llama, SPPConfig(pruning_ratio=0.3, round_to=1, head_dim_multiple=1, **SPP_FAST), cal, "memory"),
        ("spp_ria", llama, SPPRIAConfig(sparsity=0.5, **SPP_FAST), cal, "memory"),
        ("np_low_memory", llama, NumericalConfig(**NP), cal, "low_memory"),
        (
            "np_sequential_low_memory",
            llama,
            NumericalConfig(**NP, compensation_inputs="sequential"),
            cal,
            "low_memory",
        ),  # fmt: skip
        ("flap_low_memory", llama, FLAPConfig(**NP), cal, "low_memory"),
        ("sparsegpt_low_memory", llama, SparseGPTConfig(sparsity=0.5), cal, "low_memory"),
        ("amp_model_low_memory", llama, amp_model, cal, "low_memory"),
        (
            "experts_low_memory",
            moe,
            ExpertConfig(expert_ratio=0.34, channel_ratio=0.34, round_to=4),
            moe_cal,
            "low_memory",
        ),
        ("np_resume", llama, NumericalConfig(**NP), cal, "resume"),
        ("np_sequential_resume", llama, NumericalConfig(**NP, compensation_inputs="sequential"), cal, "resume"),
        ("wanda_resume", llama, WandaConfig(sparsity=0.5), cal, "resume"),
        ("fista_resume", llama, FISTAConfig(sparsity=0.5, K=3, max_outer=2), cal, "resume"),
        ("amp_model_resume", llama, amp_model, cal, "resume"),
        ("experts_resume", moe, ExpertConfig(expert_ratio=0.34, channel_ratio=0.34, round_to=4), moe_cal, "resume"),
    ]


def smollm2_cases(tokens: int):
    """NP's and FLAP's defaults at 20% on SmolLM2-135M, 16 x 128 BBC calibration windows, perplexity on held-out
    BBC documents."""
    from optimum_prune.samples import smollm2_gguf

    tok = AutoPruner.from_pretrained(smollm2_gguf()).tokenizer
    protocol = harness.Protocol(split="selection", seed=0, eval_texts=("bbc", "kjv"), eval_tokens=tokens)
    cal = protocol.calibration_ids(tok, 16, 128)

    out = []
    for name, config in (("smollm2_np20", NumericalConfig(pruning_ratio=0.2)),
                         ("smollm2_flap20", FLAPConfig(pruning_ratio=0.2))):  # fmt: skip
        pruner = AutoPruner.from_pretrained(smollm2_gguf())
        report = pruner.prune(config, calibration=cal)
        rec = {"hash": state_hash(pruner.model), "measured": report.measured, "config": report.config}
        rec["perplexity"] = protocol.evaluate(pruner.model, tok)[0]
        out.append((name, rec))
    return out


def markdown(result: dict) -> str:
    env = result.get("environment", {})
    lines = [
        "# Pipeline spot check",
        "",
        f"Code at commit `{env.get('versions', {}).get('git_commit')}` ({env.get('date')}); `benchmarks/_pipeline_spot_check.py` "
        "(its docstring says what each case runs). A change that must not change behaviour reproduces every hash.",
        "",
        "| case | sha256 of the pruned state dict | measured | perplexity |",
        "|---|---|---|---|",
    ]
    for name, rec in result["cases"].items():
        ppl = rec.get("perplexity")
        ppl = ", ".join(f"{k} {v:.4f}" for k, v in ppl.items()) if ppl else ""
        lines.append(f"| {name} | `{rec['hash'][:24]}` | {rec['measured']:.6f} | {ppl} |")
    return "\n".join(lines) + "\n"


def compare(a_path: str, b_path: str) -> int:
    A, B = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    bad = 0
    for name in sorted(set(A["cases"]) | set(B["cases"])):
        a, b = A["cases"].get(name), B["cases"].get(name)
        if a is None or b is None:
            print(f"{name}: only in {'B' if a is None else 'A'}")
            bad += 1
            continue
        diffs = [k for k in ("hash", "measured", "params_after", "perplexity", "config") if a.get(k) != b.get(k)]
        print(f"{name}: {'identical' if not diffs else 'DIFFERS in ' + ', '.join(diffs)}")
        bad += bool(diffs)
    print(f"{bad} of {len(set(A['cases']) | set(B['cases']))} cases differ")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default=str(Path(__file__).parent / "spot_checks" / "pipeline.json"))
    p.add_argument("--compare", nargs=2, default=None, metavar=("A", "B"))
    p.add_argument("--only", nargs="*", default=None, help="run these cases only")
    p.add_argument("--no-smollm2", action="store_true")
    p.add_argument("--eval-tokens", type=int, default=4096)
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    harness.setup_logging()
    torch.set_num_threads(1)  # one thread: the reference does not depend on the machine's core count
    cases = {}
    with tempfile.TemporaryDirectory() as work:
        for name, make, config, calibration, mode in tiny_cases():
            if args.only is not None and name not in args.only:
                continue
            cases[name] = run_case(name, make, copy.deepcopy(config), calibration, mode=mode, work=Path(work))
            print(f"{name}: {cases[name]['hash'][:16]} measured {cases[name]['measured']:.6f}", file=sys.stderr)
    if not args.no_smollm2 and args.only is None:
        for name, rec in smollm2_cases(args.eval_tokens):
            cases[name] = rec
            print(f"{name}: {rec['hash'][:16]} ppl {rec.get('perplexity')}", file=sys.stderr)
    result = {"environment": harness.environment(argv), "cases": cases}
    harness.write_results(result, Path(args.output), renderer="_pipeline_spot_check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
