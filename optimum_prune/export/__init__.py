"""Export to deployment formats: GGUF for llama.cpp (and Ollama / LM Studio, which embed it)."""

from .gguf import GGUFExportError, export_gguf, gguf_layout
from .gguf_tokenizer import GGUFTokenizerError

__all__ = ["GGUFExportError", "GGUFTokenizerError", "export_gguf", "gguf_layout"]
