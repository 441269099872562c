"""ModelRunner: turns a step's work into one packed `ForwardBatch` over the paged cache and runs the model.

The batch packs every sequence's new tokens back to back (cu_seqlens); the cache is a `PagedCache` whose views
read and write the pools at each request's slot and page table. Only the rows that are sampled go through the LM
head: the last row of a chunk that reaches the end of its request's tokens, or every row of a verify pass.

Image rows: a forward whose tokens cover any of a request's image positions (`Request.images`, absolute prompt
positions, so a chunk may hold part of an image and a recompute after preemption re-applies them) runs on
`embeds_TD` = the token embeddings with those rows replaced by the image's projector rows; a forward covering none
(every decode, every verify) runs on the ids as before.

Legend: N sequences, T packed tokens, D hidden, V vocabulary, G tokens per verified sequence (1 + drafts).
"""

from __future__ import annotations

import torch

from openk3.model.batch import ForwardBatch, Mode
from openk3.model.model import K3ForCausalLM
from openk3.serve.kv.manager import KVCacheManager
from openk3.serve.request import Request


class ModelRunner:
    def __init__(self, model: K3ForCausalLM, manager: KVCacheManager):
        self.model, self.manager = model, manager
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def run(self, reqs: list[Request], ids: list[list[int]], rows: list[list[int]], verify: bool = False):
        """Feed `ids[i]` to request i (continuing at its num_computed); return fp32 logits of the requested
        `rows[i]` (indices into ids[i]) as one [sum rows, V] tensor, and the verify records (verify only)."""
        lengths = [len(x) for x in ids]
        cache = self.manager.view(reqs, lengths, verify)
        flat = torch.tensor([t for x in ids for t in x], dtype=torch.long, device=self.device)
        batch = ForwardBatch.from_lengths(flat, lengths, cache, mode=Mode.VERIFY if verify else None)
        hidden_TD = self.model.hidden_states(batch, self._image_embeds(reqs, lengths, flat))
        offsets = batch.cu_seqlens[:-1].tolist()
        pick = torch.tensor([o + r for o, rs in zip(offsets, rows) for r in rs], dtype=torch.long, device=self.device)
        logits = self.model.logits(hidden_TD, pick).float()
        return logits, cache.records

    def _image_embeds(self, reqs: list[Request], lengths: list[int], flat_T: torch.Tensor) -> torch.Tensor | None:
        """Token embeddings [T, D] with the image rows this forward covers put in place; None when it covers none."""
        pieces = []  # (packed row, image rows [n, D])
        offset = 0
        for req, n in zip(reqs, lengths):
            lo, hi = req.num_computed, req.num_computed + n
            for im in req.images:
                a, b = max(lo, im.start), min(hi, im.end)
                if a < b:
                    pieces.append((offset + a - lo, im.rows_ND[a - im.start : b - im.start]))
            offset += n
        if not pieces:
            return None
        embeds_TD = self.model.model.embed_tokens(flat_T)
        for row, rows_nD in pieces:
            embeds_TD[row : row + rows_nD.shape[0]] = rows_nD.to(embeds_TD.dtype)
        return embeds_TD
