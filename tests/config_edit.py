"""Edit a preset's config.json dict by `section__field=value` paths (the config-validation tests)."""

from __future__ import annotations

from openk3 import K3Config


def edited_preset(preset: str = "tiny", **changes) -> dict:
    """K3Config.preset(preset).to_dict() with each `a__b__c=value` set at data[a][b][c]."""
    data = K3Config.preset(preset).to_dict()
    for path, value in changes.items():
        node = data
        *parents, leaf = path.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return data
