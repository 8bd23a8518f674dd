import pytest
import torch

from diloco.algorithm import codec
from diloco.algorithm.codec import BLOCK, CODECS, CorruptPayload, Encoded, ErrorFeedback, decode, encode, encoded_size


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000, 4097])
def test_round_trip_error_bounds(codec, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 0.01
    p = encode(x, codec)
    assert len(p.data) == encoded_size(numel, codec)
    y = decode(p)
    assert y.shape == x.shape and y.dtype == torch.float32
    err = (y - x).abs()
    if codec == "fp32":
        assert torch.equal(x, y)
    elif codec == "bf16":
        assert torch.all(err <= x.abs() * 2**-8)
    else:
        levels = {"int8": 127, "int4": 7}[codec]
        blocks = -(-numel // BLOCK)
        pad = torch.zeros(blocks * BLOCK)
        pad[:numel] = x.abs()
        bound = (pad.view(blocks, BLOCK).amax(1) / levels / 2).repeat_interleave(BLOCK)[:numel]
        assert torch.all(err <= bound * (1 + 2**-8) + 1e-12)  # half a step of the scale, stored in bf16 (2^-9)


def test_int4_packs_two_values_per_byte():
    assert encoded_size(6400, "int4") == 6400 // 2 + 2 * 100  # and a bf16 scale per block of 64
    assert encoded_size(6400, "int8") == 6400 + 2 * 100


def test_zero_block_and_exact_levels():
    x = torch.zeros(130)
    x[70] = 7.0
    x[71] = -3.0
    y = decode(encode(x, "int4"))
    assert torch.equal(x, y)


@pytest.mark.parametrize("codec", CODECS)
def test_corrupted_payload_is_detected(codec):
    p = encode(torch.randn(300), codec)
    data = bytearray(p.data)
    data[len(data) // 2] ^= 0x10
    with pytest.raises(CorruptPayload, match="checksum"):
        decode(Encoded(p.codec, p.numel, bytes(data), p.checksum))
    with pytest.raises(CorruptPayload, match="bytes"):
        decode(Encoded(p.codec, p.numel, p.data[:-1], p.checksum))


def test_unknown_codec_is_refused():
    with pytest.raises(ValueError, match="unknown codec 'int3'"):
        encode(torch.zeros(3), "int3")


def test_error_feedback_carries_residual():
    ef = ErrorFeedback()
    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(256, generator=g) for _ in range(20)]
    sent = sum(decode(ef.encode(0, d, "int4")) for d in deltas)
    plain = sum(decode(encode(d, "int4")) for d in deltas)
    true = sum(deltas)
    # with feedback the accumulated error is bounded by one step's error, without it it grows
    assert (sent - true).norm() < 0.5 * (plain - true).norm()


@pytest.mark.parametrize("name", CODECS)
def test_chunked_coding_matches_whole_and_differences_are_encoded_without_materialising(name, monkeypatch):
    monkeypatch.setattr(codec, "CHUNK_BLOCKS", 3)  # many chunks, the last one partial
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    whole = codec.encode(a - b, name)
    assert codec.encode_difference(a, b, name) == whole
    monkeypatch.setattr(codec, "CHUNK_BLOCKS", 10_000)
    assert codec.encode(a - b, name) == whole  # chunking does not change a payload
    target = b.clone()
    codec.decode_add(whole, target)
    torch.testing.assert_close(target, b + codec.decode(whole), rtol=0, atol=0)
    with pytest.raises(codec.CorruptPayload):
        codec.decode_add(whole, torch.zeros(999))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_all_finite_finds_any_nan_or_inf(bad):
    x = torch.randn(1000)
    assert codec.all_finite(x) and codec.all_finite(torch.zeros(0))
    x[537] = bad
    assert not codec.all_finite(x)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000, 300_000])
def test_round_trip_is_bitwise_what_the_receiver_decodes(name, numel):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.logspace(-6, 2, numel)  # scales of every size across blocks
    x[: min(numel, 2 * BLOCK)] = 0.0 if numel > 3 * BLOCK else x[: min(numel, 2 * BLOCK)]  # whole zero blocks
    expected = decode(encode(x, name))
    got = codec.round_trip(x, name)
    assert got.dtype == torch.float32 and got.shape == (numel,)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("numel", [1, 64, 65, 300_001])
def test_chunks_decoded_into_a_scratch_buffer_are_the_payload_s_values(name, numel, monkeypatch):
    monkeypatch.setattr(codec, "CHUNK_BLOCKS", 7)  # many chunks, the last one partial
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 100
    payload = encode(x, name)
    scratch = torch.full((codec.chunk_scratch(numel),), float("nan"))
    got = torch.cat([chunk.clone() for _, _, chunk in codec.decoded_chunks(payload, scratch)])
    assert torch.equal(got, decode(payload))
    assert codec.chunk_scratch(numel) == min(-(-numel // BLOCK), 7) * (BLOCK + 1)
