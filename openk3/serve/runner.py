"""ModelRunner: turns a step's work into one packed `ForwardBatch` over the paged cache and runs the model.

The batch packs every sequence's new tokens back to back (cu_seqlens); the cache is a `PagedCache` whose views
read and write the pools at each request's slot and page table. Only the rows that are sampled go through the LM
head: the last row of a chunk that reaches the end of its request's tokens, or every row of a verify pass.

Image rows: a forward whose tokens cover any of a request's image positions (`Request.images`, absolute prompt
positions, so a chunk may hold part of an image and a recompute after preemption re-applies them) runs on
`embeds_TD` = the token embeddings with those rows replaced by the image's projector rows; a forward covering none
(every decode, every verify) runs on the ids as before.

`load_weights` copies new weights into the model in place (the engine's `update_weights`).

Routed experts (`record_routed_experts`): the forward runs under `record_routes` (an observer on every MoE layer,
chained and restored), and each fed token's choices are written to the routes pool at its (page, offset), verify
draft positions included (a rejected one is past the request's computed length and is overwritten when fed).

Legend: N sequences, T packed tokens, D hidden, V vocabulary, G tokens per verified sequence (1 + drafts).
"""

from __future__ import annotations

import torch

from openk3.model.batch import ForwardBatch, Mode
from openk3.model.model import K3ForCausalLM
from openk3.serve.kv.manager import KVCacheManager
from openk3.serve.kv.routes import moe_layers, record_routes
from openk3.serve.request import Request


class ModelRunner:
    def __init__(self, model: K3ForCausalLM, manager: KVCacheManager):
        self.model, self.manager = model, manager
        self.device = next(model.parameters()).device
        self.moe_layers = moe_layers(model) if manager.routes is not None else []
        assert manager.routes is None or len(self.moe_layers) == manager.routes.num_layers

    @torch.inference_mode()
    def run(self, reqs: list[Request], ids: list[list[int]], rows: list[list[int]], verify: bool = False):
        """Feed `ids[i]` to request i (continuing at its num_computed); return fp32 logits of the requested
        `rows[i]` (indices into ids[i]) as one [sum rows, V] tensor, and the verify records (verify only)."""
        lengths = [len(x) for x in ids]
        cache = self.manager.view(reqs, lengths, verify)
        flat = torch.tensor([t for x in ids for t in x], dtype=torch.long, device=self.device)
        batch = ForwardBatch.from_lengths(flat, lengths, cache, mode=Mode.VERIFY if verify else None)
        embeds_TD = self._image_embeds(reqs, lengths, flat)
        if self.manager.routes is None:
            hidden_TD = self.model.hidden_states(batch, embeds_TD)
        else:
            with record_routes(self.moe_layers) as chosen:
                hidden_TD = self.model.hidden_states(batch, embeds_TD)
            self._write_routes(reqs, lengths, chosen)
        offsets = batch.cu_seqlens[:-1].tolist()
        pick = torch.tensor([o + r for o, rs in zip(offsets, rows) for r in rs], dtype=torch.long, device=self.device)
        logits = self.model.logits(hidden_TD, pick).float()
        return logits, cache.records

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor] | torch.nn.Module) -> None:
        """Copy a state dict (the model's names) or a model's weights into the model in place, cast to each tensor's
        dtype. Every name and shape is checked first: a missing or unexpected name or a shape mismatch is a
        ValueError naming it, and nothing is copied."""
        if isinstance(weights, torch.nn.Module):
            weights = weights.state_dict()
        target = self.model.state_dict()
        missing, unexpected = sorted(set(target) - set(weights)), sorted(set(weights) - set(target))
        if missing or unexpected:
            raise ValueError(f"the weights lack {len(missing)} of the model's tensors {missing[:8]} and have "
                             f"{len(unexpected)} it does not {unexpected[:8]}")  # fmt: skip
        for name, t in target.items():
            if tuple(weights[name].shape) != tuple(t.shape):
                raise ValueError(
                    f"weight {name} has shape {tuple(weights[name].shape)}; the model's is {tuple(t.shape)}"
                )
        for name, t in target.items():
            t.copy_(weights[name])

    def _write_routes(self, reqs: list[Request], lengths: list[int], chosen: list[list[torch.Tensor]]) -> None:
        """Store each MoE layer's choices [T, k] for the packed tokens at their requests' (page, offset)."""
        routes = self.manager.routes
        assert all(len(calls) == 1 for calls in chosen), "one MoE call per layer per forward"
        index_T = torch.cat([routes.token_index(r.block_ids, r.num_computed, n) for r, n in zip(reqs, lengths)])
        routes.write(index_T, [calls[0] for calls in chosen])

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
