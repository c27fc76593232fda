"""Export to deployment formats: GGUF for llama.cpp (and Ollama / LM Studio, which embed it)."""

from .gguf import GGUFExportError, export_gguf, gguf_layout

__all__ = ["GGUFExportError", "export_gguf", "gguf_layout"]
