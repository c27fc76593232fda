"""Thread-count probe: does SPP's search on SmolLM2-135M depend on the thread count, and where does it first differ?

Run one process per setting, the thread count in the ENVIRONMENT before torch is imported:

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONPATH=. python benchmarks/_spp_thread_probe.py --steps 5 --out /tmp/p1.pt
    OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 PYTHONPATH=. python benchmarks/_spp_thread_probe.py --steps 5 --out /tmp/p2.pt
    OMP_NUM_THREADS=2 ... --set-threads 1 --out /tmp/p2s1.pt     # torch.set_num_threads(1) in a 2-thread process
    python benchmarks/_spp_thread_probe.py --compare /tmp/p1.pt /tmp/p2.pt

The search is the default `SPPConfig(steps=120)` on the protocol's calibration split (seed 0), 32 x 512 BBC windows
(the issue's; `--calib-seed` draws other windows of the same documents), stopped after `--steps`. Recorded: the drawn labels, ν, every step's loss, mask gradients, masks and
Z; at step 1 (`--trace`) every decoder layer's output and its gradient, the logits and their gradient, and layer
0's Linear inputs / outputs; the per-layer MLP widths at 20 / 30 / 40%, and seconds per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="stop the (120-step) search after this many steps")
    p.add_argument("--out", default=None)
    p.add_argument("--set-threads", type=int, default=None, help="torch.set_num_threads(N) after importing torch")
    p.add_argument("--trace", action="store_true", help="record step 1's intermediate tensors")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-seed", type=int, default=0,
                   help="seed of the calibration-window draw (the document split stays seed 0)")  # fmt: skip
    p.add_argument("--ratios", nargs="+", type=float, default=[0.2, 0.3, 0.4])
    p.add_argument("--save-path", default=None, help="save the solution path in this directory")
    p.add_argument("--extract", default=None, help="a saved path: prune at --ratios with the default refit instead")
    p.add_argument("--eval-tokens", type=int, default=4096, help="(--extract) tokens of each text scored")
    p.add_argument("--compare", nargs=2, default=None, metavar=("A", "B"))
    return p.parse_args(argv)


# -------------------------------------------------------------------------------------------------------- compare
def _diff(a, b) -> str:
    import torch

    a, b = a.double(), b.double()
    if torch.equal(a, b):
        return "identical"
    d = (a - b).abs()
    scale = a.abs().max().clamp_min(1e-300)
    return (f"max|d| {float(d.max()):.3e} (rel to max|a| {float(d.max() / scale):.3e}), "
            f"{int((d > 0).sum())}/{d.numel()} entries differ")  # fmt: skip


def compare(pa: str, pb: str) -> None:
    import torch

    A, B = torch.load(pa, weights_only=False), torch.load(pb, weights_only=False)
    print(f"A: {pa} {A['env']}\nB: {pb} {B['env']}")
    if "extract" in A:
        compare_extract(A, B)
        return
    print("input ids identical:", torch.equal(A["ids"], B["ids"]))
    la, lb = A["labels"], B["labels"]
    print("drawn labels:", "identical" if torch.equal(la, lb) else f"{int((la != lb).sum())} of {la.numel()} differ")
    print("nu:", A["nu"], B["nu"], "identical" if A["nu"] == B["nu"] else "DIFFER")
    if A.get("trace") and B.get("trace"):
        print("-- step 1, forward order then backward order (first differing entries):")
        for name in A["trace"]:
            if name in B["trace"]:
                print(f"  {name:34s} {_diff(A['trace'][name], B['trace'][name])}")
    n = min(len(A["steps"]), len(B["steps"]))
    first = {}
    for t in range(n):
        sa, sb = A["steps"][t], B["steps"][t]
        loss = "same" if sa["loss"] == sb["loss"] else f"{sa['loss']!r} vs {sb['loss']!r}"
        parts = []
        for what in ("grad", "mask", "z"):
            ca = torch.cat([sa[what][k].flatten() for k in sorted(sa[what])])
            cb = torch.cat([sb[what][k].flatten() for k in sorted(sb[what])])
            res = _diff(ca, cb)
            if res != "identical":
                first.setdefault(what, t + 1)
            parts.append(f"{what}: {res}")
        ent = sum(int(((sa["z"][k] > 1.0) != (sb["z"][k] > 1.0)).sum()) for k in sa["z"])
        ina = sum(int((sa["z"][k] > 1.0).sum()) for k in sa["z"])
        print(f"step {t + 1:3d}  loss {loss}; in support A {ina}, differing {ent}; " + "; ".join(parts))
    print("first differing step per tensor:", first)
    if "entry" in A and "entry" in B:
        diff = {k: int((A["entry"][k] != B["entry"][k]).sum()) for k in A["entry"]}
        print("path entry steps differ for", sum(diff.values()), "units;",
              {k: v for k, v in diff.items() if v})  # fmt: skip
    for r in A.get("widths", {}):
        wa, wb = A["widths"][r], B["widths"].get(r)
        same = wa == wb
        print(f"widths at {r}: {'identical' if same else 'DIFFER'}")
        if not same:
            print("   A", wa, "\n   B", wb)
        ka, kb = A["kept"][r], B["kept"][r]
        print(f"   kept unit sets: {'identical' if ka == kb else 'DIFFER'}")
    for X, name in ((A, "A"), (B, "B")):
        ts = X["step_seconds"]
        if ts:
            print(f"{name}: seconds per step {sorted(ts)[len(ts) // 2]:.2f} (median of {len(ts)}), threads "
                  f"{X['env']['torch_threads']}")  # fmt: skip


# -------------------------------------------------------------------------------------------------------- probe
def probe(args) -> None:
    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    import torch

    if args.set_threads is not None:
        torch.set_num_threads(args.set_threads)
    env["set_threads"] = args.set_threads
    env["torch_threads"] = torch.get_num_threads()
    sys.path.insert(0, str(Path(__file__).parent))
    import harness

    from optimum_prune import AutoPruner
    from optimum_prune.methods.spp import SPPConfig, search_solution_path
    from optimum_prune.methods.spp import search as S
    from optimum_prune.methods.spp import search_data as T
    from optimum_prune.methods.spp.extract import extract_keep
    from optimum_prune.modeling.architectures import get_spec
    from optimum_prune.samples import SMOLLM2_GGUF_FILE, smollm2_dir

    print("env", env, flush=True)
    t0 = time.perf_counter()
    pruner = AutoPruner.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF_FILE, torch_dtype="float32")
    model, tokenizer = pruner.model.eval(), pruner.tokenizer
    del pruner
    print(
        f"model loaded in {time.perf_counter() - t0:.1f} s; attention {model.config._attn_implementation}", flush=True
    )
    protocol = harness.Protocol(split="test", seed=0)
    ids = protocol.calibration_ids(tokenizer, args.samples, args.seq_len, seed=args.calib_seed)
    rec: dict = {"env": env, "ids": ids.clone(), "steps": [], "trace": {}, "step_seconds": []}

    orig_labels = T.sampled_labels

    def sampled_labels(*a, **kw):
        out = orig_labels(*a, **kw)
        rec["labels"] = out.clone()
        return out

    T.sampled_labels = sampled_labels

    tracing = {"on": False}
    trace = rec["trace"]

    def keep_fwd(name):
        def hook(module, inputs, out):
            if not (tracing["on"] and torch.is_grad_enabled()):
                return
            o = out[0] if isinstance(out, tuple) else out
            trace[f"fwd {name}"] = o.detach().clone()
            if name.startswith("layer0.") and inputs and isinstance(inputs[0], torch.Tensor):
                trace[f"fwd {name} (input)"] = inputs[0].detach().clone()
            if o.requires_grad:
                o.register_hook(lambda g: trace.__setitem__(f"bwd d/d {name}", g.detach().clone()))

        return hook

    if args.trace:
        layers = model.model.layers
        for n, m in layers[0].named_modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(keep_fwd(f"layer0.{n}"))
        for i, layer in enumerate(layers):
            layer.register_forward_hook(keep_fwd(f"layer{i}"))
        model.model.norm.register_forward_hook(keep_fwd("final_norm"))
        model.lm_head.register_forward_hook(keep_fwd("logits"))

    orig_loss = S._SearchTrainer.compute_loss

    def compute_loss(self, model, inputs, *a, **kw):
        tracing["on"] = args.trace and not rec["steps"]
        out = orig_loss(self, model, inputs, *a, **kw)
        loss = out[0] if isinstance(out, tuple) else out
        rec.setdefault("losses", []).append(float(loss.detach()))
        if tracing["on"]:
            trace["fwd loss"] = loss.detach().clone().reshape(1)
            trace["batch input_ids"] = inputs["input_ids"].clone()
        return out

    S._SearchTrainer.compute_loss = compute_loss

    orig_step = S.BregmanOptimizer.step
    last = {"t": None}

    def step(self, closure=None):
        tracing["on"] = False
        keys = [f"{i}.{k}" for i, k in self.keys]
        params = [p for g in self.param_groups for p in g["params"]]
        grads = {
            k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for k, p in zip(keys, params)
        }
        out = orig_step(self, closure)
        now = time.perf_counter()
        if last["t"] is not None:
            rec["step_seconds"].append(now - last["t"])
        last["t"] = now
        rec["steps"].append({
            "loss": rec["losses"][-1],
            "grad": grads,
            "mask": {k: p.detach().clone() for k, p in zip(keys, params)},
            "z": {k: self.state[p]["z"].clone() for k, p in zip(keys, params)},
        })  # fmt: skip
        print(f"step {len(rec['steps'])} loss {rec['losses'][-1]!r} density {self.density():.4f}", flush=True)
        return out

    S.BregmanOptimizer.step = step

    def on_step_end(self, a, state, control, **kw):
        if state.global_step >= args.steps:
            control.should_training_stop = True

    S._PathCallback.on_step_end = on_step_end

    t1 = time.perf_counter()
    path = search_solution_path(model, SPPConfig(), ids)
    rec["search_seconds"] = time.perf_counter() - t1
    rec["nu"] = dict(path.meta["nu"])
    if args.save_path:
        path.save_pretrained(args.save_path, overwrite=True)
    rec["entry"] = {f"{i}.{k}": st["entry"].clone() for (i, k), st in path.stats.items()}
    spec = get_spec(model)
    rec["widths"], rec["kept"] = {}, {}
    for r in args.ratios:
        keep, _ = extract_keep(path, model, spec, SPPConfig(pruning_ratio=r).for_architecture(spec))
        rec["widths"][r] = {i: len(per["mlp"]) for i, per in sorted(keep.items()) if "mlp" in per}
        rec["kept"][r] = {i: per.get("mlp") for i, per in sorted(keep.items())}
    print("widths", rec["widths"], flush=True)
    print(f"search {rec['search_seconds']:.1f} s; per step (median) "
          f"{sorted(rec['step_seconds'])[len(rec['step_seconds']) // 2] if rec['step_seconds'] else float('nan'):.2f} s")  # fmt: skip
    if args.out:
        torch.save(rec, args.out)


def extract(args) -> None:
    """Prune a fresh copy of SmolLM2 at every ratio from the saved path `args.extract` (default refit, the same 32 x
    512 calibration ids); record every pruned tensor and the perplexity of the test split's texts."""
    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    import torch

    if args.set_threads is not None:
        torch.set_num_threads(args.set_threads)
    env["set_threads"], env["torch_threads"] = args.set_threads, torch.get_num_threads()
    sys.path.insert(0, str(Path(__file__).parent))
    import harness

    from optimum_prune import AutoPruner
    from optimum_prune.methods.spp import SPPConfig
    from optimum_prune.samples import SMOLLM2_GGUF_FILE, smollm2_dir

    print("env", env, flush=True)
    rec: dict = {"env": env, "extract": {}}
    protocol = harness.Protocol(split="test", seed=0)
    for r in args.ratios:
        pruner = AutoPruner.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF_FILE, torch_dtype="float32")
        ids = protocol.calibration_ids(pruner.tokenizer, args.samples, args.seq_len, seed=args.calib_seed)
        t0 = time.perf_counter()
        pruner.prune(SPPConfig(pruning_ratio=r, solution_path=args.extract), calibration=ids)
        seconds = time.perf_counter() - t0
        model = pruner.model.eval()
        ppl = {}
        for corpus in ("bbc", "python_docs", "kjv"):
            ppl[corpus] = harness.score_documents(
                model, pruner.tokenizer, protocol.texts(corpus, args.eval_tokens), seq_len=512,
                max_tokens=args.eval_tokens,
            ).perplexity  # fmt: skip
        sd = {k: v.detach().clone() for k, v in model.state_dict().items() if "layers." in k}
        rec["extract"][r] = {"ppl": ppl, "state": sd, "seconds": seconds}
        print(f"ratio {r}: {seconds:.1f} s, perplexity {ppl}", flush=True)
        del pruner, model
    if args.out:
        torch.save(rec, args.out)


def compare_extract(A, B) -> None:
    for r in A["extract"]:
        a, b = A["extract"][r], B["extract"][r]
        print(f"ratio {r}: perplexity A {a['ppl']}\n           B {b['ppl']}")
        shapes = [k for k in a["state"] if a["state"][k].shape != b["state"][k].shape]
        print(f"   tensors with different shapes: {len(shapes)} {shapes[:6]}")
        differ = [k for k in a["state"] if k not in shapes and not torch_equal(a["state"][k], b["state"][k])]
        print(f"   same-shape tensors that differ: {len(differ)} of {len(a['state'])}")
        for k in differ[:8]:
            print(f"      {k}: {_diff(a['state'][k], b['state'][k])}")


def torch_equal(x, y) -> bool:
    import torch

    return torch.equal(x, y)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.compare:
        compare(*args.compare)
        return
    extract(args) if args.extract else probe(args)


if __name__ == "__main__":
    main()
