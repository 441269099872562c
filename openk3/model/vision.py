"""MoonViT-V2 (the release's `MoonViT3d`) and its `patchmergerv2` projector (spec/vision.md §1-§7).

Pixels [L, 3, p, p] (patches of all images, row-major per image, images concatenated) -> Conv2d patch embedding
+ the learnable 2-D position table resized to each image's grid (+ a fixed sin/cos time table for video frames) ->
pre-norm blocks (fused wqkv, 2-D RoPE, bidirectional attention within each image, tanh-GELU MLP) ->
final_layernorm -> 2x2 merge with temporal mean (`sd2_tpool`) -> projector (Linear -> erf GELU -> Linear ->
RMSNorm) -> one [N_i, text_hidden] block of LM rows per image.

The tower's norms are `nn.RMSNorm` built without eps, as the release builds them: PyTorch then uses
`finfo(x.dtype).eps` (2^-7 in bf16), which we keep so a bf16 run matches the bf16 release.
Module and parameter names are the checkpoint's (`vision_tower.*`, `mm_projector.*`; the key map is model/hf.py).

Legend: L patches of all images (sum of t*h*w), D tower width, Q qkv width, H heads, K head dim (Q / H),
F MLP hidden, P pixels per patch (3 * p * p), N merged tokens of one image ((h/2)(w/2)), C text hidden,
t/h/w an image's frames / patch rows / patch columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from openk3.model.layers import Linear
from openk3.ops import widen

# Grid bound of the release's RoPE table (`Rope2DPosEmbRepeated(..., 512, 512)`).
MAX_GRID_SIDE = 512
ROPE_THETA = 10000.0
_IMPLEMENTED = {"pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool", "mlp_type": "mlp2",
                "norm_type": "rmsnorm", "mm_projector_type": "patchmergerv2"}  # fmt: skip


@dataclass(frozen=True)
class VisionConfig:
    """The fields of the checkpoint's `vision_config` the tower and projector read (spec/vision.md §1)."""

    patch_size: int
    pos_emb_height: int
    pos_emb_width: int
    pos_emb_time: int
    interpolation_mode: str
    hidden_size: int  # D
    num_layers: int
    num_heads: int  # H
    qkv_hidden_size: int  # Q
    intermediate_size: int  # F
    merge_kernel: tuple[int, int]
    mm_hidden_size: int
    text_hidden_size: int  # C
    projector_eps: float
    attn_bias: bool
    linear_bias: bool
    patch_bias: bool

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VisionConfig:
        for key, want in _IMPLEMENTED.items():
            if d.get(key, want) != want:
                raise ValueError(f"vision_config.{key} = {d[key]!r} is not implemented (only {want!r})")
        try:
            D = d["vt_hidden_size"]
            cfg = cls(
                patch_size=d["patch_size"], pos_emb_height=d["init_pos_emb_height"],
                pos_emb_width=d["init_pos_emb_width"], pos_emb_time=d["init_pos_emb_time"],
                interpolation_mode=d.get("pos_emb_interpolation_mode", "bilinear"), hidden_size=D,
                num_layers=d["vt_num_hidden_layers"], num_heads=d["vt_num_attention_heads"],
                qkv_hidden_size=d.get("qkv_hidden_size") or D, intermediate_size=d["vt_intermediate_size"],
                merge_kernel=_pair(d["merge_kernel_size"]), mm_hidden_size=d.get("mm_hidden_size") or D,
                text_hidden_size=d["text_hidden_size"], projector_eps=d["projector_ln_eps"],
                attn_bias=d.get("attn_bias", True), linear_bias=d.get("linear_bias", True),
                patch_bias=d.get("patch_embed_proj_bias", True),
            )  # fmt: skip
        except KeyError as err:
            raise ValueError(f"vision_config: missing {err.args[0]!r}") from err
        K = cfg.qkv_hidden_size // cfg.num_heads
        if cfg.qkv_hidden_size % cfg.num_heads or K % 4:
            raise ValueError(f"vision_config: qkv_hidden_size {cfg.qkv_hidden_size} must split into "
                             f"{cfg.num_heads} heads of a multiple of 4 (2-D RoPE)")  # fmt: skip
        if cfg.mm_hidden_size != D:
            raise ValueError(f"vision_config.mm_hidden_size {cfg.mm_hidden_size} != vt_hidden_size {D}")
        return cfg


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else tuple(value)


def _sincos_time_table(num_frames: int, dim: int) -> torch.Tensor:
    """[num_frames, dim] fixed 1-D table [sin(f w_j), cos(f w_j)], w_j = 10000^(-j/(dim/2)), in fp32 as the
    release's numpy builds it (only video frames use it: a single image gets no time term)."""
    omega = torch.arange(dim // 2, dtype=torch.float32) / (dim / 2.0)
    omega = 1.0 / 10000**omega
    angle = torch.outer(torch.arange(num_frames, dtype=torch.float32), omega)
    return torch.cat([angle.sin(), angle.cos()], dim=1)


class PosEmbDividedFixed(nn.Module):
    """The learnable [h0, w0, D] grid, bilinearly resized (align_corners=False) to each image's (h, w)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_frames = cfg.pos_emb_time
        self.mode = cfg.interpolation_mode
        self.weight = nn.Parameter(torch.empty(cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size))

    def forward(self, x_LD: torch.Tensor, grid_thws: list[list[int]]) -> torch.Tensor:
        D = x_LD.shape[-1]
        pos = []
        for t, h, w in grid_thws:
            if t > self.num_frames:
                raise ValueError(f"an input has {t} frames; the tower's time table has {self.num_frames}")
            if (h, w) == tuple(self.weight.shape[:2]):
                pos_hwD = self.weight.flatten(0, 1)
            else:
                grid_1Dhw = F.interpolate(self.weight.permute(2, 0, 1)[None], size=(h, w), mode=self.mode)
                pos_hwD = grid_1Dhw[0].permute(1, 2, 0).flatten(0, 1)
            if t > 1:
                time_t1D = _sincos_time_table(t, D).to(pos_hwD)[:, None]
                pos_hwD = (pos_hwD[None] + time_t1D).flatten(0, 1)
            pos.append(pos_hwD)
        return x_LD + torch.cat(pos)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.hidden_size, kernel_size=p, stride=p, bias=cfg.patch_bias)
        self.pos_emb = PosEmbDividedFixed(cfg)

    def forward(self, pixels_L3pp: torch.Tensor, grid_thws: list[list[int]]) -> torch.Tensor:
        x_LD = self.proj(pixels_L3pp.to(self.proj.weight.dtype)).flatten(1)
        return self.pos_emb(x_LD, grid_thws)


def rope_2d_angles(grid_thws: list[list[int]], head_dim: int, device=None) -> torch.Tensor:
    """[L, K/2] complex64 rotations: pair 2i turns by col * f_i, pair 2i+1 by row * f_i, f_i = 10000^(-4i/K),
    repeated for every frame (the release's table puts the column on the even pairs, whatever its docstring says).
    Same fp32 products as the release's precomputed 512x512 table, computed only for the grids at hand."""
    freqs = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 4, device=device)[: head_dim // 4].float() / head_dim))
    out = []
    for t, h, w in grid_thws:
        if not (1 <= h <= MAX_GRID_SIDE and 1 <= w <= MAX_GRID_SIDE):
            raise ValueError(f"an image grid of {h}x{w} patches exceeds the tower's {MAX_GRID_SIDE}x{MAX_GRID_SIDE}")
        flat = torch.arange(h * w, device=device)
        col_cis = torch.polar(torch.ones(h * w, freqs.numel(), device=device), torch.outer((flat % w).float(), freqs))
        row_cis = torch.polar(torch.ones_like(col_cis.real), torch.outer((flat // w).float(), freqs))
        out.append(torch.stack([col_cis, row_cis], dim=-1).flatten(1).repeat(t, 1))
    return torch.cat(out)


def apply_rope(x_LHK: torch.Tensor, cis_LK2: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (2j, 2j+1) in fp32, as the release does, and cast back."""
    x_c = torch.view_as_complex(x_LHK.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(x_c * cis_LK2[:, None]).flatten(-2).type_as(x_LHK)


def varlen_attention(q_LHK, k_LHK, v_LHK, lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention within each image (block-diagonal over `lengths`), scale 1/sqrt(K), softmax in
    fp32 then cast to q's dtype: the release's eager path, one image at a time so no mask is materialised."""
    out = []
    root = math.sqrt(q_LHK.shape[-1])
    for q, k, v in zip(q_LHK.split(lengths), k_LHK.split(lengths), v_LHK.split(lengths)):
        scores_HLL = widen.matmul(q.transpose(0, 1), k.transpose(0, 1).transpose(-2, -1)) / root
        probs_HLL = torch.softmax(scores_HLL, dim=-1, dtype=torch.float32).to(q.dtype)
        out.append(widen.matmul(probs_HLL, v.transpose(0, 1)).transpose(0, 1).flatten(1))  # [L_i, Q]
    return torch.cat(out)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc0 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.linear_bias)
        self.fc1 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.linear_bias)

    def forward(self, x_LD: torch.Tensor) -> torch.Tensor:
        # The release hard-codes PytorchGELUTanh whatever `activation_func` says.
        return self.fc1(F.gelu(self.fc0(x_LD), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        D, Q = cfg.hidden_size, cfg.qkv_hidden_size
        self.num_heads = cfg.num_heads
        self.norm0 = nn.RMSNorm(D)  # eps=None: finfo(dtype).eps at run time (module docstring)
        self.norm1 = nn.RMSNorm(D)
        self.wqkv = Linear(D, 3 * Q, bias=cfg.attn_bias)
        self.wo = Linear(Q, D, bias=cfg.attn_bias)
        self.mlp = VisionMLP(cfg)

    def forward(self, x_LD: torch.Tensor, cis_LK2: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        qkv_L3HK = self.wqkv(self.norm0(x_LD)).unflatten(-1, (3, self.num_heads, -1))
        q_LHK, k_LHK, v_LHK = qkv_L3HK.unbind(1)
        q_LHK, k_LHK = apply_rope(q_LHK, cis_LK2), apply_rope(k_LHK, cis_LK2)
        x_LD = x_LD + self.wo(varlen_attention(q_LHK, k_LHK, v_LHK, lengths))
        return x_LD + self.mlp(self.norm1(x_LD))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.head_dim = cfg.qkv_hidden_size // cfg.num_heads
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_layers))
        self.final_layernorm = nn.RMSNorm(cfg.hidden_size)

    def forward(self, x_LD: torch.Tensor, grid_thws: list[list[int]]) -> torch.Tensor:
        cis_LK2 = rope_2d_angles(grid_thws, self.head_dim, x_LD.device)
        lengths = [t * h * w for t, h, w in grid_thws]
        for block in self.blocks:
            x_LD = block(x_LD, cis_LK2, lengths)
        return self.final_layernorm(x_LD)


def tpool_merge(x_LD: torch.Tensor, grid_thws: list[list[int]], kernel: tuple[int, int]) -> list[torch.Tensor]:
    """`sd2_tpool`: per image [N, kh*kw, D], tokens in row-major order of kh x kw cells, the cell's patches
    row-major, averaged over frames."""
    kh, kw = kernel
    out = []
    for x_thwD, (t, h, w) in zip(x_LD.split([t * h * w for t, h, w in grid_thws]), grid_thws):
        if h % kh or w % kw:
            raise ValueError(f"an image grid of {h}x{w} patches is not a multiple of the {kh}x{kw} merge")
        cells = x_thwD.view(t, h // kh, kh, w // kw, kw, -1).permute(0, 1, 3, 2, 4, 5).mean(0)
        out.append(cells.reshape((h // kh) * (w // kw), kh * kw, -1))
    return out


class MoonViT3d(nn.Module):
    """The tower: `forward(pixel_values [L, 3, p, p], grid_thws [n, 3]) -> list of [N_i, 4, D]`."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.merge_kernel = cfg.merge_kernel
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = VisionEncoder(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> list[torch.Tensor]:
        if grid_thws.dim() != 2 or grid_thws.shape[1] != 3:
            raise ValueError(f"grid_thws must be [images, 3], got shape {tuple(grid_thws.shape)}")
        grids = grid_thws.tolist()
        L = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape[0] != L:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grid_thws describes {L}")
        x_LD = self.encoder(self.patch_embed(pixel_values, grids), grids)
        return tpool_merge(x_LD, grids, self.merge_kernel)


class PatchMergerMLPV2(nn.Module):
    """The projector: each merged token's kh*kw patches concatenated (patch-major) -> Linear -> erf GELU ->
    Linear -> RMSNorm(eps = projector_ln_eps); no pre-norm. `projector_hidden_act` is ignored, as in the release."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        width = cfg.mm_hidden_size * cfg.merge_kernel[0] * cfg.merge_kernel[1]
        self.proj = nn.Sequential(Linear(width, width, bias=False), nn.GELU(),
                                  Linear(width, cfg.text_hidden_size, bias=False))  # fmt: skip
        self.post_norm = nn.RMSNorm(cfg.text_hidden_size, eps=cfg.projector_eps)

    def forward(self, merged: list[torch.Tensor]) -> list[torch.Tensor]:
        lengths = [m.shape[0] for m in merged]
        x_NP = torch.cat([m.flatten(1) for m in merged])
        return list(self.post_norm(self.proj(x_NP)).split(lengths))


@torch.no_grad()
def init_vision_weights(tower: MoonViT3d, projector: PatchMergerMLPV2, generator: torch.Generator | None = None):
    """From-scratch init of the tower and projector: what the release's modules hold when constructed (its
    training init is unpublished; the report trains this tower from scratch):

    - `patch_embed.pos_emb.weight`: N(0, 1) (`Learnable2DInterpPosEmbDivided_fixed.reset_parameters`);
    - `patch_embed.proj.weight`, `wqkv.weight`, `wo.weight`: PyTorch's Conv2d/Linear default,
      U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (kaiming_uniform with a = sqrt(5));
    - `mlp.fc0.weight`, `mlp.fc1.weight`, `mm_projector.proj.{0,2}.weight`: truncated normal, std sqrt(2/fan_in),
      cut at +-2 (`MLP2` and `PatchMergerMLPV2` constructors);
    - every norm weight (`norm0`, `norm1`, `final_layernorm`, `post_norm`): 1; every bias (none in the release): 0.
    """
    for module in (tower, projector):
        for name, p in module.named_parameters():
            fan_in = p[0].numel() if p.dim() > 1 else 0
            if name.endswith("pos_emb.weight"):
                p.normal_(0.0, 1.0, generator=generator)
            elif name.endswith(("fc0.weight", "fc1.weight")) or (module is projector and p.dim() == 2):
                nn.init.trunc_normal_(p, std=math.sqrt(2.0 / fan_in), a=-2.0, b=2.0, generator=generator)
            elif p.dim() > 1:
                bound = 1.0 / math.sqrt(fan_in)
                p.uniform_(-bound, bound, generator=generator)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
