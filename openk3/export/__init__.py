"""Exports of a K3 model into other runtimes' formats: `export_gguf` (llama.cpp's `kimi-k3` GGUF). Only the CLI
imports this package; the release-format safetensors export is `K3ForCausalLM.save_pretrained`."""

from openk3.export.gguf import GGUFExportError, export_gguf

__all__ = ["GGUFExportError", "export_gguf"]
