"""Writing a benchmark's results: `write_report` puts OUT.json (the numbers) and OUT.md (the table) side by side."""

from __future__ import annotations

import json
import os


def write_report(report: dict, out_prefix: str, markdown: str) -> None:
    """Write `out_prefix`.json and `out_prefix`.md (creating the folder), then print the markdown."""
    os.makedirs(os.path.dirname(out_prefix) or ".", exist_ok=True)
    with open(out_prefix + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    with open(out_prefix + ".md", "w", encoding="utf-8") as f:
        f.write(markdown)
    print(markdown)
