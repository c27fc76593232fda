"""The Hugging Face tokenizer, written into a GGUF file so that llama.cpp tokenizes exactly as `transformers` does.

Byte-level BPE tokenizers (GPT-2 / Llama-3 / Qwen / SmolLM style, llama.cpp's `gpt2` tokenizer model) are supported:
vocabulary, merges, token types, special token ids, add-BOS / add-EOS, chat template and the pre-tokenizer. llama.cpp
does not read the pre-tokenizer's regex from the file: it knows a fixed set of pre-tokenizers by name, so the name is
chosen by matching the tokenizer's own pre-tokenizer definition (`tokenizer.json`) against the definitions of those
names. A tokenizer that matches none of them is refused (llama.cpp would silently split text differently).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import gguf

__all__ = ["GGUFTokenizerError", "write_tokenizer", "tokenizer_metadata"]

logger = logging.getLogger(__name__)

_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's `gpt2`-model pre-tokenizers, as the steps of a `tokenizer.json` pre-tokenizer (see `_steps`), in
# llama.cpp's name. `smollm` and `starcoder` split the same way; they differ in whether decoding cleans up spaces.
_PRE_TOKENIZERS: list[tuple[tuple[str, ...], str]] = [
    (("bytelevel:regex",), "gpt-2"),
    (("digits:individual", "bytelevel:regex"), "smollm"),
    ((f"split:{_LLAMA3_RE}", "bytelevel"), "llama-bpe"),
    ((f"split:{_QWEN2_RE}", "bytelevel"), "qwen2"),
]


class GGUFTokenizerError(ValueError):
    """The tokenizer cannot be written so that llama.cpp reproduces it exactly (raised before anything is written)."""


def _steps(pre: dict[str, Any] | None) -> tuple[str, ...]:
    """A pre-tokenizer definition as comparable steps; raises `GGUFTokenizerError` for a step llama.cpp cannot do."""
    if pre is None:
        raise GGUFTokenizerError("The tokenizer has no pre-tokenizer; llama.cpp's BPE needs a known one.")
    items = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
    out = []
    for p in items:
        kind = p.get("type")
        if kind == "ByteLevel":
            if p.get("add_prefix_space"):
                raise GGUFTokenizerError("A ByteLevel pre-tokenizer with add_prefix_space=True has no llama.cpp form.")
            out.append("bytelevel:regex" if p.get("use_regex", True) else "bytelevel")
        elif kind == "Digits":
            out.append("digits:individual" if p.get("individual_digits") else "digits")
        elif kind == "Split":
            pattern = p.get("pattern", {})
            regex = pattern.get("Regex", pattern.get("String"))
            if p.get("behavior") != "Isolated" or p.get("invert"):
                raise GGUFTokenizerError(f"Split pre-tokenizer with behavior {p.get('behavior')!r} is not supported.")
            out.append(f"split:{regex}")
        else:
            raise GGUFTokenizerError(f"Pre-tokenizer step {kind!r} has no llama.cpp equivalent.")
    return tuple(out)


def _pre_name(tokenizer: Any, data: dict[str, Any]) -> str:
    steps = _steps(data.get("pre_tokenizer"))
    for known, name in _PRE_TOKENIZERS:
        if steps == known:
            if name == "smollm" and getattr(tokenizer, "clean_up_tokenization_spaces", False):
                return "starcoder"
            return name
    raise GGUFTokenizerError(
        f"The tokenizer's pre-tokenizer {list(steps)} is not one llama.cpp implements "
        f"(known: {', '.join(n for _, n in _PRE_TOKENIZERS)}); llama.cpp would split text differently from "
        "transformers. Convert the saved checkpoint with llama.cpp's convert_hf_to_gguf.py instead."
    )


def _backend_json(tokenizer: Any) -> dict[str, Any]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GGUFTokenizerError(
            f"{type(tokenizer).__name__} is not a fast (tokenizers) tokenizer; GGUF export needs its tokenizer.json. "
            "Load it with AutoTokenizer.from_pretrained(..., use_fast=True)."
        )
    return json.loads(backend.to_str())


def _looks_special(text: str) -> bool:
    """llama.cpp's converter marks these added tokens as control tokens even when they are not flagged special."""
    return (text.startswith("<|") and text.endswith("|>")) or text in ("<pad>", "<mask>")


def _encodes_with(tokenizer: Any, token_id: int | None, position: int) -> bool:
    if token_id is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return len(with_special) > len(plain) and with_special[position] == token_id


def tokenizer_metadata(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """Everything `write_tokenizer` writes, as plain Python values (checked; nothing written yet).

    Args:
        tokenizer: a fast Hugging Face tokenizer.
        vocab_size (`int`): rows of the model's embedding; ids the tokenizer does not use become `[PAD<i>]` tokens.

    Raises:
        `GGUFTokenizerError` when llama.cpp could not reproduce the tokenizer exactly.
    """
    data = _backend_json(tokenizer)
    model = data.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise GGUFTokenizerError(
            f"Only byte-level BPE tokenizers are exported to GGUF (this one is {model.get('type')!r}"
            f"{', byte-fallback / SentencePiece-style' if model.get('byte_fallback') else ''}). Convert the saved "
            "checkpoint with llama.cpp's convert_hf_to_gguf.py instead."
        )
    if data.get("normalizer") not in (None, {"type": "NFC"}):
        raise GGUFTokenizerError(f"The tokenizer's normalizer {data['normalizer']} has no llama.cpp equivalent.")
    pre = _pre_name(tokenizer, data)
    if bool(model.get("ignore_merges")) != (pre == "llama-bpe"):
        raise GGUFTokenizerError(f"ignore_merges={model.get('ignore_merges')} does not match llama.cpp's {pre!r}.")
    vocab: dict[str, int] = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise GGUFTokenizerError(
            f"The tokenizer has token id {max(vocab.values())} but the model's embedding has {vocab_size} rows."
        )
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    reverse = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(added[i]["content"])
            special = added[i].get("special") or _looks_special(added[i]["content"])
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    specials = {
        name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "unk", "pad", "sep", "mask")
    }
    template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else None
    return {
        "pre": pre,
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "special_ids": {k: v for k, v in specials.items() if v is not None},
        "add_bos": _encodes_with(tokenizer, specials["bos"], 0),
        "add_eos": _encodes_with(tokenizer, specials["eos"], -1),
        "chat_template": template,
    }


def write_tokenizer(writer: gguf.GGUFWriter, meta: dict[str, Any]) -> None:
    """Write `tokenizer_metadata(...)` into a GGUF writer."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["types"])
    writer.add_token_merges(meta["merges"])
    for name, token_id in meta["special_ids"].items():
        getattr(writer, f"add_{name}_token_id")(token_id)
    writer.add_add_bos_token(meta["add_bos"])
    writer.add_add_eos_token(meta["add_eos"])
    if meta["chat_template"]:
        writer.add_chat_template(meta["chat_template"])
    logger.info(
        "tokenizer: %d tokens, %d merges, pre-tokenizer %r", len(meta["tokens"]), len(meta["merges"]), meta["pre"]
    )
