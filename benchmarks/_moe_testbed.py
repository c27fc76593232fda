"""The mixture-of-experts test bed of `moe.py`: SmolLM2-135M turned into a Mixtral checkpoint that stock transformers
loads (no trained MoE model is available offline).

Each decoder layer keeps its attention and norms; its MLP (1,536 channels) is split into `experts` experts of equal
width (8 × 192 by default, top-4 routing: a token uses half of the MLP): the channels are clustered by co-activation
on calibration text (balanced k-means on each channel's activation profile |silu(g·x)·(u·x)| over the tokens, cosine
similarity), every expert keeps its channels' gate / up rows and down columns, scaled by `top_k` so that equal routing
weights give the sum of the chosen experts. Only the routers are trained, layer by layer on the calibration text (each
layer's inputs from the already converted layers): first toward the set of `top_k` experts whose sum is closest to the
dense MLP's output on each token (cross-entropy on that set; every set is tried while there are at most 5,000, else a
greedy choice refined by swaps), then on the squared error of the routed output itself; tokens are drawn in proportion
to the energy of their dense MLP output (plus a floor), so that the rare tokens with massive activations are routed
right. By default (`moe.py`) the first phase's targets are balanced: each token's best set under the constraint that
every expert is the best choice of a near-even share of the tokens (trained MoE models route in balance). With every
expert chosen (`top_k = experts`) and its output scaled by `experts`, the converted model is the
dense one exactly (checked).
"""

from __future__ import annotations

import itertools
import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM

from optimum_prune.calibration.sequential import LayerwiseRunner
from optimum_prune.modeling.architectures import get_spec

logger = logging.getLogger("benchmarks.moe_testbed")

__all__ = ["mixtral_config", "convert", "build_testbed"]


def mixtral_config(dense_config, experts: int, top_k: int) -> MixtralConfig:
    """The Mixtral config of a Llama-style dense model whose MLP becomes `experts` experts (routing `top_k`)."""
    c = dense_config
    width = c.intermediate_size // experts
    return MixtralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=width,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters), tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
        num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=None, router_jitter_noise=0.0,
    )  # fmt: skip


def balanced_clusters(profiles: torch.Tensor, k: int, iters: int = 25, seed: int = 0) -> list[list[int]]:
    """`k` equal groups of the rows of `profiles` `(C, N)` (C channels' activation profiles), by balanced spherical
    k-means: each iteration assigns the (channel, centroid) pairs in decreasing cosine similarity, a centroid taking
    at most `C / k` channels."""
    C = profiles.shape[0]
    cap = C // k
    X = F.normalize(profiles.double(), dim=1)  # (C, N)
    g = torch.Generator().manual_seed(seed)
    centroids = X[torch.randperm(C, generator=g)[:k]]  # (k, N)
    assign = torch.full((C,), -1, dtype=torch.long)
    for _ in range(iters):
        sim = X @ centroids.T  # (C, k)
        order = torch.argsort(sim.reshape(-1), descending=True)
        new, load = [-1] * C, [0] * k  # plain lists: this loop visits C·k pairs
        for flat in order.tolist():
            c, j = divmod(flat, k)
            if new[c] < 0 and load[j] < cap:
                new[c], load[j] = j, load[j] + 1
        new = torch.tensor(new)
        if torch.equal(new, assign):
            break
        assign = new
        centroids = F.normalize(torch.stack([X[assign == j].mean(0) for j in range(k)]), dim=1)
    return [sorted((assign == j).nonzero()[:, 0].tolist()) for j in range(k)]


def _copy_shared(dense, moe) -> None:
    """Embeddings, final norm, head and every layer's attention and norms (identical module names)."""
    moe_sd = moe.state_dict()
    with torch.no_grad():
        for name, t in dense.state_dict().items():
            if ".mlp." not in name and name in moe_sd:
                moe_sd[name].copy_(t)


def _split_mlp(dense_mlp, experts_module, clusters: list[list[int]], scale: float) -> None:
    """Expert j = the dense MLP restricted to channels `clusters[j]`, its output scaled by `scale`."""
    with torch.no_grad():
        for j, chans in enumerate(clusters):
            idx = torch.as_tensor(chans)
            gate, up = dense_mlp.gate_proj.weight[idx], dense_mlp.up_proj.weight[idx]  # (w, H) each
            experts_module.gate_up_proj[j].copy_(torch.cat([gate, up]))
            experts_module.down_proj[j].copy_(scale * dense_mlp.down_proj.weight[:, idx])


def _activation_profiles(dense_mlp, x: torch.Tensor, tokens: int) -> torch.Tensor:
    """`(I, tokens)` |channel activations| of the dense MLP on (a sample of) its inputs `x (N, H)`."""
    sub = x[torch.linspace(0, x.shape[0] - 1, min(tokens, x.shape[0])).long()]
    with torch.no_grad():
        a = F.silu(dense_mlp.gate_proj(sub)) * dense_mlp.up_proj(sub)  # (n, I)
    return a.abs().T


def _expert_outputs(experts_module, x: torch.Tensor, top_k: int) -> torch.Tensor:
    """`(N, E, H)` every expert's output on `x (N, H)`, divided by the `top_k` scale (the dense MLP's share)."""
    E = experts_module.gate_up_proj.shape[0]
    outs = []
    with torch.no_grad():
        for j in range(E):
            gu = x @ experts_module.gate_up_proj[j].T
            gate, up = gu.chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ experts_module.down_proj[j].T / top_k)
    return torch.stack(outs, dim=1)


def _set_errors(f: torch.Tensor, y: torch.Tensor, combos: torch.Tensor) -> torch.Tensor:
    """`(N, P)` the squared error of each token's dense output `y (N, H)` against the summed shares `f (N, E, H)` of
    each expert set `combos (P, k)`."""
    return torch.stack([(y - f[:, c].sum(1)).pow(2).sum(-1) for c in combos], dim=1)


def _best_sets(f: torch.Tensor, y: torch.Tensor, top_k: int, exhaustive: int = 5000) -> torch.Tensor:
    """`(N, top_k)` for each token, the experts whose summed outputs are closest to the dense output `y (N, H)`:
    every set of `top_k` when there are at most `exhaustive`, else greedy forward selection refined by swaps."""
    if math.comb(f.shape[1], top_k) > exhaustive:
        return _greedy_sets(f, y, top_k)
    combos = torch.tensor(list(itertools.combinations(range(f.shape[1]), top_k)))  # (P, k)
    return combos[_set_errors(f, y, combos).argmin(1)]


def _greedy_sets(
    f: torch.Tensor, y: torch.Tensor, top_k: int, swaps: int = 2, price: torch.Tensor | None = None
) -> torch.Tensor:
    """`_best_sets` by greedy forward selection (each step adds the expert that lowers the residual most), then
    `swaps` passes that replace a chosen expert by an unchosen one wherever that lowers the error; `price (E,)`, when
    given, is added to the error for each chosen expert (`_balanced_sets`)."""
    N, E, _ = f.shape
    price = torch.zeros(E, dtype=f.dtype) if price is None else price.to(f.dtype)
    rows = torch.arange(N)
    chosen = torch.zeros(N, E, dtype=torch.bool)
    resid = y.clone()
    for _ in range(top_k):
        err = ((resid[:, None] - f).pow(2).sum(-1) + price).masked_fill(chosen, math.inf)  # (N, E)
        j = err.argmin(-1)
        chosen[rows, j] = True
        resid -= f[rows, j]
    for _ in range(swaps):
        for out in range(E):
            has = chosen[:, out]
            if not has.any():
                continue
            base = resid[has] + f[has, out]  # the residual without `out`
            err = ((base[:, None] - f[has]).pow(2).sum(-1) + price).masked_fill(chosen[has], math.inf)  # (n, E)
            err[:, out] = resid[has].pow(2).sum(-1) + price[out]  # keeping `out`
            j = err.argmin(-1)
            idx = has.nonzero().squeeze(1)
            moved = j != out
            chosen[idx[moved], out] = False
            chosen[idx[moved], j[moved]] = True
            resid[idx] = base - f[idx, j]
    return chosen.nonzero()[:, 1].view(N, top_k)


def _balanced_sets(
    f: torch.Tensor, y: torch.Tensor, top_k: int, band: float, iters: int = 400, exhaustive: int = 5000
) -> torch.Tensor:
    """`(N, top_k)` the best sets under the constraint that every expert serves between
    `top_k / E - band` and `top_k / E + band` of the tokens, by Lagrangian relaxation: each expert has a price added to
    the error of every set that uses it, raised while it serves too many tokens and lowered while too few (a decaying
    subgradient step), so the tokens that move are those whose error grows least. Returns the feasible iterate of
    least total error (or, when none is, the least unbalanced one)."""
    N, E, _ = f.shape
    even = top_k / E
    step0 = float(y.pow(2).sum(-1).median())  # prices in the units of a typical token's squared error
    price = torch.zeros(E, dtype=f.dtype)
    combos = None
    if math.comb(E, top_k) <= exhaustive:  # the errors once; each iteration is then an argmin
        combos = torch.tensor(list(itertools.combinations(range(E), top_k)))
        err = _set_errors(f, y, combos)
    best, best_key = None, None
    for t in range(iters):
        if combos is not None:
            pick = (err + price[combos].sum(1)).argmin(1)
            sets, total = combos[pick], float(err.gather(1, pick[:, None]).sum())
        else:
            sets = _greedy_sets(f, y, top_k, price=price)
            total = float((y - f.gather(1, sets[..., None].expand(-1, -1, f.shape[-1])).sum(1)).pow(2).sum())
        share = torch.bincount(sets.flatten(), minlength=E).to(f.dtype) / N
        off = float((share - even).abs().max())
        key = (max(off - band, 0.0), total)  # feasibility first, then the error
        if best_key is None or key < best_key:
            best, best_key = sets, key
        if off <= band and t > 0:
            break
        price = price + step0 / math.sqrt(t + 1) * (share - even)
    return best


def train_router(router_weight: torch.Tensor, x, f, y, top_k: int, settings: dict[str, Any]) -> dict[str, float]:
    """Fit the router `(E, H)` on inputs `x (N, H)`, expert shares `f (N, E, H)` and dense outputs `y (N, H)`.

    Tokens are drawn in proportion to `1 + ‖y‖² / mean ‖y‖²`: the few tokens whose MLP output is orders of magnitude
    larger than the rest (a model's massive activations) dominate the layer's error and must be routed right.
    `settings["balance"]` (default 0) weighs the Switch Transformer's load-balancing loss `E · Σ_j f_j · P_j` (f_j:
    the share of routed slots expert j takes in the batch, P_j: its mean router probability) in both phases, as MoE
    models are trained with one: without it some experts take nearly every token and others none.
    `settings["band"]` (default 0: off) makes the first phase's targets themselves balanced (`_balanced_sets`: every
    expert the best choice of `top_k / E ± band` of the tokens); the loss above can be added to it (`moe.py`'s bed
    uses both)."""
    g = torch.Generator().manual_seed(settings.get("seed", 0))
    if settings.get("band"):
        target = _balanced_sets(f, y, top_k, settings["band"])  # (N, k)
    else:
        target = _best_sets(f, y, top_k)  # (N, k)
    soft = torch.zeros(x.shape[0], f.shape[1]).scatter_(1, target, 1.0 / top_k)  # (N, E)
    energy = y.pow(2).sum(-1)  # (N,)
    draw = 1 + energy / energy.mean()  # (N,) sampling weights
    W = torch.nn.Parameter(router_weight.detach().clone().normal_(0, 1e-3, generator=g))
    opt = torch.optim.Adam([W], lr=settings["lr"])
    N, bs = x.shape[0], settings["batch"]
    for step in range(settings["steps"] + settings["mse_steps"]):
        rows = torch.multinomial(draw, bs, replacement=True, generator=g)
        logits = x[rows] @ W.T  # (bs, E)
        if step < settings["steps"]:
            loss = -(soft[rows] * logits.log_softmax(-1)).sum(-1).mean()
        else:  # the routed output itself: top-k of the softmax, renormalised (Mixtral's routing), per drawn weight
            val, idx = logits.softmax(-1).topk(top_k, dim=-1)
            w = val / val.sum(-1, keepdim=True)  # (bs, k)
            out = top_k * (w[..., None] * f[rows[:, None], idx]).sum(1)  # (bs, H)
            loss = ((out - y[rows]).pow(2).sum(-1) / draw[rows]).mean() / energy.mean()
        if settings.get("balance", 0.0):
            E = logits.shape[-1]
            share = torch.bincount(logits.topk(top_k, dim=-1).indices.flatten(), minlength=E).float() / (bs * top_k)
            loss = loss + settings["balance"] * E * (share * logits.softmax(-1).mean(0)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        router_weight.copy_(W)
        val, idx = (x @ W.T).softmax(-1).topk(top_k, dim=-1)
        out = top_k * ((val / val.sum(-1, keepdim=True))[..., None] * f[torch.arange(N)[:, None], idx]).sum(1)
        err = (out - y).pow(2).sum(-1)  # (N,)
        best = (f.gather(1, target[..., None].expand(-1, -1, f.shape[-1])).sum(1) - y).pow(2).sum(-1)  # (N,)
        hit = (idx.sort(-1).values == target.sort(-1).values).all(-1).float().mean()
        share = torch.bincount(idx.flatten(), minlength=f.shape[1]).double() / N  # tokens routed to each expert
    return {
        "relative_error": float(err.sum() / energy.sum()),
        "best_set_error": float(best.sum() / energy.sum()),
        "median_token_error": float((err / energy.clamp_min(1e-12)).median()),
        "set_accuracy": float(hit),
        "max_expert_share": float(share.max()),
        "min_expert_share": float(share.min()),
    }


def convert(dense, ids: torch.Tensor, experts: int, top_k: int, settings: dict[str, Any], work=None, batch_size=8):
    """The Mixtral model of `dense` (see the module docstring), its routers trained on calibration `ids`; returns
    `(model, per-layer fit records)`. Each converted layer is stored in `work` (a directory) as it is done, and a
    run that finds them there (after a crash) continues after the last one."""
    moe = MixtralForCausalLM(mixtral_config(dense.config, experts, top_k)).to(dense.dtype).eval()
    _copy_shared(dense, moe)
    spec = get_spec(moe)
    runner = LayerwiseRunner(moe, spec, ids, batch_size=batch_size)
    records = []
    for i, (d_layer, m_layer) in enumerate(zip(dense.model.layers, moe.model.layers)):
        done = None if work is None else Path(work) / f"layer{i:03d}.pt"
        if done is not None and done.is_file():
            state = torch.load(done)
            _split_mlp(d_layer.mlp, m_layer.mlp.experts, state["clusters"], float(top_k))
            with torch.no_grad():
                m_layer.mlp.gate.weight.copy_(state["router"])
            records.append(state["record"])
            runner.advance(runner.run_layer(i))
            continue
        seen: list[torch.Tensor] = []
        record = lambda _, x, seen=seen: seen.append(x.reshape(-1, x.shape[-1]))  # noqa: E731
        runner.run_layer(i, observe={"mlp": m_layer.mlp}, callback=record, keep_outputs=False)
        x = torch.cat(seen)  # (N, H) the MoE layer's MLP inputs, on the converted model's stream
        clusters = balanced_clusters(_activation_profiles(d_layer.mlp, x, settings["profile_tokens"]), experts,
                                     seed=settings.get("seed", 0))  # fmt: skip
        _split_mlp(d_layer.mlp, m_layer.mlp.experts, clusters, float(top_k))
        sample = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(i))[: settings["train_tokens"]]]
        del seen, x
        with torch.no_grad():
            y = d_layer.mlp(sample)
        f = _expert_outputs(m_layer.mlp.experts, sample, top_k)
        fit = {"layer": i, **train_router(m_layer.mlp.gate.weight, sample, f, y, top_k, settings)}
        del f, y, sample
        records.append(fit)
        logger.info("layer %d: %s", i, {k: round(v, 4) for k, v in fit.items()})
        if done is not None:
            done.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"clusters": clusters, "router": m_layer.mlp.gate.weight.detach().clone(), "record": fit},
                       done.with_suffix(".tmp"))  # fmt: skip
            done.with_suffix(".tmp").rename(done)
        runner.advance(runner.run_layer(i))
    return moe, records


def build_testbed(dense, ids, experts: int, top_k: int, settings: dict[str, Any], work=None):
    """`convert`, after checking on `ids` that the same split with every expert chosen is the dense model."""
    check = MixtralForCausalLM(mixtral_config(dense.config, experts, experts)).to(dense.dtype).eval()
    _copy_shared(dense, check)
    with torch.no_grad():
        for d_layer, m_layer in zip(dense.model.layers, check.model.layers):
            chans = d_layer.mlp.gate_proj.weight.shape[0] // experts
            _split_mlp(d_layer.mlp, m_layer.mlp.experts, [list(range(j * chans, (j + 1) * chans)) for j in
                                                           range(experts)], float(experts))  # fmt: skip
            m_layer.mlp.gate.weight.zero_()  # equal weights 1/E: the sum of every expert's share
        gap = float((check(ids[:1, :64]).logits - dense(ids[:1, :64]).logits).abs().max())
    if gap > 1e-3:
        raise RuntimeError(f"the Mixtral conversion with every expert differs from the dense model by {gap}")
    model, records = convert(dense, ids, experts, top_k, settings, work)
    return model, records, gap
