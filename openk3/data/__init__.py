"""Tokenizers and data (no model imports)."""
