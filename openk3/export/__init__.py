"""Exports of a K3 model: `export_release` (the release's safetensors format and dtypes, with the tokenizer files)
and `export_gguf` (llama.cpp's `kimi-k3` GGUF). Only the CLI imports this package."""

from openk3.export.gguf import GGUFExportError, export_gguf
from openk3.export.release import export_release

__all__ = ["GGUFExportError", "export_gguf", "export_release"]
