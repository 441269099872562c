"""openk3: the Kimi K3 system as one readable PyTorch package.

Users need two names: `K3Config` (the released config.json as dataclasses, plus presets) and `K3ForCausalLM`
(the model, checkpoint-compatible with the release).
"""

from openk3.config import K3Config
from openk3.model.model import K3ForCausalLM

__all__ = ["K3Config", "K3ForCausalLM"]
__version__ = "0.1.0"
