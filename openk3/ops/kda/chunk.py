"""KDA chunked fast path (CPU): WY/UT form, tiles by batched matmuls, hand-written backward (spec/kda.md §4–§6).

Owns `kda_chunked`, the op the model calls for prefill and training, and the pieces it shares with
`chunk_bf16.kda_chunked_bf16` (the opt-in op with bf16 tile operands): `run_chunked` (checks, tiling, autograd),
`Tiling` and the fp32 backward. It computes the same tile equations as the readable `tile_ref.kda_chunked_tiles`
(and matches `ref.kda_recurrent` to fp32 rounding), organised for speed:

    per tile of C rows (C = chunk_size = 16), anchored at the entering state h (cumsum restarts at the tile):
    Γ = cumsum(g)   Qd = s·q⊙e^Γ   Kd = k⊙e^Γ   Ki = k⊙e^−Γ   Kr = k⊙e^(Γ_C−Γ)   D = e^(Γ_C)
    A = StrictLower(Kd Kiᵀ)   Aqk = LowerInclDiag(Qd Kiᵀ)   [W | Ũ] = (I + Diag(β) A)⁻¹ [β⊙Kd | β⊙v]
    U = Ũ − W h        O = Qd h + Aqk U        h ← Diag(D) h + Krᵀ U

- Everything that does not depend on the state (the lines before U) runs batched over a block of tiles; the only
  sequential work is the three state products per tile. The lower bound g ≥ −5 keeps Ki ≤ e^80 (finite in fp32), so
  the diagonal tile is one dense matmul (§5).
- The state pass runs per 16-token tile rather than per 64-token chunk: on CPU this does fewer FLOPs (no 64×64
  intra-chunk blocks), keeps the state products cache-sized, and keeps spec §6 bitwise at every multiple of 16
  (future perturbation, causal gradients, append, split at multiples of chunk_size, packed isolation; pinned
  threads). A split at any other position matches only to rounding (the tile grid moves).
- Backward (`_KDAChunkFn`): the forward saves only its inputs and the fp32 state entering every 4th tile
  (64 tokens); backward recomputes each 64-token chunk's states and the per-tile quantities, then runs the reverse
  state-gradient pass. Memory beyond the inputs is the checkpointed states plus one block of work buffers.
- Compute dtype is fp32 for bf16/fp32 inputs (fp64 for fp64): the spec keeps anchor factors, state and
  accumulation in fp32 (§7). o is returned in v's dtype, the final state in the compute dtype.
- Packed sequences (cu_seqlens) take one of two layouts, each sequence on its own tile grid from its first token,
  so either is bitwise each sequence run alone:
  - one stream of tiles, each sequence padded to a tile multiple with neutral rows (q = k = v = g = β = 0), which
    leave the state bitwise unchanged; the state resets at each sequence's first tile. The state pass walks every
    sequence's tiles in turn with H state rows.
  - lockstep rows (`lockstep_pays`, `_run_lockstep`): sequence n is row n of a [N, T_max] batch padded at its end
    with neutral rows; the state pass walks T_max / C tiles once with N·H rows. For many sequences of similar length
    (an RL or SFT batch) this is 1.5-1.9x faster forward + backward (benchmarks/kda_packed.py); it is chosen while the
    padded work stays within `_LOCKSTEP_MAX_WORK` times the stream's.

Shapes: B batch, T tokens, H heads, K key dim, V value dim, N sequences, S state segments (B rows run in lockstep
as one segment, or N packed sequences), n tiles, nb tiles in a block, R = B·H state rows, C tile rows.
"""

import itertools
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from openk3.ops.kda.ref import _check_inputs, compute_dtype
from openk3.ops.kda.tile_ref import check_tile
from openk3.ops.kda.unit_lower import unit_lower_inverse_rows

__all__ = ["kda_chunked"]

# Tiles per batched block in forward: 256 tokens amortise the per-op overhead of the block precompute.
_BLOCK_TILES = 16
# Backward checkpoint interval: the entering state of every 4th tile (64 tokens) is saved. Backward works one
# checkpoint chunk at a time: its per-tile states (16 heads of 128² fp32 each) then stay cache-sized.
_CHECKPOINT_TILES = 4
_BACKWARD_BLOCK_TILES = _CHECKPOINT_TILES
# Packed sequences run as padded lockstep rows while that is at most this many times the packed tiles (lockstep_pays).
# Measured (benchmarks/kda_packed.py, 3 heads): 1.5-1.9x faster forward + backward at 1.2-1.5x the work, 1.14x at
# 1.84x, 2.8x slower at 5.9x (one long sequence among short ones).
_LOCKSTEP_MAX_WORK = 2.0


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 16,
    lower_bound: float = -5.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fast chunked KDA, same contract as `kda_recurrent` and `kda_chunked_tiles`.

    q, k [B, T, H, K] (L2-normalised), v [B, T, H, V], g [B, T, H, K] log-decay ≥ lower_bound, beta [B, T, H],
    initial_state [B or N, H, K, V] fp32 or None. Returns (o [B, T, H, V] in v's dtype, final state or None).
    `lower_bound` is the caller's promise about g, used only to check that e^(chunk_size·|lower_bound|) fits fp32.
    """
    inputs = (q, k, v, g, beta, initial_state, scale, cu_seqlens, chunk_size, lower_bound)
    return run_chunked(chunked_forward, 1, *inputs, output_final_state)


def run_chunked(forward, align, q, k, v, g, beta, initial_state, scale, cu_seqlens, chunk_size, lower_bound,
                output_final_state):  # fmt: skip
    """The shared body of `kda_chunked` and `chunk_bf16.kda_chunked_bf16`: checks, tiling, autograd, with
    `forward` (chunked_forward or chunked_forward_bf16) and packed sequences aligned to `align` tiles."""
    check_tile(chunk_size, lower_bound)
    bounds = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if bounds is not None and lockstep_pays(bounds, chunk_size):
        return _run_lockstep(forward, align, q, k, v, g, beta, initial_state, scale, bounds, chunk_size, lower_bound,
                             output_final_state)  # fmt: skip
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = compute_dtype(q, k, v, g, beta, initial_state)
    tiling = Tiling.build(q.shape, v.shape[-1], chunk_size, bounds, dtype, align)
    inputs = (q, k, v, g, beta, initial_state)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
        o, final = _KDAChunkFn.apply(*inputs, scale, tiling, forward)
    else:
        o, final, _ = forward(*inputs, scale, tiling, save_states=False)
    return o, (final if output_final_state else None)


def lockstep_work(bounds: list[int], C: int) -> tuple[int, int]:
    """(lockstep tiles, stream tiles) of packed sequences: N · the longest sequence's tiles, and the sum of theirs."""
    tiles = [-(-(b - a) // C) for a, b in itertools.pairwise(bounds)]
    return len(tiles) * max(tiles), sum(tiles)


def lockstep_pays(bounds: list[int], C: int) -> bool:
    """Whether packed sequences should run as padded lockstep rows: the state pass then walks the longest
    sequence's tiles once, with all sequences' states as one batch, instead of every sequence's tiles in turn; worth
    it for two or more non-empty sequences while the padded work stays within `_LOCKSTEP_MAX_WORK` times the packed
    work (benchmarks/kda_packed.py)."""
    lockstep, stream = lockstep_work(bounds, C)
    longest = lockstep // (len(bounds) - 1)
    return stream > longest and lockstep <= _LOCKSTEP_MAX_WORK * stream


def _run_lockstep(forward, align, q, k, v, g, beta, initial_state, scale, bounds, C, lower_bound,
                  output_final_state):  # fmt: skip
    """Packed sequences [1, T] as N rows [N, T_max] padded at their ends with neutral tokens (q = k = v = g = β = 0:
    the state passes through bitwise unchanged), so each row is its sequence alone on the same tile grid; the
    outputs are gathered back to the packed order. Autograd flows through the gather."""
    lens = [b - a for a, b in itertools.pairwise(bounds)]
    N, T_max = len(lens), max(lens)
    t_NT = torch.arange(T_max)
    valid_NT = t_NT[None, :] < torch.tensor(lens)[:, None]
    index_NT = (torch.tensor(bounds[:-1])[:, None] + t_NT[None, :]).clamp(max=max(bounds[-1] - 1, 0))
    valid_NT, index_NT = valid_NT.to(q.device), index_NT.to(q.device)

    def rows(x):  # [1, T, ...] -> [N, T_max, ...], padding selected to zero (not multiplied: no 0·inf)
        x_N = x[0][index_NT]
        return torch.where(valid_NT.view(N, T_max, *([1] * (x.dim() - 2))), x_N, x_N.new_zeros(()))

    o_N, final = run_chunked(forward, align, *(rows(x) for x in (q, k, v, g, beta)), initial_state, scale, None, C,
                             lower_bound, output_final_state)  # fmt: skip
    return o_N[valid_NT][None], final


@dataclass
class Tiling:
    """Where each token sits in the tile stream [n, R, C, ·], and which tiles start and end each state segment."""

    B: int
    T: int
    H: int
    K: int
    V: int
    C: int
    n: int
    dtype: torch.dtype
    token_pos: torch.Tensor | None  # packed: [T] position of each token in the flat tile stream
    gather: torch.Tensor | None  # packed: [n·C] token index per stream row (any valid index on padding rows)
    pad: torch.Tensor | None  # packed: [n·C] True on padding rows
    starts: dict[int, int]  # first tile -> segment
    ends: dict[int, int]  # last tile -> segment
    num_segments: int

    @staticmethod
    def build(shape, V, C, bounds, dtype, align: int = 1) -> "Tiling":
        """`align`: packed sequences start on multiples of `align` tiles (the bf16 path's state step), the gap
        filled with neutral tiles."""
        B, T, H, K = shape
        if bounds is None:
            n = -(-T // C)
            starts, ends = ({0: 0}, {n - 1: 0}) if n else ({}, {})
            return Tiling(B, T, H, K, V, C, n, dtype, None, None, None, starts, ends, 1)
        gather, token_pos, starts, ends = [], [], {}, {}
        for s, (a, b) in enumerate(itertools.pairwise(bounds)):
            tiles = -(-(b - a) // C)
            if tiles:
                gather.extend([-1] * (-len(gather) % (align * C)))
                starts[len(gather) // C] = s
                ends[len(gather) // C + tiles - 1] = s
            token_pos.extend(range(len(gather), len(gather) + b - a))
            gather.extend(list(range(a, b)) + [-1] * (tiles * C - (b - a)))
        gather_t = torch.tensor(gather, dtype=torch.long)
        return Tiling(
            B, T, H, K, V, C, len(gather) // C, dtype, torch.tensor(token_pos, dtype=torch.long),
            gather_t.clamp(min=0), gather_t < 0, starts, ends, len(bounds) - 1,
        )  # fmt: skip

    @property
    def R(self) -> int:
        return self.B * self.H

    def load_block(self, x_BTHD: torch.Tensor, b0: int, out_nRCD: torch.Tensor) -> torch.Tensor:
        """Tiles b0 .. b0 + nb of x [B, T, H, D] copied into out [nb, R, C, D] (compute dtype); padding rows are
        zeros (neutral). Working block by block avoids materialising a tiled copy of the whole input: fresh large
        buffers page-fault on every call, which cost more than the copy itself."""
        B, T, H, D = x_BTHD.shape
        nb, C = out_nRCD.shape[0], self.C
        if self.gather is None:
            out = out_nRCD.view(nb, B, H, C, D)
            t0 = b0 * C
            full = max(0, min(nb, (T - t0) // C))
            out[:full] = x_BTHD[:, t0 : t0 + full * C].view(B, full, C, H, D).permute(1, 0, 3, 2, 4)
            if full < nb:
                out[full:] = 0.0
                rem = T - t0 - full * C
                out[full, :, :, :rem] = x_BTHD[:, t0 + full * C : T].permute(0, 2, 1, 3)
            return out_nRCD
        rows = slice(b0 * C, b0 * C + nb * C)
        x_NHD = x_BTHD[0].index_select(0, self.gather[rows].to(x_BTHD.device))
        # Padding rows read a real token (clamped index) and are then replaced by zeros: selection, not a product.
        x_NHD.masked_fill_(self.pad[rows].to(x_BTHD.device)[:, None, None], 0.0)
        out_nRCD.copy_(x_NHD.view(nb, C, H, D).transpose(1, 2))
        return out_nRCD

    def load_chunks(self, x_BTHD: torch.Tensor, b0: int, out_cSRCD: torch.Tensor) -> None:
        """Tiles b0 .. b0 + nc·S of x [B, T, H, D] into out [nc, S, R, C, D] (any strides: the bf16 path stores
        tile positions major); padding rows and tiles past the stream are zeros."""
        nc, S = out_cSRCD.shape[:2]
        C, nb = self.C, nc * S
        if self.gather is None:
            B, T, H, D = x_BTHD.shape
            t0, t1 = b0 * C, (b0 + nb) * C
            src = x_BTHD[:, t0:t1]
            if t1 > T:  # the stream's last block
                src = x_BTHD.new_zeros(B, t1 - t0, H, D)
                src[:, : T - t0] = x_BTHD[:, t0:T]
        else:
            rows = slice(b0 * C, (b0 + nb) * C)
            x_NHD = x_BTHD[0].index_select(0, self.gather[rows].to(x_BTHD.device))
            x_NHD.masked_fill_(self.pad[rows].to(x_BTHD.device)[:, None, None], 0.0)
            src = torch.cat([x_NHD, x_NHD.new_zeros(nb * C - x_NHD.shape[0], *x_NHD.shape[1:])])[None]
        B, _, H, D = src.shape
        out_cSRCD.view(nc, S, B, H, C, D).copy_(src.view(B, nc, S, C, H, D).permute(1, 2, 0, 4, 3, 5))

    def store_chunks(self, x_cSRCD: torch.Tensor, b0: int, out_BTHD: torch.Tensor) -> None:
        """Writes tiles b0 .. b0 + nc·S given as x [nc, S, R, C, D] (any strides) into their tokens of out."""
        nc, S, R, C, D = x_cSRCD.shape
        B, T, H, _ = out_BTHD.shape
        t0, t1 = b0 * C, (b0 + nc * S) * C
        if self.gather is None and t1 <= T:
            out_BTHD[:, t0:t1].view(B, nc, S, C, H, D).copy_(x_cSRCD.view(nc, S, B, H, C, D).permute(2, 0, 1, 4, 3, 5))
            return
        nb = min(nc * S, self.n - b0)
        self.store_block(x_cSRCD.reshape(nc * S, R, C, D)[:nb], b0, out_BTHD)

    def store_block(self, x_nRCD: torch.Tensor, b0: int, out_BTHD: torch.Tensor) -> None:
        """Writes tiles b0 .. b0 + nb [nb, R, C, D] into their tokens of out [B, T, H, D] (padding dropped)."""
        B, T, H, D = out_BTHD.shape
        nb, C = x_nRCD.shape[0], self.C
        if self.gather is None:
            x = x_nRCD.view(nb, B, H, C, D)
            t0 = b0 * C
            full = max(0, min(nb, (T - t0) // C))
            out_BTHD[:, t0 : t0 + full * C].view(B, full, C, H, D).copy_(x[:full].permute(1, 0, 3, 2, 4))
            if full < nb:
                rem = T - t0 - full * C
                out_BTHD[:, t0 + full * C : T] = x[full, :, :, :rem].permute(0, 2, 1, 3)
            return
        # Packed tokens of this block form one contiguous token range (the stream keeps token order).
        lo, hi = self.token_range(b0, nb)
        x_NHD = x_nRCD.transpose(1, 2).reshape(nb * C, H, D)
        out_BTHD[0, lo:hi] = x_NHD.index_select(0, (self.token_pos[lo:hi] - b0 * C).to(x_NHD.device))

    def token_range(self, b0: int, nb: int) -> tuple[int, int]:
        bounds = torch.tensor([b0 * self.C, (b0 + nb) * self.C])
        lo, hi = torch.searchsorted(self.token_pos, bounds).tolist()
        return lo, hi

    def segment_states(self, state: torch.Tensor | None, device) -> torch.Tensor:
        """[B or N, H, K, V] (or None = zeros) -> [S, R, K, V] in the compute dtype, the layout of the state pass."""
        if state is None:
            return torch.zeros(self.num_segments, self.R, self.K, self.V, dtype=self.dtype, device=device)
        return state.to(self.dtype).reshape(self.num_segments, self.R, self.K, self.V)

    def states_out(self, state_SRKV: torch.Tensor) -> torch.Tensor:
        return state_SRKV.reshape(-1, self.H, self.K, self.V)


class TileBlock:
    """The state-independent quantities of nb consecutive tiles (all [nb, R, ·]), computed with batched matmuls."""

    def __init__(self, q, k, v, g, beta, scale: float):
        nb, R, C, K = q.shape
        V = v.shape[-1]
        G = g.cumsum(-2)
        GC = G[..., -1:, :]
        self.E, self.Ei, self.Er = G.exp(), G.neg().exp_(), (GC - G).exp_()
        self.D = GC.exp().mT  # [nb, R, K, 1]
        # Kd and Qd live in one [2C, K] buffer so that A and Aqk come from one matmul.
        self.KQ = q.new_empty(nb, R, 2 * C, K)
        self.Kd = torch.mul(k, self.E, out=self.KQ[..., :C, :])
        self.Qd = torch.mul(q, self.E, out=self.KQ[..., C:, :]).mul_(scale)
        self.Ki, self.Kr = k * self.Ei, k * self.Er
        self.v, self.beta = v, beta
        # Above the diagonal Kd Kiᵀ and Qd Kiᵀ hold e^(positive) products of later rows: large but finite (the
        # chunk_size check), and removed by selection (masked_fill), never by multiplication (0·inf = NaN).
        P = self.KQ @ self.Ki.mT
        lower_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        self.strict_lower, self.lower = lower_CC.tril(-1), lower_CC
        self.A = P[..., :C, :].masked_fill(~self.strict_lower, 0.0)
        self.Aqk = P[..., C:, :].masked_fill(~self.lower, 0.0)
        self.L = beta * self.A
        self.Tinv = unit_lower_inverse_rows(self.L)
        # Y = Tinv [−β⊙Kd | β⊙v] = [−W | Ũ]: the sign makes U = Ũ + (−W) h a single fused add.
        X = q.new_empty(nb, R, C, K + V)
        torch.mul(self.Kd, beta, out=X[..., :K]).neg_()
        torch.mul(v, beta, out=X[..., K:])
        self.Y = self.Tinv @ X
        self.Wn, self.Ut = self.Y[..., :K], self.Y[..., K:]


def _entering_state(i: int, h, h0_SRKV, tiling: Tiling):
    return h0_SRKV[tiling.starts[i]] if i in tiling.starts else h


def chunked_forward(q, k, v, g, beta, initial_state, scale, tiling: Tiling, save_states: bool):
    """Runs the op; returns (o [B, T, H, V] in v's dtype, final [B or N, H, K, V], checkpoints [n_ckpt, R, K, V])."""
    device, R, K, V = q.device, tiling.R, tiling.K, tiling.V
    inputs = (q, k, v, g, beta[..., None])
    in_bufs = _block_buffers(inputs, tiling, _BLOCK_TILES)
    h0_SRKV = tiling.segment_states(initial_state, device)
    final_SRKV = h0_SRKV.clone()  # segments with no tokens keep their initial state
    o_BTHV = torch.empty(v.shape, dtype=v.dtype, device=device)
    o_blk = torch.empty(_BLOCK_TILES, R, tiling.C, V, dtype=tiling.dtype, device=device)
    num_ckpt = -(-tiling.n // _CHECKPOINT_TILES) if save_states else 0
    checkpoints = torch.empty(num_ckpt, R, K, V, dtype=tiling.dtype, device=device)
    # Fixed work buffers: fresh large allocations page-fault on every call, which costs more than the math.
    h_bufs = torch.empty(2, R, K, V, dtype=tiling.dtype, device=device)
    U, Qh = torch.empty(2, R, tiling.C, V, dtype=tiling.dtype, device=device)
    h = h0_SRKV[0]
    for b0 in range(0, tiling.n, _BLOCK_TILES):
        nb = min(_BLOCK_TILES, tiling.n - b0)
        blk = TileBlock(*(tiling.load_block(x, b0, buf[:nb]) for x, buf in zip(inputs, in_bufs)), scale)
        for j in range(nb):
            i = b0 + j
            h = _entering_state(i, h, h0_SRKV, tiling)
            if save_states and i % _CHECKPOINT_TILES == 0:
                checkpoints[i // _CHECKPOINT_TILES] = h
            torch.baddbmm(blk.Ut[j], blk.Wn[j], h, out=U)
            torch.bmm(blk.Qd[j], h, out=Qh)
            torch.baddbmm(Qh, blk.Aqk[j], U, out=o_blk[j])
            h_next = h_bufs[0] if h.data_ptr() != h_bufs[0].data_ptr() else h_bufs[1]
            _decay_and_write(h, blk, j, U, out=h_next)
            h = h_next
            if i in tiling.ends:
                final_SRKV[tiling.ends[i]] = h
        tiling.store_block(o_blk[:nb], b0, o_BTHV)
    return o_BTHV, tiling.states_out(final_SRKV), (checkpoints if save_states else None)


def _block_buffers(tensors, tiling: Tiling, nb: int) -> list[torch.Tensor]:
    """One reusable [nb, R, C, D] compute-dtype buffer per [B, T, H, D] tensor."""
    return [torch.empty(nb, tiling.R, tiling.C, x.shape[-1], dtype=tiling.dtype, device=x.device)
            for x in tensors]  # fmt: skip


def _decay_and_write(h, blk: TileBlock, j: int, U, out):
    """out = Diag(e^Γ_C) h + Krᵀ U, the state update; forward and backward recompute share it (same bits)."""
    torch.mul(h, blk.D[j], out=out)
    out.baddbmm_(blk.Kr[j].mT, U)


class _KDAChunkFn(torch.autograd.Function):
    """kda_chunked with a hand-written backward that saves inputs + 64-token checkpoint states only. `forward`
    returns those checkpoints; the backward is the same fp32 pass for either forward."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, tiling, forward):
        o, final, checkpoints = forward(q, k, v, g, beta, initial_state, scale, tiling, save_states=True)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, checkpoints)
        ctx.scale, ctx.tiling = scale, tiling
        return o, final

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, initial_state, checkpoints = ctx.saved_tensors
        grads = chunked_backward(q, k, v, g, beta, initial_state, checkpoints, do, dfinal, ctx.scale, ctx.tiling)
        dq, dk, dv, dg, dbeta, dh0 = grads
        if initial_state is None:
            dh0 = None
        return dq, dk, dv, dg, dbeta, dh0, None, None, None


def chunked_backward(q, k, v, g, beta, initial_state, checkpoints, do, dfinal, scale, tiling: Tiling):
    """Reverse pass over blocks (last first); per 64-token chunk it recomputes the states from its checkpoint."""
    device, R, K, V, C = q.device, tiling.R, tiling.K, tiling.V, tiling.C
    inputs = (q, k, v, g, beta[..., None], do if do is not None else torch.zeros_like(v))
    in_bufs = _block_buffers(inputs, tiling, _BACKWARD_BLOCK_TILES)
    # Gradients in the inputs' dtypes; every token is written by exactly one block.
    grads = [torch.empty(x.shape, dtype=x.dtype, device=device) for x in inputs[:5]]
    h0_SRKV = tiling.segment_states(initial_state, device)
    dfinal_SRKV = tiling.segment_states(dfinal, device)
    dh0_SRKV = dfinal_SRKV.clone()  # segments with no tokens pass the final-state gradient straight through
    # Work buffers reused by every block: h and U per tile, dU per tile, and dh at every tile boundary.
    hs = torch.empty(_BACKWARD_BLOCK_TILES, R, K, V, dtype=tiling.dtype, device=device)
    dhs = torch.zeros(_BACKWARD_BLOCK_TILES + 1, R, K, V, dtype=tiling.dtype, device=device)
    Us = torch.empty(_BACKWARD_BLOCK_TILES, R, C, V, dtype=tiling.dtype, device=device)
    dUdO = torch.empty(_BACKWARD_BLOCK_TILES, R, 2 * C, V, dtype=tiling.dtype, device=device)  # [dU; dO] per tile
    dGCD = torch.empty(_BACKWARD_BLOCK_TILES, R, K, dtype=tiling.dtype, device=device)  # Σ_v ∂h_out ⊙ h per tile
    for b0 in reversed(range(0, tiling.n, _BACKWARD_BLOCK_TILES)):
        nb = min(_BACKWARD_BLOCK_TILES, tiling.n - b0)
        q_b, k_b, v_b, g_b, beta_b, do_blk = (tiling.load_block(x, b0, buf[:nb]) for x, buf in zip(inputs, in_bufs))
        blk = TileBlock(q_b, k_b, v_b, g_b, beta_b, scale)
        work = (hs[:nb], Us[:nb], dUdO[:nb], dhs[: nb + 1], dGCD[:nb])
        if nb < _BACKWARD_BLOCK_TILES:  # the last block is the first one processed: nothing to carry in
            dhs[nb].zero_()
        _reverse_state_pass(blk, b0, do_blk, work, checkpoints, h0_SRKV, dfinal_SRKV, dh0_SRKV, tiling)
        for dst, src in zip(grads, _block_backward(blk, do_blk, work, scale)):
            tiling.store_block(src, b0, dst)
        dhs[_BACKWARD_BLOCK_TILES].copy_(dhs[0])  # dh entering this block = dh leaving the previous one
    dq, dk, dv, dg, dbeta = grads
    return dq, dk, dv, dg, dbeta[..., 0], tiling.states_out(dh0_SRKV)


def _reverse_state_pass(blk: TileBlock, b0, do_blk, work, checkpoints, h0_SRKV, dfinal_SRKV, dh0_SRKV, tiling):
    """The sequential part of backward for one block: per 64-token chunk (last first) recompute the entering
    states h and pseudo-values U from the checkpoint, then walk the tiles backwards carrying dh = ∂loss/∂h.

    Fills work = (hs [nb] entering states, Us [nb], dUdO [nb] = [dU; dO] rows, dhs [nb + 1]: dhs[j] is
    ∂loss/∂(state entering tile j), dhs[nb] the gradient arriving from after the block, dGCD [nb] = Σ_v dh_out ⊙ h)
    for the batched `_block_backward`.
    """
    hs, Us, dUdO, dhs, dGCD = work
    nb, C = hs.shape[0], blk.Qd.shape[-2]
    # dh_in = D ⊙ dh_out + Qdᵀ dO + Wnᵀ dU: one rank-2C update with the stacked [Wn; Qd] and [dU; dO].
    WQ = torch.cat([blk.Wn, blk.Qd], -2)
    dUdO[..., C:, :] = do_blk
    AqkT_dO = blk.Aqk.mT @ do_blk  # [nb, R, C, V], the state-independent part of dU
    prod = torch.empty_like(hs[0])
    for c0 in reversed(range(0, nb, _CHECKPOINT_TILES)):
        c1 = min(c0 + _CHECKPOINT_TILES, nb)
        hs[c0] = checkpoints[(b0 + c0) // _CHECKPOINT_TILES]
        for j in range(c0, c1):
            if j > c0 and b0 + j in tiling.starts:
                hs[j] = h0_SRKV[tiling.starts[b0 + j]]
            # The same ops as the forward, so the recomputed states are bitwise the forward's.
            torch.baddbmm(blk.Ut[j], blk.Wn[j], hs[j], out=Us[j])
            if j + 1 < c1:
                _decay_and_write(hs[j], blk, j, Us[j], out=hs[j + 1])
        for j in reversed(range(c0, c1)):
            i = b0 + j
            if i in tiling.ends:
                dhs[j + 1] = dfinal_SRKV[tiling.ends[i]]
            # U = Ũ + Wn h feeds O (via Aqk) and the next state (via Krᵀ); h feeds U, O (via Qd) and the decay.
            dUdO[j, :, :C] = torch.baddbmm(AqkT_dO[j], blk.Kr[j], dhs[j + 1])
            torch.sum(torch.mul(dhs[j + 1], hs[j], out=prod), -1, out=dGCD[j])
            torch.mul(dhs[j + 1], blk.D[j], out=dhs[j])
            dhs[j].baddbmm_(WQ[j].mT, dUdO[j])
            if i in tiling.starts:
                dh0_SRKV[tiling.starts[i]] = dhs[j]


def _block_backward(blk: TileBlock, do_blk, work, scale):
    """Batched gradients of one block's tile quantities back to (dq, dk, dv, dg, dbeta) tiles [nb, R, C, ·]."""
    hs, Us, dUdO, dhs, dGCD = work
    dhs_out = dhs[1:]  # ∂loss/∂(state leaving tile j)
    C, K = blk.Qd.shape[-2], blk.Qd.shape[-1]
    dUs = dUdO[..., :C, :]
    dWnQd = dUdO @ hs.mT  # [dWn; dQd] from the state products
    dKr = Us @ dhs_out.mT
    dGC = dGCD * blk.D[..., 0] + (dKr * blk.Kr).sum(-2)  # ∂/∂Γ_C via D = e^Γ_C and Kr
    dAqk = (do_blk @ Us.mT).masked_fill_(~blk.lower, 0.0)
    # Y = Tinv X  =>  dX = Tinvᵀ dY  and  dL = −dX Yᵀ (kept on L's strictly lower support); dY = [dWn | dU].
    dY = torch.cat([dWnQd[..., :C, :], dUs], -1)
    dX = blk.Tinv.mT @ dY
    dL = (dX @ blk.Y.mT).neg_().masked_fill_(~blk.strict_lower, 0.0)
    dX_K, dX_V = dX[..., :K], dX[..., K:]  # X = [−β⊙Kd | β⊙v]
    dbeta = (dL * blk.A).sum(-1, keepdim=True) - (dX_K * blk.Kd).sum(-1, keepdim=True)
    dbeta += (dX_V * blk.v).sum(-1, keepdim=True)
    dv = blk.beta * dX_V
    # P = [Kd; Qd] Kiᵀ holds A (rows < C) and Aqk (rows ≥ C).
    dP = torch.cat([blk.beta * dL, dAqk], -2)
    dKQ = dP @ blk.Ki
    dKd = dKQ[..., :C, :] - blk.beta * dX_K
    dQd = dWnQd[..., C:, :] + dKQ[..., C:, :]
    dKi = dP.mT @ blk.KQ
    # In-place accumulation: each block-sized temporary costs a pass over memory on one core.
    dq = torch.mul(dQd, blk.E).mul_(scale)
    dk = torch.mul(dKd, blk.E).addcmul_(dKi, blk.Ei).addcmul_(dKr, blk.Er)
    dG = torch.mul(dQd, blk.Qd).addcmul_(dKd, blk.Kd).addcmul_(dKi, blk.Ki, value=-1).addcmul_(dKr, blk.Kr, value=-1)
    dG[..., -1, :] += dGC
    dg = dG.flip(-2).cumsum(-2).flip(-2)  # Γ = cumsum(g): reverse cumsum
    return dq, dk, dv, dg, dbeta
