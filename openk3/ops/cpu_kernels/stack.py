"""The decoder stack of a decode step in one C call (`openk3_decode_stack` in decode_kernels.c): the layer kernels
in the modules' order with the Block AttnRes bookkeeping between them, so a step crosses from Python to C once
instead of ~50 times.

`LayerArgs` mirrors the C struct `openk3_layer` (every field 8 bytes: int64, double or pointer, so both sides lay
it out alike); `DecodeStack` holds one per layer, filled once from the prepared layer kernels (`KDADecode`,
`MLADecode`, `MoEDecode`, `MixNorm` and a dense MLP's matrices), and per step takes the inputs that move: the KDA
cache rows, the MLA pool and its rows, the MoE outputs and replayed routes. model/decode_stack.py decides when it
applies and builds it; this module only speaks to C.
"""

from __future__ import annotations

import ctypes

import torch

from openk3.ops import cpu_kernels

_i64, _f64, _ptr = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p


class LayerArgs(ctypes.Structure):
    _fields_ = [  # the order of `openk3_layer`
        ("block_start", _i64), ("mixer", _i64), ("ffn", _i64),
        ("mix_w", _ptr * 2), ("query", _ptr * 2), ("norm_w", _ptr * 2), ("mix_eps", _f64 * 2), ("norm_eps", _f64 * 2),
        ("H", _i64), ("K", _i64), ("W", _i64), ("proj", _ptr), ("w_fb", _ptr), ("w_o", _ptr), ("tails_in", _ptr),
        ("state_in", _ptr), ("rows_in", _ptr), ("tails_out", _ptr), ("state_out", _ptr), ("rows_out", _ptr),
        ("conv_w", _ptr), ("A_log", _ptr), ("dt_bias", _ptr), ("o_norm_w", _ptr), ("lower_bound", _f64),
        ("kda_eps", _f64), ("kda_scale", _f64),
        ("Lq", _i64), ("Q", _i64), ("R", _i64), ("r", _i64), ("G", _i64), ("Hm", _i64), ("nope", _i64),
        ("Dv", _i64), ("w_qa", _ptr), ("qa_norm", _ptr), ("w_qb", _ptr), ("w_kva", _ptr), ("kv_norm", _ptr),
        ("w_g", _ptr), ("w_om", _ptr), ("w_uk", _ptr), ("w_uv", _ptr), ("mla_eps", _f64), ("mla_scale", _f64),
        ("pool", _ptr),
        ("F", _i64), ("d_w1", _ptr), ("d_w3", _ptr), ("d_w2", _ptr),
        ("Lt", _i64), ("Fe", _i64), ("Fs", _i64), ("E", _i64), ("k", _i64), ("renormalize", _i64), ("replay", _i64),
        ("w_gate", _ptr), ("bias", _ptr), ("scaling", _f64), ("idx", _ptr), ("scores", _ptr), ("weights", _ptr),
        ("w_down", _ptr), ("w1s", _ptr), ("w3s", _ptr), ("w2s", _ptr), ("lat_norm_w", _ptr), ("lat_norm_eps", _f64),
        ("w_up", _ptr), ("ws_gate", _ptr), ("ws_up", _ptr), ("ws_down", _ptr), ("beta", _f64), ("linear_beta", _f64),
    ]  # fmt: skip


class MLARows(ctypes.Structure):
    _fields_ = [("write", _ptr), ("read", _ptr), ("len", _ptr), ("S", _i64)]


def _site(args: LayerArgs, j: int, mix: cpu_kernels.MixNorm) -> None:
    mix_w, query, mix_eps, norm_w, norm_eps = mix._args
    args.mix_w[j], args.query[j], args.mix_eps[j], args.norm_w[j], args.norm_eps[j] = (mix_w, query, mix_eps, norm_w,
                                                                                       norm_eps)  # fmt: skip


class DecodeStack:
    """The layers' static arguments, filled once. `layers[l]` = (block_start, (attention MixNorm, FFN MixNorm),
    mixer: KDADecode | MLADecode, ffn: MoEDecode | (w1, w3, w2, beta, linear_beta) of a dense MLP); `out_site` the
    output AttnRes site's MixNorm. The caller checked that every kernel applies to the weights, one dtype."""

    def __init__(self, layers: list[tuple], out_site: cpu_kernels.MixNorm) -> None:
        self.dtype, self.D = out_site.dtype, out_site.D
        self.args = (LayerArgs * len(layers))()
        self.kda, self.mla, self.moe = [], [], []  # layer indices by kind
        self.mixers = {}  # l -> KDADecode | MLADecode (they own the pointer arrays the structs point into)
        for l, (block_start, (attn, mlp), mixer, ffn) in enumerate(layers):
            a = self.args[l]
            self.mixers[l] = mixer
            a.block_start = int(block_start)
            _site(a, 0, attn)
            _site(a, 1, mlp)
            if isinstance(mixer, cpu_kernels.KDADecode):
                a.mixer = 0
                (proj, a.w_fb, a.w_o), (conv_w, *params) = mixer._weights, mixer._params
                a.proj, a.conv_w = ctypes.addressof(proj), ctypes.addressof(conv_w)  # arrays the kernel keeps alive
                a.A_log, a.dt_bias, a.lower_bound, a.o_norm_w, a.kda_eps, a.kda_scale = params
                a.H = mixer.H
                a.K, a.W = mixer.P // mixer.H, mixer.W
                self.kda.append(l)
            else:
                a.mixer = 1
                _, a.Lq, a.Q, a.R, a.r, a.G = mixer._in
                a.w_qa, a.qa_norm, a.w_qb, a.w_kva, a.kv_norm, a.w_g, a.mla_eps = mixer._in_weights
                a.w_om = mixer._w_o
                self.mla.append(l)
            if isinstance(ffn, cpu_kernels.MoEDecode):
                a.ffn = 1
                _, _, a.Lt, a.Fe, a.Fs, a.E, a.k = ffn._dims
                a.w_gate, a.bias, a.renormalize, a.scaling = ffn._router
                (a.w_down, a.w1s, a.w3s, a.w2s, a.lat_norm_w, a.lat_norm_eps, a.w_up, a.ws_gate, a.ws_up, a.ws_down,
                 a.beta, a.linear_beta) = ffn._rest  # fmt: skip
                self.moe.append(l)
            else:
                w1, w3, w2, a.beta, a.linear_beta = ffn
                a.ffn, a.F = 0, w1.shape[0]
                a.d_w1, a.d_w3, a.d_w2 = w1.data_ptr(), w3.data_ptr(), w2.data_ptr()
        self.out_site = (ctypes.c_void_p * 3)(out_site._args[0], out_site._args[1], out_site._args[3])
        self.out_eps = (ctypes.c_double * 2)(out_site._args[2], out_site._args[4])
        self._keep: list = []  # per-step ctypes arrays the structs point into

    def applies(self, x_ND: torch.Tensor) -> bool:
        """The embeddings x [N, D] (0 < N <= MAX_ROWS) of the weights' dtype."""
        return cpu_kernels._rows(x_ND, self.dtype, self.D)

    def mla_applies(self, pools: list[torch.Tensor], absorbed: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Each MLA layer's pool [rows, R] of the weights' dtype and its absorbed W_uk, W_uv (fp32)."""
        return all(
            cpu_kernels._usable((pool,), self.dtype)
            and pool.dim() == 2
            and pool.shape[1] == self.args[l].R
            and cpu_kernels._usable(pair, torch.float32)
            for l, pool, pair in zip(self.mla, pools, absorbed)
        )

    def set_kda(self, l: int, io) -> None:
        """Layer l's KDA cache rows for this step (a model.cache.KDAInOut)."""
        a = self.args[l]
        tails_in, a.state_in, rows_in, tails_out, a.state_out, rows_out = args = cpu_kernels.KDADecode.io_args(io)
        self._keep.append(args)
        a.tails_in, a.rows_in = ctypes.addressof(tails_in), ctypes.addressof(rows_in)
        a.tails_out, a.rows_out = ctypes.addressof(tails_out), ctypes.addressof(rows_out)

    def set_mla(self, l: int, pool_RR: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> None:
        a = self.args[l]
        a.pool, a.w_uk, a.w_uv, a.mla_scale = pool_RR.data_ptr(), w_uk.data_ptr(), w_uv.data_ptr(), scale
        a.Hm, a.nope, _ = w_uk.shape
        a.Dv = w_uv.shape[2]

    def set_moe(self, l: int, idx_Tk: torch.Tensor, scores_TE: torch.Tensor, weights_Tk: torch.Tensor,
                replay: bool) -> None:  # fmt: skip
        a = self.args[l]
        a.idx, a.scores, a.weights, a.replay = (
            idx_Tk.data_ptr(),
            scores_TE.data_ptr(),
            weights_Tk.data_ptr(),
            int(replay),
        )

    def __call__(self, x_ND: torch.Tensor, write_N: torch.Tensor | None, read_NS: torch.Tensor | None,
                 len_N: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """The final-norm hidden states [N, D] of the decode tokens x [N, D] (their embeddings). write_N, read_NS,
        len_N (int64, contiguous): the MLA pool rows of this step (None without MLA layers)."""
        N = x_ND.shape[0]
        rows = MLARows()
        if write_N is not None:
            rows.write, rows.read, rows.len, rows.S = (write_N.data_ptr(), read_NS.data_ptr(), len_N.data_ptr(),
                                                       read_NS.shape[1])  # fmt: skip
        out = torch.empty_like(x_ND)
        rc = cpu_kernels._lib.openk3_decode_stack(int(self.dtype == torch.bfloat16), N, self.D, len(self.args),
                                                  self.args, ctypes.byref(rows), self.out_site, self.out_eps,
                                                  x_ND.data_ptr(), out.data_ptr())  # fmt: skip
        self._keep.clear()
        if rc >= 100:
            raise ValueError(f"the replayed routed experts of token {rc - 100} are not distinct ids in range")
        if rc:
            raise RuntimeError(f"openk3_decode_stack failed ({rc}) for N={N}")
        return out
