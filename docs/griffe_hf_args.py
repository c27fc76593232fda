"""Griffe extension for the API reference: the docstrings' `Args:` blocks are in the Hugging Face style.

An entry reads `name (`type`, defaults to `value`): meaning`, and related fields are often documented together
(`lora_alpha / lora_dropout: ...`). A Google-style parser would split that into a name / type / default table and
garble the combined entries; this extension renders each `Args:` (and `Raises:`) block as a Markdown list instead, the names in bold,
the rest as written (the signature above it gives the types and defaults).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADER = re.compile(r"^(?P<indent>\s*)(?P<title>Args|Arguments|Parameters|Raises):\s*$")
_TITLES = {"Raises": "Raises"}
_NAME = re.compile(r"(^|/ )(\w+)(?= \(|:| /|,)")


def hf_args_to_markdown(text: str) -> str:
    """Every `Args:` (and `Raises:`) block of `text` as a titled Markdown list; the rest of `text` unchanged."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        header = _HEADER.match(lines[i])
        if not header:
            out.append(lines[i])
            i += 1
            continue
        base = len(header["indent"])
        out += ["", f"{header['indent']}**{_TITLES.get(header['title'], 'Arguments')}:**", ""]
        i += 1
        entry_indent = None
        while i < len(lines):
            line = lines[i]
            indent = len(line) - len(line.lstrip())
            if line.strip() and (indent <= base or (entry_indent is not None and indent < entry_indent)):
                break
            if line.strip() and entry_indent is None:
                entry_indent = indent
            if line.strip() and indent == entry_indent:
                out.append(" " * base + "- " + _NAME.sub(r"\1**\2**", line.strip(), count=3))
            elif line.strip():
                out.append(" " * (base + 2) + line.strip())
            i += 1
        out.append("")
    return "\n".join(out)


class HFArgs(griffe.Extension):
    """Rewrites each object's docstring when it is loaded, before any parsing."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = hf_args_to_markdown(obj.docstring.value)
