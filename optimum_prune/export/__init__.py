"""Export to deployment formats: GGUF for llama.cpp (and Ollama / LM Studio, which embed it)."""

from .gguf import GGUFExportError, export_gguf, gguf_layout
from .gguf_tokenizer import GGUFTokenizerError
from .llamacpp_runtime import LlamaCppRuntime

__all__ = ["GGUFExportError", "GGUFTokenizerError", "LlamaCppRuntime", "export_gguf", "gguf_layout"]
