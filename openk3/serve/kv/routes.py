"""Routed experts per token, for routing replay in training (docs/rl.md): a pool aligned with the MLA pages,
and the MoE observer that fills it during a forward.

`RoutesPool.routes_NBMk[page, offset]` holds, for the token whose latent lives at (page, offset), the experts every
MoE layer chose for it (ascending expert ids, as the router returns them). Because the pool is indexed like the MLA
latent pool, whatever restores a latent restores its routes: a prefix hit's shared pages carry them, copy-on-write
copies them with the latents (`copy_unit`), and a finished request reads the routes of every position it fed
(`read`). A verify pass writes rows for its draft positions too; a rejected position lies past the request's computed
length, is never read, and is overwritten when the real token there is fed.

`record_routes(moe_layers)` installs an observer on each MoE layer for one forward (chained after any observer
already set, restored afterwards) and yields the per-layer lists it fills.

Legend: NB pages, B tokens per page, M MoE layers (layer order; dense layers have none), k experts per token,
T packed tokens of one forward, P positions of one request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from openk3.model.moe import StableLatentMoE

ROUTE_DTYPE = torch.int16  # expert ids; K3 has 896 experts
POISON = -1  # the value of a freed or never-written row


def moe_layers(model: nn.Module) -> list[StableLatentMoE]:
    """The model's MoE layers in layer order (module registration order)."""
    return [m for m in model.modules() if isinstance(m, StableLatentMoE)]


def num_moe_layers(text_config) -> int:
    return sum(text_config.ffn_kind(i) == "moe" for i in range(text_config.num_hidden_layers))


class RoutesPool:
    def __init__(self, num_blocks: int, block_size: int, num_layers: int, top_k: int, device):
        self.block_size, self.num_layers, self.top_k = block_size, num_layers, top_k
        with torch.inference_mode(False):  # a normal tensor, writable in any mode (as the other pools)
            self.routes_NBMk = torch.full((num_blocks, block_size, num_layers, top_k), POISON, dtype=ROUTE_DTYPE,
                                          device=device)  # fmt: skip

    def nbytes(self) -> int:
        return self.routes_NBMk.numel() * self.routes_NBMk.element_size()

    def token_index(self, block_ids: list[int], start: int, num: int) -> torch.Tensor:
        """Flat row index [num] (page * B + offset) of positions [start, start + num) through a page table."""
        pos = torch.arange(start, start + num)
        pages = torch.tensor(block_ids, dtype=torch.long)[pos // self.block_size]
        return (pages * self.block_size + pos % self.block_size).to(self.routes_NBMk.device)

    def write(self, index_T: torch.Tensor, idx_MTk: list[torch.Tensor]) -> None:
        """Store each MoE layer's choices [T, k] for the packed tokens at rows `index_T`."""
        flat = self.routes_NBMk.view(-1, self.num_layers, self.top_k)
        flat.index_copy_(0, index_T, torch.stack(idx_MTk, 1).to(flat.device, ROUTE_DTYPE))

    def read(self, block_ids: list[int], num: int) -> torch.Tensor:
        """Routes [num, M, k] int16 (CPU) of positions [0, num) of a page table."""
        flat = self.routes_NBMk.view(-1, self.num_layers, self.top_k)
        return flat.index_select(0, self.token_index(block_ids, 0, num)).cpu()

    def copy_unit(self, dst: int, dst_rows: slice, src: int, src_rows: slice) -> None:
        self.routes_NBMk[dst, dst_rows] = self.routes_NBMk[src, src_rows]

    def poison_block(self, block: int) -> None:
        self.routes_NBMk[block] = POISON


@contextlib.contextmanager
def record_routes(layers: list[StableLatentMoE]) -> Iterator[list[list[torch.Tensor]]]:
    """Collect every MoE layer's chosen experts during the body: yields `chosen[m]`, the idx [T, k] tensors layer m
    saw (one per call). Observers already set keep running; they are restored on exit."""
    chosen: list[list[torch.Tensor]] = [[] for _ in layers]
    previous = [layer.observer for layer in layers]

    def observer_for(m: int, prev):
        def observe(module, scores_TE, idx_Tk):
            chosen[m].append(idx_Tk.detach())
            if prev is not None:
                prev(module, scores_TE, idx_Tk)

        return observe

    for m, layer in enumerate(layers):
        layer.observer = observer_for(m, previous[m])
    try:
        yield chosen
    finally:
        for layer, prev in zip(layers, previous):
            layer.observer = prev
