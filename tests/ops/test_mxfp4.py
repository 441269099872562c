"""MXFP4 (E2M1 codes + E8M0 scales) against hand-computed values, and pack/unpack round trips."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.moe.mxfp4 import check_scales, mxfp4_pack, mxfp4_unpack


def test_hand_computed_values():
    # Row 0: codes 0..15 twice (low nibble first); scale 127 (x1) then 128 (x2).
    codes = list(range(16)) * 4
    packed = torch.tensor([[codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(32)]], dtype=torch.uint8)
    scale = torch.tensor([[127, 125]], dtype=torch.uint8)
    w = mxfp4_unpack(packed, scale, torch.float32)
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    expected = torch.tensor([e2m1 * 2 + [x * 0.25 for x in e2m1] * 2])
    assert torch.equal(w, expected)
    assert torch.signbit(w[0, 8])  # code 8 is -0
    # Byte 0x71: low nibble 1 (0.5) is element 0, high nibble 7 (6.0) is element 1.
    one = torch.tensor([[0x71] + [0] * 15], dtype=torch.uint8)
    w = mxfp4_unpack(one, torch.tensor([[130]], dtype=torch.uint8), torch.bfloat16)
    assert w[0, 0].item() == 0.5 * 8 and w[0, 1].item() == 6.0 * 8 and w.dtype == torch.bfloat16


def test_pack_of_unpack_is_identity_for_random_codes():
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (7, 48), generator=gen, dtype=torch.uint8)
    # Use groups whose largest magnitude code is 6 so the scale is canonical.
    packed[:, ::16] = 0x77
    scale = torch.randint(100, 150, (7, 3), generator=gen, dtype=torch.uint8)
    w = mxfp4_unpack(packed, scale, torch.bfloat16)
    p2, s2 = mxfp4_pack(w)
    assert torch.equal(p2, packed) and torch.equal(s2, scale)


def test_scale_hint_keeps_official_scale_choice():
    # 3 * 2^-4 can be stored with exponent -4 (code 3 -> 3.0) or -5 (code 6 -> 6.0); a loaded checkpoint's choice
    # must survive a re-save, fresh weights get the OCP exponent ceil(log2(amax / 6)).
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 3 * 2**-4, 2**-4
    hint = torch.tensor([[123]], dtype=torch.uint8)
    packed, scale = mxfp4_pack(w, hint)
    assert scale.item() == 123 and torch.equal(mxfp4_unpack(packed, scale, torch.float32), w)
    _, fresh = mxfp4_pack(w)
    assert fresh.item() == 122
    # A hint that cannot reproduce the weights is ignored.
    _, s = mxfp4_pack(w, torch.tensor([[125]], dtype=torch.uint8))  # 0.75 * 2^-2 is not an E2M1 value
    assert s.item() == 122


def test_quantize_rounds_to_nearest_even_and_saturates():
    w = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, 6.0] + [0.0] * 23])
    packed, scale = mxfp4_pack(w)
    assert scale.item() == 127
    out = mxfp4_unpack(packed, scale, torch.float32)[0, :9]
    assert out.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, 6.0]


def test_bad_scales_and_shapes():
    with pytest.raises(ValueError, match="255"):
        check_scales(torch.tensor([[255]], dtype=torch.uint8), torch.bfloat16)
    with pytest.raises(ValueError, match="decodes exactly"):
        check_scales(torch.tensor([[253]], dtype=torch.uint8), torch.bfloat16)
    check_scales(torch.tensor([[253]], dtype=torch.uint8), torch.float32)
    with pytest.raises(ValueError, match="scale shape"):
        mxfp4_unpack(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_pack(torch.zeros(2, 40))
