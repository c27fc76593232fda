"""The serving shapes in llama.cpp: every model of a `benchmarks/serving.py` results file (its DeciLM folders),
converted by llama.cpp's own `convert_hf_to_gguf.py` and timed in llama.cpp (through llama-cpp-python, the `llamacpp`
extra) against the dense model.

Per model: the folder `serving.py` saved (`--workdir` there) is converted to `--outtype` (f16: what llama.cpp users
run); llama.cpp's perplexity on the first `--check-tokens` tokens of each text's stream (windows of `--window`) is set beside
transformers' on the very same token ids (the conversion of every variant checked, KV merges and removed sublayers
included); then each model is timed with the dense model, the pair interleaved round by round (`--rounds`, after
`--warmup`; medians, per-round ratios with their interquartile range), at each batch-1 workload of the file:

- `prefill:1:C`: one forward pass of a C-token prompt (the prompt's evaluation, one `llama_decode` of C tokens);
- `decode:1:C`: the mean time of one generated token at a context of about C (a `C - new_tokens` prompt evaluated,
  then `--new-tokens` greedy tokens, each timed as a whole).

A batch of several sequences (`decode:16:2048`) is not timed: llama-cpp-python's `Llama` decodes one sequence. The
dense reference is the dense model's own folder (`save_pretrained`, Llama architecture in llama.cpp); "dense as DeciLM"
is the same weights written in the DeciLM format (llama.cpp's `deci` graph), so the format's own cost is visible.

    OMP_NUM_THREADS=1 python benchmarks/serving_llamacpp.py --serving benchmarks/results/serving_smollm2.json
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

import harness  # noqa: E402
import torch  # noqa: E402
from harness import REPO_ROOT  # noqa: E402
from serving import _label, _shape  # noqa: E402

from optimum_prune import save_pruned_model  # noqa: E402
from optimum_prune.evaluation import perplexity  # noqa: E402

logger = logging.getLogger("serving_llamacpp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serving", default=str(harness.RESULTS_DIR / "serving_smollm2.json"),
                   help="a benchmarks/serving.py results file (its models' folders must exist)")  # fmt: skip
    p.add_argument("--models", nargs="*", default=None, help="names in that file (default: every model)")
    p.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"], help="the converter's")
    p.add_argument("--check-tokens", type=int, default=2048, help="tokens per text of the perplexity check")
    p.add_argument("--window", type=int, default=512, help="the perplexity check's window length")
    p.add_argument("--new-tokens", type=int, default=32, help="generated tokens of a decode measurement")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds per pair")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="llama.cpp and torch threads")
    p.add_argument("--workdir", default="/tmp/serving_llamacpp", help="converted files (kept: a rerun resumes)")
    p.add_argument("--output", default=str(harness.RESULTS_DIR / "serving_llamacpp_smollm2.json"))
    harness.add_tree_args(p)
    return p.parse_args(argv)


def convert(folder: Path, path: Path, outtype: str) -> str:
    """`folder` through llama.cpp's converter (its GPT-2 BPE vocabulary step where its DeciLM class stops on the
    tokenizer, as in `deploy.py`); returns which vocabulary step wrote it."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from llamacpp_converter import convert as run_converter

    if path.is_file():
        return "cached"
    tmp = path.with_suffix(".partial")
    try:
        run_converter(folder, tmp, outtype)
        vocab = "its own"
    except RuntimeError as e:
        if "Cannot find Llama BPE tokenizer" not in str(e):
            raise
        run_converter(folder, tmp, outtype, gpt2_vocab=True)
        vocab = "its GPT-2 BPE step"
    tmp.rename(path)
    return vocab


def time_pair(dense_path: str, path: str, workload: str, args, prompt_ids: list[int]) -> dict[str, Any]:
    """Dense and one model at a batch-1 workload, interleaved: medians and per-round ratios (dense / model)."""
    import _llamacpp

    phase, batch, context = workload.split(":")
    if int(batch) != 1:
        raise ValueError(f"llama-cpp-python's Llama decodes one sequence: {workload} is not timed")
    context = int(context)
    if phase == "prefill":
        prompt, new = prompt_ids[:context], 1
    else:
        prompt, new = prompt_ids[: context - args.new_tokens], args.new_tokens
    if len(prompt) + (0 if phase == "prefill" else new) < context:
        raise ValueError(f"{workload} needs {context} tokens of prompt text; {len(prompt_ids)} given")
    got = _llamacpp.compare_speed({"dense": dense_path, "model": path}, prompt, new_tokens=new, warmup=args.warmup,
                                  repeats=args.rounds, n_threads=args.threads)  # fmt: skip
    k = 0 if phase == "prefill" else 1  # the prompt's time, or the generated tokens'
    dense_s = [s[k] for s in got["dense"]["samples"]]
    model_s = [s[k] for s in got["model"]["samples"]]
    scale = 1 if phase == "prefill" else new  # a decode step: one generated token
    return {"dense_s": got["dense"][f"{phase}_s"] / scale, "model_s": got["model"][f"{phase}_s"] / scale,
            "speedup": got["dense"][f"{phase}_s"] / got["model"][f"{phase}_s"],
            **harness.round_ratios(dense_s, model_s, "speedup"), "prompt_tokens": len(prompt), "new_tokens": new,
            "load_average": (harness.loadavg() or [None])[0]}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    import _llamacpp  # the `llamacpp` extra; its absence raises an ImportError naming it
    import llama_cpp

    args = parse_args(argv)
    harness.setup_logging()
    torch.set_num_threads(args.threads)
    harness.require_clean_tree(args)
    serving = json.loads(Path(args.serving).read_text())
    sargs = argparse.Namespace(**{**serving["args"], "allow_dirty": True})
    dense, tok, model_desc = harness.load_model(sargs)
    proto = harness.Protocol.from_args(sargs)
    texts = proto.eval_texts
    ids = {t: tok("\n\n".join(proto.texts(t)))["input_ids"] for t in texts}
    out = Path(args.output)
    res = json.loads(out.read_text()) if out.is_file() else {}
    if res and res.get("serving_file_commit") != serving["versions"]["git_commit"]:
        res = {}  # another serving run's models: start again
    res.update(harness.environment(argv, "serving_llamacpp.py"), args=vars(args), model=model_desc)
    res["versions"]["llama_cpp"] = llama_cpp.__version__
    res["serving_file"] = Path(args.serving).name
    res["serving_file_commit"] = serving["versions"]["git_commit"]
    res["protocol"] = serving["protocol"]
    res.setdefault("models", {})
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    workloads = [w for w in serving["speed"] if w.split(":")[1] == "1"]
    res["workloads"] = workloads
    res["not_timed"] = [w for w in serving["speed"] if w not in workloads]

    def write() -> None:
        harness.write_results(res, out, "serving_llamacpp")

    # the references: dense as its own architecture (Llama), and the same weights as DeciLM
    folders = {"dense": work / "dense_hf", "dense_deci": work / "dense_deci"}
    if not (folders["dense"] / "config.json").is_file():
        dense.save_pretrained(folders["dense"])
        tok.save_pretrained(folders["dense"])
    if not (folders["dense_deci"] / "config.json").is_file():
        save_pruned_model(copy.deepcopy(dense), folders["dense_deci"], tok, format="deci", overwrite=True)
    names = args.models or [n for n in serving["models"] if n != "dense"]
    for name in names:
        folders[name] = Path(serving["models"][name]["folder"])
    for name in ["dense", "dense_deci", *names]:
        entry = res["models"].setdefault(name, {})
        entry["serving"] = _serving_record(serving, name, workloads)
        path = work / f"{name.replace('@', '_').replace(':', '-')}.{args.outtype}.gguf"
        if "ppl" not in entry:
            entry["vocabulary"] = convert(folders[name], path, args.outtype)
            entry["path"], entry["mb"] = str(path), path.stat().st_size / 1e6
            from optimum_prune import load_pruned_model

            model = dense if name == "dense" else load_pruned_model(folders[name], dtype=torch.float32).eval()
            llm = _llamacpp.load(path, n_ctx=args.window, n_threads=args.threads, logits_all=True)
            entry["ppl"] = {t: {"llama_cpp": _llamacpp.perplexity(llm, ids[t][: args.check_tokens], args.window),
                                "transformers": perplexity(model, tok, proto.texts(t), seq_len=args.window,
                                                           max_tokens=args.check_tokens)}
                            for t in texts}  # fmt: skip
            del llm, model
            logger.info("%s: %s", name, entry["ppl"])
            write()
    prompt = ids[texts[0]]
    for name in ["dense_deci", *names]:
        entry = res["models"][name]
        speed = entry.setdefault("speed", {})
        for w in workloads:
            if w not in speed:
                with harness.timing_lock():
                    speed[w] = time_pair(res["models"]["dense"]["path"], entry["path"], w, args, prompt)
                logger.info("%s at %s: %.3fx", name, w, speed[w]["speedup"])
                write()
    write()
    return res


# ----------------------------------------------------------------------------------------------------- markdown
def markdown(res: dict[str, Any]) -> str:
    texts = list(next(iter(res["models"].values())).get("ppl", {})) if res["models"] else []
    a = res["args"]
    lines = [
        f"# The serving shapes in llama.cpp — {res['model']}",
        "",
        f"Generated by `benchmarks/serving_llamacpp.py` ({res['date']}, {res['host']['cpu']}, "
        f"{res['host']['cpu_count']} CPUs; llama-cpp-python {res['versions'].get('llama_cpp')}, {a['threads']} "
        f"thread(s), commit {str(res['versions']['git_commit'])[:7]}).",
        "",
        harness.protocol_line({"protocol": res["protocol"]}),
        f"- The models of `{res['serving_file']}` (its run at commit {str(res['serving_file_commit'])[:7]}; their "
        "perplexities with intervals are there), each converted by llama.cpp's own `convert_hf_to_gguf.py` to "
        f"{a['outtype']} and timed in llama.cpp interleaved with the dense model (medians of {a['rounds']} rounds "
        f"after {a['warmup']} warm-up; speedup = dense / model, with the IQR of the per-round ratios, a tie where it "
        "holds 1). Prefill: one evaluation of the prompt; decode: the mean time of one of "
        f"{a['new_tokens']} greedy tokens after a prompt that brings the context to the workload's. Beside it, "
        "transformers' measured speedup and the cost table's prediction, both from that file.",
        "- Dense reference: the dense model's own folder (Llama in llama.cpp). Not timed: "
        + (", ".join(res.get("not_timed", [])) or "none")
        + " (llama-cpp-python's `Llama` decodes one sequence).",
        f"- Conversion check: llama.cpp's perplexity against transformers' (fp32) on the same first "
        f"{a['check_tokens']} tokens of each text, windows of {a['window']}.",
        "",
    ]
    for w in res.get("workloads", []):
        lines += [f"## {w}", "", "| model | shapes | llama.cpp speedup | transformers speedup | predicted |",
                  "|---|---|---|---|---|"]  # fmt: skip
        rows = [(n, e) for n, e in res["models"].items() if w in e.get("speed", {})]
        for _, e in sorted(rows, key=lambda ne: ne[1]["speed"][w]["speedup"]):
            s, sv = e["speed"][w], e["serving"]
            cells = [f"{harness.round_median(s, 'speedup'):.2f}x{harness.spread_note(s, 'speedup')}",
                     *(f"{v:.2f}x" if v is not None else "–" for v in (sv["transformers"].get(w),
                                                                       sv["predicted"].get(w)))]  # fmt: skip
            lines.append(f"| {sv['label']} | {sv['shape']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Conversion check (perplexity, llama.cpp / transformers)", "",
              "| model | file MB | " + " | ".join(harness.text_label(t) for t in texts) + " | largest relative gap |",
              "|---|---:|" + "---|" * len(texts) + "---:|"]  # fmt: skip
    for e in res["models"].values():
        if "ppl" in e:
            gap = max(abs(p["llama_cpp"] / p["transformers"] - 1) for p in e["ppl"].values())
            cells = [f"{p['llama_cpp']:.3f} / {p['transformers']:.3f}" for p in e["ppl"].values()]
            lines.append(f"| {e['serving']['label']} | {e['mb']:.0f} | " + " | ".join(cells) + f" | {gap:.2%} |")
    lines.append("")
    return "\n".join(lines)


def _serving_record(serving: dict[str, Any], name: str, workloads: list[str]) -> dict[str, Any]:
    """What the serving file says of a model: its label and shapes, transformers' speedup and the prediction."""
    from optimum_prune.evaluation.cost_model import CostTable

    if name in ("dense", "dense_deci"):
        label = {"dense": "dense (Llama)", "dense_deci": "dense as DeciLM"}[name]
        return {"label": label, "shape": "dense", "transformers": {}, "predicted": {}}
    entry, dense = serving["models"][name], serving["models"]["dense"]
    predicted = {}
    for w in workloads:
        if w in serving.get("tables", {}):
            table = CostTable.from_dict(serving["tables"][w])
            predicted[w] = table.predict(dense["layers"]) / table.predict(entry["layers"])
    return {
        "label": _label(name, entry),
        "shape": _shape(entry),
        "predicted": predicted,
        "transformers": {w: serving["speed"].get(w, {}).get(name, {}).get("speedup") for w in workloads},
    }


if __name__ == "__main__":
    main()
