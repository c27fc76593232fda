"""Run inside vLLM's own environment (no optimum-prune there): load a DeciLM folder with vLLM's model code and write
the log-probability vLLM gives every prompt token, as JSON.

    /path/to/vllm-venv/bin/python benchmarks/_vllm_worker.py REQUEST.json RESPONSE.json

REQUEST: `{"model": folder, "prompts": [[token ids], ...], "dtype": "float32", "max_model_len": 1024}`.
RESPONSE: `{"ok": true, "vllm": version, "logprobs": [[logprob of token t given the tokens before it, ...], ...],
"num_kv_heads": ..., "seconds": ...}` or `{"ok": false, "error": "..."}`.
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def main() -> None:
    request = json.loads(open(sys.argv[1], encoding="utf-8").read())
    out: dict = {"ok": False}
    t0 = time.perf_counter()
    try:
        import vllm
        from vllm import LLM, SamplingParams, TokensPrompt

        out["vllm"] = vllm.__version__
        llm = LLM(model=request["model"], trust_remote_code=True, dtype=request.get("dtype", "float32"),
                  max_model_len=request.get("max_model_len", 1024), enforce_eager=True)  # fmt: skip
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
        results = llm.generate(prompts, params, use_tqdm=False)
        logprobs = []
        for prompt, res in zip(request["prompts"], results):
            row = []
            for t, entry in enumerate(res.prompt_logprobs or []):
                if t == 0 or entry is None:
                    continue
                row.append(float(entry[prompt[t]].logprob))
            logprobs.append(row)
        out.update(ok=True, logprobs=logprobs)
        try:
            out["num_kv_heads"] = llm.llm_engine.model_config.get_total_num_kv_heads()
        except Exception:  # noqa: BLE001 - a diagnostic only
            pass
    except Exception as e:  # noqa: BLE001 - the caller records why vLLM refused the folder
        out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
    out["seconds"] = time.perf_counter() - t0
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
