"""The record decoder, driven with byte strings only."""

import pytest

from peer.framing import HEADER, FrameTooLarge, RecordDecoder


def records(*bodies: bytes) -> bytes:
    return b"".join(HEADER.pack(len(body)) + body for body in bodies)


def drain(decoder: RecordDecoder) -> list[bytes]:
    out = []
    while (record := decoder.next_record()) is not None:
        out.append(bytes(record))
    return out


def test_records_split_across_arbitrary_reads():
    bodies = [b"a", b"", b"x" * 70_000, b"tail"]
    stream = records(*bodies)
    for step in (1, 3, 4096, len(stream)):
        decoder = RecordDecoder(max_record_size=100_000)
        got = []
        for offset in range(0, len(stream), step):
            decoder.receive_data(stream[offset : offset + step])
            got.extend(drain(decoder))
        assert got == bodies


def test_partial_record_waits_for_more():
    decoder = RecordDecoder()
    data = records(b"hello")
    decoder.receive_data(data[:6])
    assert decoder.next_record() is None
    assert decoder.missing() == len(data) - 6
    decoder.receive_data(data[6:])
    assert drain(decoder) == [b"hello"]


def test_oversized_length_is_refused_before_the_body_arrives():
    decoder = RecordDecoder(max_record_size=1024)
    decoder.receive_data(HEADER.pack(1025))
    with pytest.raises(FrameTooLarge, match="1025"):
        decoder.next_record()
    with pytest.raises(FrameTooLarge):  # the decoder stays failed
        decoder.next_record()


def test_recv_into_interface_grows_and_compacts():
    decoder = RecordDecoder(max_record_size=1 << 20, initial_size=1024)
    bodies = [bytes([i]) * (300_000 + i) for i in range(8)]
    stream = memoryview(records(*bodies))
    got, offset = [], 0
    while offset < len(stream):
        view = decoder.writable()
        n = min(len(view), 100_003, len(stream) - offset)
        view[:n] = stream[offset : offset + n]
        decoder.commit(n)
        offset += n
        got.extend(drain(decoder))
    assert got == bodies


def test_take_buffered_hands_over_leftovers():
    decoder = RecordDecoder(max_record_size=64)
    decoder.receive_data(records(b"first") + b"\x00\x00")
    assert drain(decoder) == [b"first"]
    assert decoder.take_buffered() == b"\x00\x00"
    assert decoder.buffered == 0
