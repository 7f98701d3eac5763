"""The layout of 5- and 6-bit codes (perfxlm/quant/code_layout.py): Q4_0's nibbles, then one bit plane per
extra bit whose words hold a block's 32 elements in the order the AVX2 / AVX-512 shifts unpack
(csrc/code_planes.h); the native kernels read these bytes (tests/unit/test_quant_linear_ops.py)."""

import torch

from perfxlm.quant import code_layout as cl


def _word(plane: torch.Tensor, block: int) -> int:
    return int.from_bytes(bytes(plane[4 * block : 4 * block + 4].tolist()), "little")


def test_plane_order_is_a_permutation_that_the_lane_shifts_undo():
    assert sorted(cl.PLANE_BIT) == list(range(32))
    for e in range(32):
        j, b = (e % 16) // 4, e % 4  # the 32-bit lane (of 4 in a half) and the byte in it
        shifted = (1 << cl.PLANE_BIT[e]) << (j + 1) if e < 16 else (1 << cl.PLANE_BIT[e]) >> j
        assert shifted == 1 << (8 * b + 4), e  # the element's bit lands on bit 4 of its own byte


def test_one_fifth_bit_lands_where_the_order_says():
    for e in range(64):
        values = torch.zeros(1, 64, dtype=torch.uint8)
        values[0, e] = 16
        codes = cl.pack_fives(values)
        assert codes.shape == (1, 40) and not codes[0, :32].any()
        words = [_word(codes[0, 32:], blk) for blk in range(2)]
        assert words[e // 32] == 1 << cl.PLANE_BIT[e % 32] and words[1 - e // 32] == 0, e


def test_5_and_6_bit_codes_round_trip_at_odd_shapes():
    g = torch.Generator().manual_seed(0)
    for shape in [(3, 32), (7, 96), (2, 5, 160)]:
        five = torch.randint(0, 32, shape, generator=g, dtype=torch.uint8)
        six = torch.randint(0, 64, shape, generator=g, dtype=torch.uint8)
        assert cl.pack_fives(five).shape[-1] == shape[-1] * 5 // 8
        assert torch.equal(cl.unpack_fives(cl.pack_fives(five)), five)
        assert torch.equal(cl.unpack_sixes(cl.pack_sixes(six)), six)
        assert torch.equal(cl.unpack_nibbles(cl.pack_sixes(six)[..., : shape[-1] // 2]), six & 15)


def test_gguf_words_move_into_the_plane_order():
    """Q5_0's qh word (element e at bit e) -> the plane: the same as packing those bits afresh."""
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(0, 2, (5, 128), generator=g, dtype=torch.uint8)
    qh = torch.zeros(5, 16, dtype=torch.uint8)
    for i in range(8):  # element 8c + i at bit i of byte c
        qh |= bits.view(5, 16, 8)[..., i] << i
    assert torch.equal(cl.plane_from_words(qh), cl.pack_fives(bits << 4)[:, 64:])
