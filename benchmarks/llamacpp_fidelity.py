"""llama.cpp fidelity of the GGUF export: a checkpoint's logits from llama.cpp (through llama-cpp-python) running its
`k3 export --format gguf` file, against openk3's own fp32 forward, as the relative RMS error of STYLE.md §5.

    python benchmarks/llamacpp_fidelity.py --ckpt DIR [--gguf FILE] [--tokens 64] [--seed 0]

`logits_rel_rms` is the reusable piece (benchmarks/cpu.py calls it). The token ids are random below the base
vocabulary (no special ids), one sequence, all in one llama.cpp batch; llama.cpp runs on the CPU with fp32 K/V caches
and without flash attention, so the comparison sees the export and the graph, not cache rounding. llama_cpp is
imported lazily: everything else in openk3 works without it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch

GGML_TYPE_F32 = 0


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as err:
        raise RuntimeError(
            "the llama.cpp comparison needs llama-cpp-python (a build with the kimi-k3 architecture, 0.3.36 or "
            "newer): pip install llama-cpp-python"
        ) from err
    return llama_cpp


def llama_cpp_logits(gguf_path: str, ids: list[int], n_threads: int = 2, verbose: bool = False) -> torch.Tensor:
    """llama.cpp's logits [T, V] (fp32) for the token ids `ids`, evaluated as one sequence in one batch."""
    llama_cpp = _llama_cpp()
    n_ctx = max(256, len(ids))
    llm = llama_cpp.Llama(model_path=os.fspath(gguf_path), logits_all=True, n_ctx=n_ctx, n_batch=n_ctx,
                          n_ubatch=n_ctx, n_threads=n_threads, n_threads_batch=n_threads, flash_attn=False,
                          type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, verbose=verbose)  # fmt: skip
    try:
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    finally:
        llm.close()


def logits_rel_rms(ckpt_dir: str, gguf_path: str | None = None, n_tokens: int = 64, seed: int = 0,
                   n_threads: int = 2, verbose: bool = False) -> dict:  # fmt: skip
    """Compare llama.cpp on `gguf_path` (None: export `ckpt_dir` to a temporary f32 GGUF first) with openk3's fp32
    forward of `ckpt_dir` on `n_tokens` random ids. Returns {"rel_rms": rms(llama - ours) / rms(ours), "max_abs",
    "top1_agree" (fraction of positions with the same argmax), "n_tokens", "seed", "gguf"}."""
    from openk3.data.tokenizer import NUM_SPECIAL_TOKENS, load_tokenizer
    from openk3.export import export_gguf
    from openk3.train.checkpoint import load_model
    from openk3.utils import rel_rms

    _llama_cpp()  # fail before the export if llama.cpp is missing
    model, ckpt = load_model(ckpt_dir, dtype=torch.float32)
    model.eval()
    vocab = model.text_config.vocab_size
    base = vocab - NUM_SPECIAL_TOKENS if vocab > 2 * NUM_SPECIAL_TOKENS else vocab
    ids = torch.randint(0, base, (n_tokens,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours = model(ids[None]).logits[0].float()
    with tempfile.TemporaryDirectory() as tmp:
        path = gguf_path or export_gguf(model, load_tokenizer(ckpt, model.text_config), os.path.join(tmp, "k3.gguf"))
        theirs = llama_cpp_logits(path, ids.tolist(), n_threads, verbose)
    return {
        "rel_rms": rel_rms(theirs, ours),
        "max_abs": float((theirs - ours).abs().max()),
        "top1_agree": float((theirs.argmax(-1) == ours.argmax(-1)).float().mean()),
        "n_tokens": n_tokens,
        "seed": seed,
        "gguf": gguf_path,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="a checkpoint folder (k3 init / k3 train / a release)")
    p.add_argument("--gguf", default=None, help="its GGUF export (default: export to a temporary f32 file)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--verbose", action="store_true", help="llama.cpp's own log")
    args = p.parse_args(argv)
    result = logits_rel_rms(args.ckpt, args.gguf, args.tokens, args.seed, args.threads, args.verbose)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
