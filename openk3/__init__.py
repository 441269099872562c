"""openk3: the Kimi K3 system as one readable PyTorch package.

Users need three names: `K3Config` (the released config.json as dataclasses, plus presets), `K3ForCausalLM` (the
model, checkpoint-compatible with the release) and `load_tokenizer` (a checkpoint's tokenizer: the release's tiktoken
files, our BPE, or the byte fallback); `K3ForConditionalGeneration` is the model with its vision tower (images in).
"""

from openk3.threads import default_omp_wait_policy

# Before torch loads OpenMP: threads that finish early spin briefly, then sleep, instead of holding a core another
# job needs
# (openk3/threads.py says why and how to override).
default_omp_wait_policy()

from openk3.config import K3Config
from openk3.data.tokenizer import load_tokenizer
from openk3.model.model import K3ForCausalLM
from openk3.model.multimodal import K3ForConditionalGeneration

__all__ = ["K3Config", "K3ForCausalLM", "K3ForConditionalGeneration", "load_tokenizer"]
__version__ = "0.1.0"
