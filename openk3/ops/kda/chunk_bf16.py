"""KDA chunked op with bf16 tile operands (CPU): 64-token state steps, fp32 state (spec/kda.md §4.2–§4.3, §7).

Owns `kda_chunked_bf16`, the same op as `chunk.kda_chunked` for bf16 q, k, v, whose forward runs the large products
with bf16 operands (oneDNN accumulates in fp32; torch's CPU GEMM then rounds each product to bf16, where fla-core's
tl.dot keeps the fp32 accumulator); the gate cumsum, the anchor factors e^{±Γ} (computed in fp32 and multiplied into
k or q before rounding: "scale before casting"), the UT inverse, the state h and its update stay fp32. The backward is chunk.py's fp32 backward,
recomputing from this forward's fp32 checkpoints. Reference: `chunk.kda_chunked` (and `ref.kda_recurrent`).

Why a separate op rather than `kda_chunked`'s path for bf16 inputs: it is ~1.8× faster at 8K tokens × 16 heads on
one CPU core, but its output error is ~2× kda_chunked's on the same bf16 inputs (o ≈ 3–4e-3 vs 1.6e-3 relative RMS
against fp64 on tests/model's tiny model: each rounded product adds about one bf16 rounding), enough to flip expert
choices in that random tiny MoE (test_bf16_model_tracks_fp32_reference). So the dispatcher never picks it on its
own: a bf16 model opts in with `ops.dispatch.use_impl("kda_chunked", "bf16")`.

Math per chunk of S = 4 tiles (C = 16 rows each) with entering state h; per tile i, anchored at the state entering
the tile exactly as in chunk.py (Γ restarts at the tile, so every factor but Ki is ≤ 1 and Ki ≤ e^80):
    Kd_i = k⊙e^Γ  Qd_i = s·q⊙e^Γ  Ki_i = k⊙e^−Γ  Kr_i = k⊙e^(Γ_C−Γ)  D_i = e^Γ_C
    Tinv_i = (I + Diag(β) StrictLower(Kd Kiᵀ))⁻¹        Aqk_ii = LowerInclDiag(Qd Kiᵀ)
across tiles j < i of the chunk, anchored at the start of tile i (both factors ≤ 1 for any gate):
    Kc_ij = Kr_j ⊙ D_(j+1)⋯D_(i−1)   [Akk_ij; Aqk_ij] = [Kd_i; Qd_i] Kc_ijᵀ   B_ij = Tinv_i Diag(β_i) Akk_ij
and at chunk level (decays from the chunk's start Dpre_i = D_0⋯D_(i−1), to its end Dpost_i = D_(i+1)⋯D_(S−1)):
    Wc_i = Tinv_i Diag(β_i) (Kd_i ⊙ Dpre_i)   Ut_i = Tinv_i Diag(β_i) v_i   Qc_i = Qd_i ⊙ Dpre_i
    Krc_i = Kr_i ⊙ Dpost_i                    Dc = D_0⋯D_(S−1)
the sequential part, per chunk:
    U_i = Ut_i − Wc_i h − Σ_(j<i) B_ij U_j     (the tile recurrence of chunk.py, unrolled over the chunk)
    O   = Qc h + Aqk U                          (Aqk: the chunk's lower block-triangular 64×64 matrix)
    h  ← Diag(Dc) h + Krcᵀ U
Stepping the state 64 tokens at a time makes the state products 64 or 128 rows deep (bf16 GEMMs run ~1.7× faster
there than at 16 rows on CPU) and does the fp32 state update a quarter as often; the chunk boundary is also the
backward's checkpoint interval. The state is exact fp32 at every chunk boundary (FLA's chunk_kda semantics).

- Causality (spec §6): every anchor depends only on data at or before its tile; blocks above the diagonal of Aqk are
  exact zeros and B only reaches earlier tiles, so outputs are bitwise independent of later tokens, and splitting
  at a multiple of 64 tokens (the state step) is bitwise. Blocks are always a full NB tiles (zero padded), so every
  call runs the same shapes whatever T is.
- The elementwise part (`anchored_operands`, about a dozen passes over [T, H, K] in eager torch) runs through
  torch.compile when the platform can build it: one fused loop, several times faster (the op ~1.4× overall). If
  compiling fails the eager function runs, with a warning.

Shapes: B batch, T tokens, H heads, K key dim, V value dim, R = B·H state rows, C tile rows, S tiles per chunk,
L = S·C chunk rows, nc chunks in a block, NB = nc·S tiles in a block.
"""

import warnings

import torch

from openk3.ops.kda.chunk import _CHECKPOINT_TILES, run_chunked
from openk3.ops.kda.unit_lower import unit_lower_inverse_blocked, unit_lower_inverse_rows

__all__ = ["kda_chunked_bf16"]

# Tiles per state step: the 64-token chunk of FLA's chunk_kda. It is the fp32 backward's checkpoint interval by
# construction: the backward recomputes each chunk from the state this forward saves at its start.
STATE_TILES = _CHECKPOINT_TILES
# Chunks per block: the elementwise kernel and the batched products run over 16 tiles (256 tokens) at a time.
_BLOCK_CHUNKS = 4

_BF16 = torch.bfloat16
# Decay factors below e^−80 ≈ 1.8e−35 are floored (between tiles) or flushed to zero (chunk-level factors).
_LOG_FLOOR = -80.0
_FLOOR = 1.8e-35


def kda_chunked_bf16(
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
    """`chunk.kda_chunked` with bf16 tile operands; q, k, v must be bf16 (g, beta, initial_state fp32).

    Returns (o [B, T, H, V] bf16, final state fp32 or None). Packed sequences (cu_seqlens) start on 64-token chunks.
    """
    if not q.dtype == k.dtype == v.dtype == _BF16:
        raise ValueError(f"kda_chunked_bf16 needs bf16 q, k, v, got {q.dtype}, {k.dtype}, {v.dtype}")
    if any(x is not None and x.dtype == torch.float64 for x in (g, beta, initial_state)):
        raise ValueError("kda_chunked_bf16 computes in fp32: pass g, beta and initial_state as fp32")
    inputs = (q, k, v, g, beta, initial_state, scale, cu_seqlens, chunk_size, lower_bound)
    return run_chunked(chunked_forward_bf16, STATE_TILES, *inputs, output_final_state)


def anchored_operands(q, k, G, Dpre, Dpost, scale: float, out):
    """The anchored bf16 operands of one block's tiles (the elementwise part of the module docstring).

    q, k [S, nc, R, C, K] bf16, G [S, nc, R, C, K] fp32 (cumsum of g within each tile), Dpre, Dpost
    [S, nc, R, 1, K] fp32. Writes out = (Kd, Qd, Ki, Kr, Kdc, Qc, Krc), all bf16 [S, nc, R, C, K] (tile position
    major: the products of one position batch over contiguous memory), with Kdc = Kd ⊙ Dpre, Qc = Qd ⊙ Dpre and
    Krc = Kr ⊙ Dpost. All outputs share the inputs' layout, which keeps the compiled version one fused loop with no
    temporaries; writing into preallocated buffers avoids page-faulting fresh ones on every block.
    """
    qf, kf = q.float(), k.float()
    E = G.exp()
    # e^−Γ as 1/e^Γ and e^(Γ_C−Γ) as e^Γ_C/e^Γ: one exp instead of three (Γ ≥ −C·5 keeps e^Γ a normal fp32).
    Ei = E.reciprocal()
    Er = Ei * E[..., -1:, :]
    Kd, Qd, Kr = kf * E, qf * E * scale, kf * Er
    # Chunk-level factors under e^−80 are flushed to zero: subnormal products are several times slower, and the
    # terms they scale are below fp32 resolution of any sum they enter.
    Epre, Epost = E * Dpre, Er * Dpost
    Epre, Epost = Epre.masked_fill(Epre < _FLOOR, 0.0), Epost.masked_fill(Epost < _FLOOR, 0.0)
    for buf, x in zip(out, (Kd, Qd, kf * Ei, Kr, kf * Epre, qf * Epre * scale, kf * Epost)):
        buf.copy_(x)


class _CompiledOperands:
    """`anchored_operands` through torch.compile, built on first use; eager (with one warning) if that fails.
    Compiling takes a few seconds per process (cached on disk by inductor); a second shape recompiles once with
    dynamic sizes."""

    def __init__(self):
        self.fn = None

    def __call__(self, *args):
        if self.fn is None:
            self.fn = torch.compile(anchored_operands)
        if self.fn is anchored_operands:
            return anchored_operands(*args)
        try:
            self.fn(*args)
        except Exception as e:  # noqa: BLE001 (no C++ toolchain, unsupported platform: eager is the same math)
            warnings.warn(f"KDA bf16 path: torch.compile failed ({type(e).__name__}: {e}); using eager ops",
                          stacklevel=3)  # fmt: skip
            self.fn = anchored_operands
            anchored_operands(*args)


compiled_operands = _CompiledOperands()


class _Workspace:
    """Buffers reused by every block of one call: fresh tensors above glibc's mmap threshold page-fault on every
    use, which made the block's products ~4× slower than the arithmetic. Loaded tiles and the per-tile operands
    are stored tile-position major, [S, nc, R, C, ·]; what the sequential pass reads is chunk major, [nc, R, L, ·]."""

    def __init__(self, tiling, device):
        S, nc, R, C, K, V = STATE_TILES, _BLOCK_CHUNKS, tiling.R, tiling.C, tiling.K, tiling.V
        L = S * C

        def empty(*shape, dtype=_BF16):
            return torch.empty(*shape, dtype=dtype, device=device)

        self.q, self.k = empty(2, S, nc, R, C, K)
        self.v = empty(S, nc, R, C, V)
        self.G = empty(S, nc, R, C, K, dtype=torch.float32)
        self.beta = empty(S, nc, R, C, 1, dtype=torch.float32)
        self.operands = tuple(empty(7, S, nc, R, C, K))  # Kd, Qd, Ki, Kr, Kdc, Qc, Krc (anchored_operands)
        self.Pkk, self.Pqk, self.TinvB = empty(3, S, nc, R, C, C)
        self.L_kk = empty(S, nc, R, C, C, dtype=torch.float32)
        self.Tinv = empty(S, nc, R, C, C, dtype=torch.float32)
        self.Kcol = [empty(nc, R, i * C, K) for i in range(1, S)]  # columns Kc_ij of row tile i
        self.P_i = [empty(nc, R, C, i * C) for i in range(1, S)]
        self.B = [empty(nc, R, C, i * C) for i in range(1, S)]  # [B_i0 … B_i(i−1)]
        self.WcS, self.UtS = empty(S, nc, R, C, K), empty(S, nc, R, C, V)
        self.WQ = empty(nc, R, 2 * L, K)  # [Wc; Qc] per chunk
        self.Ut = empty(nc, R, L, V)
        self.Krc = empty(nc, R, L, K)
        # Blocks above the diagonal stay zero: only the lower blocks are written.
        self.Aqk = torch.zeros(nc, R, L, L, dtype=_BF16, device=device)
        self.o = empty(nc, R, L, V)
        self.h = empty(R, K, V, dtype=torch.float32)  # the state, updated in place
        self.h_bf = empty(R, K, V)
        self.WQh = empty(R, 2 * L, V)
        self.U = empty(R, L, V)
        self.KrcU = empty(R, K, V)
        self.KrcU32 = empty(R, K, V, dtype=torch.float32)
        lower_CC = torch.ones(C, C, dtype=torch.bool, device=device).tril()
        self.upper, self.upper_strict = ~lower_CC, ~lower_CC.tril(-1)

    def load(self, tiling, inputs, b0: int):
        """Tiles b0 .. b0 + NB of (q, k, v, g, beta) into the block buffers; tiles past the stream are zeros."""
        for x, buf in zip(inputs, (self.q, self.k, self.v, self.G, self.beta)):
            tiling.load_chunks(x, b0, buf.transpose(0, 1))


def chunked_forward_bf16(q, k, v, g, beta, initial_state, scale, tiling, save_states: bool):
    """chunk.chunked_forward for bf16 q, k, v: (o [B, T, H, V] bf16, final [B or N, H, K, V] fp32, checkpoints
    [n_chunks, R, K, V] fp32 (the state entering every chunk, what the fp32 backward recomputes from) or None)."""
    device, S, C, R, V = q.device, STATE_TILES, tiling.C, tiling.R, tiling.V
    NB, L = S * _BLOCK_CHUNKS, S * C
    ws = _Workspace(tiling, device)
    h0_SRKV = tiling.segment_states(initial_state, device)
    final_SRKV = h0_SRKV.clone()  # segments with no tokens keep their initial state
    o_BTHV = torch.empty(v.shape, dtype=v.dtype, device=device)
    num_chunks = -(-tiling.n // S)
    checkpoints = torch.empty(num_chunks if save_states else 0, R, tiling.K, V, device=device)
    inputs = (q, k, v, g, beta[..., None])
    h, h_bf, WQh, U, KrcU, KrcU32 = ws.h, ws.h_bf, ws.WQh, ws.U, ws.KrcU, ws.KrcU32
    for b0 in range(0, tiling.n, NB):
        ws.load(tiling, inputs, b0)
        Dc = _chunk_block(ws, scale)
        for c in range(min(_BLOCK_CHUNKS, num_chunks - b0 // S)):
            i = b0 // S + c  # chunk index in the stream
            if i * S in tiling.starts:
                h.copy_(h0_SRKV[tiling.starts[i * S]])
            if save_states:
                checkpoints[i] = h
            h_bf.copy_(h)
            torch.bmm(ws.WQ[c], h_bf, out=WQh)
            torch.sub(ws.Ut[c], WQh[:, :L], out=U)
            for t in range(1, S):  # U_t −= Σ_(j<t) B_tj U_j, tile by tile (forward substitution over the chunk)
                U[:, t * C : (t + 1) * C].baddbmm_(ws.B[t - 1][c], U[:, : t * C], alpha=-1)
            torch.baddbmm(WQh[:, L:], ws.Aqk[c], U, out=ws.o[c])
            torch.bmm(ws.Krc[c].mT, U, out=KrcU)
            # Mixed-dtype elementwise ops convert into a fresh temporary first: convert into a kept buffer.
            torch.addcmul(KrcU32.copy_(KrcU), h, Dc[c], out=h)
            for t in range(i * S, i * S + S):
                if t in tiling.ends:
                    final_SRKV[tiling.ends[t]] = h
        tiling.store_chunks(ws.o.view(_BLOCK_CHUNKS, R, S, C, V).transpose(1, 2), b0, o_BTHV)
    return o_BTHV, tiling.states_out(final_SRKV), (checkpoints if save_states else None)


def _exp(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(min=_LOG_FLOOR).exp_()


def _chunk_block(ws: _Workspace, scale: float) -> torch.Tensor:
    """The state-independent quantities of one block's chunks (module docstring) into the workspace: ws.WQ, ws.Ut,
    ws.Aqk, ws.B, ws.Krc. Returns Dc [nc, R, K, 1] fp32."""
    S, nc, R, C, _ = ws.q.shape
    L = S * C

    def chunk_major(x_SnRCD, out_nRLD):  # [S, nc, R, C, D] -> [nc, R, S·C, D]
        out_nRLD.view(nc, R, S, C, -1).copy_(x_SnRCD.permute(1, 2, 0, 3, 4))

    # Per-tile cumsum of g, row by row in place (torch.cumsum over a middle dim is ~2× slower).
    G = ws.G
    for r in range(1, C):
        G[..., r, :] += G[..., r - 1, :]
    GC = G[..., C - 1 :, :]  # [S, nc, R, 1, K]
    # Decays between tiles, as sums of log-decays (small [S, nc, R, 1, K] tensors). Floored at e^−80: below that
    # exp is ~25× slower (subnormal results), and a factor under e^−80 is zero for every later sum.
    Gpre = GC.cumsum(0) - GC
    Gtot = Gpre[-1] + GC[-1]  # [nc, R, 1, K]
    compiled_operands(ws.q, ws.k, G, _exp(Gpre), _exp(Gtot - Gpre - GC), scale, ws.operands)
    Kd, Qd, Ki, Kr, Kdc, Qc, Krc = ws.operands
    beta = ws.beta  # [S, nc, R, C, 1]

    # A and Aqk of each tile. Above the diagonal they hold e^(positive) products of later rows: large but finite,
    # removed by selection.
    torch.matmul(Kd, Ki.mT, out=ws.Pkk)
    torch.matmul(Qd, Ki.mT, out=ws.Pqk)
    L_kk = ws.L_kk.copy_(ws.Pkk).masked_fill_(ws.upper_strict, 0.0).mul_(beta)
    if C & (C - 1) == 0:
        Tinv = unit_lower_inverse_blocked(L_kk, out=ws.Tinv)
    else:
        Tinv = ws.Tinv.copy_(unit_lower_inverse_rows(L_kk))
    TinvB = torch.mul(Tinv, beta.mT, out=ws.TinvB)  # Tinv Diag(β)
    Aqk6 = ws.Aqk.view(nc, R, S, C, S, C)
    Aqk6.diagonal(0, 2, 4).copy_(ws.Pqk.masked_fill_(ws.upper, 0.0).permute(1, 2, 3, 4, 0))
    # Row tile i against the columns Kc_ij of the earlier tiles j of its chunk (the decay between them folded into
    # the columns): the chunk's Aqk blocks below the diagonal, and B_i = [B_i0 … B_i(i−1)].
    for i in range(1, S):
        Kcol, P_i = ws.Kcol[i - 1], ws.P_i[i - 1]
        for j in range(i):
            cols = Kcol[:, :, j * C : (j + 1) * C]
            if j == i - 1:
                cols.copy_(Kr[j])
            else:  # bf16 × bf16: a mixed-dtype op would first convert Kr[j] into a fresh fp32 temporary
                torch.mul(Kr[j], _exp(Gpre[i] - Gpre[j + 1]).to(_BF16), out=cols)
        torch.matmul(Qd[i], Kcol.mT, out=P_i)
        ws.Aqk[:, :, i * C : (i + 1) * C, : i * C] = P_i
        torch.matmul(Kd[i], Kcol.mT, out=P_i)
        torch.matmul(TinvB[i], P_i, out=ws.B[i - 1])
    chunk_major(torch.matmul(TinvB, Kdc, out=ws.WcS), ws.WQ[:, :, :L])
    chunk_major(Qc, ws.WQ[:, :, L:])
    chunk_major(torch.matmul(TinvB, ws.v, out=ws.UtS), ws.Ut)
    chunk_major(Krc, ws.Krc)
    return _exp(Gtot.mT)
