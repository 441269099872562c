"""MXFP4 (OCP microscaling FP4) pack and unpack for the routed experts (spec/model.md §8).

A logical weight W [out, in] is stored as
    weight_packed uint8 [out, in/2]   two E2M1 codes per byte, element 2j in the LOW nibble, 2j+1 in the HIGH nibble
    weight_scale  uint8 [out, in/32]  one E8M0 exponent per 32 consecutive inputs: multiplier 2^(s - 127)
E2M1 code c: magnitude [0, 0.5, 1, 1.5, 2, 3, 4, 6][c & 7], sign bit 3. Decoding is exact in bf16 for scale bytes
2..252 and exact in fp32 for 1..254; 255 is NaN in the OCP spec and is rejected.

Encoding fresh weights uses the OCP rule's exponent ceil(log2(amax / 6)) with round-to-nearest-even onto the E2M1
grid. Several exponents can encode the same values exactly, so a byte-exact round trip of a released checkpoint
keeps the scales it was loaded with (`scale_hint`) wherever they still reproduce the weights exactly.

Legend: O output rows, I input columns, G = I / 32 groups.
"""

from __future__ import annotations

import torch

GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return torch.cat([mags, -mags]).to(device=device, dtype=dtype)


def check_scales(scale_OG: torch.Tensor, dtype: torch.dtype, name: str = "weight_scale") -> None:
    """Raise ValueError when an E8M0 scale byte is NaN (255) or cannot be decoded exactly into `dtype`."""
    if scale_OG.numel() == 0:
        return
    lo, hi = int(scale_OG.min()), int(scale_OG.max())
    if hi == 255:
        raise ValueError(f"{name}: E8M0 scale byte 255 is NaN in the MX spec")
    limits = (2, 252) if dtype == torch.bfloat16 else (1, 254)
    if lo < limits[0] or hi > limits[1]:
        raise ValueError(
            f"{name}: scale bytes span [{lo}, {hi}], outside [{limits[0]}, {limits[1]}] where {dtype} decodes exactly"
        )


def mxfp4_unpack(packed_OH: torch.Tensor, scale_OG: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode [O, I/2] packed codes and [O, I/32] E8M0 scales into W [O, I] of `dtype` (exact)."""
    if packed_OH.dtype != torch.uint8 or scale_OG.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensors must be uint8, got {packed_OH.dtype} / {scale_OG.dtype}")
    O, half = packed_OH.shape
    if scale_OG.shape != (O, 2 * half // GROUP):
        raise ValueError(f"MXFP4 scale shape {tuple(scale_OG.shape)} does not match packed {tuple(packed_OH.shape)}")
    codes_OI = torch.stack([packed_OH & 0xF, packed_OH >> 4], dim=-1).reshape(O, 2 * half).long()
    values = _lut(torch.float32, packed_OH.device)[codes_OI].reshape(O, -1, GROUP)
    mult = torch.exp2(scale_OG.float() - 127.0).unsqueeze(-1)
    return (values * mult).reshape(O, 2 * half).to(dtype)


def _encode(x_OGK: torch.Tensor) -> torch.Tensor:
    """Round x (already divided by the group multiplier, |x| <= 6 after saturation) to E2M1 codes, ties to even."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x_OGK.device)
    a = x_OGK.abs().clamp(max=6.0).unsqueeze(-1)
    dist = (a - mags).abs()
    best = dist.amin(-1, keepdim=True)
    # Among equally close grid points prefer the even code (IEEE round-half-to-even on the 1-bit mantissa).
    codes = torch.arange(8, device=x_OGK.device)
    preference = (dist == best) * (2 - (codes & 1))
    mag_code = preference.argmax(-1)
    sign = torch.signbit(x_OGK).long() << 3  # -0 encodes as code 8, as the released quantizer writes it
    return (mag_code | sign).to(torch.uint8)


def mxfp4_pack(weight_OI: torch.Tensor, scale_hint_OG: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode W [O, I] as (packed [O, I/2], scale [O, I/32]). Groups where `scale_hint_OG` reproduces W exactly keep
    that scale (byte-exact re-save of a loaded checkpoint); the others get the OCP exponent ceil(log2(amax / 6))."""
    O, I = weight_OI.shape
    if I % GROUP:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {GROUP}, got {I}")
    w_OGK = weight_OI.float().reshape(O, I // GROUP, GROUP)
    amax = w_OGK.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax))
    scale = (exp + 127).clamp(1, 254).to(torch.uint8)
    if scale_hint_OG is not None:
        hinted = _encode(w_OGK / torch.exp2(scale_hint_OG.float() - 127).unsqueeze(-1))
        exact = (_decode_groups(hinted, scale_hint_OG) == w_OGK).all(-1)
        scale = torch.where(exact, scale_hint_OG.to(torch.uint8), scale)
    codes = _encode(w_OGK / torch.exp2(scale.float() - 127).unsqueeze(-1)).reshape(O, I)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, scale


def _decode_groups(codes_OGK: torch.Tensor, scale_OG: torch.Tensor) -> torch.Tensor:
    return _lut(torch.float32, codes_OGK.device)[codes_OGK.long()] * torch.exp2(scale_OG.float() - 127).unsqueeze(-1)
