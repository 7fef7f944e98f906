"""Sparse low-bit codecs: chunked top-k with 2- or 4-bit values (``topk_2bit``, ``topk_4bit``).

For the outer rounds of local updates (DiLoCo), where one pseudo-gradient per round crosses a
volunteer's uplink: SparseLoCo (2025) showed that sending the 64 largest of every 4,096 values of
the error-fed pseudo-gradient, each in 2 bits, trains as well as dense outer rounds at > 97x less
traffic. Here every chunk of ``CHUNK`` values keeps its ``KEEP`` largest by magnitude; a kept value
is a sign and a magnitude level between the chunk's smallest and largest kept magnitudes (2 or 8
levels, decoded at the middle of their bin), and its position a 12-bit index into its chunk. Per
kept value that is 12 + 2 bits plus the chunk's two float32 bounds spread over 64 values: 15 bits,
against 32 x 64 bits for the chunk in float32 (137x less; 4-bit values: 17 bits, 120x).

Everything a part's bytes hold follows from its length (the chunk layout is fixed by the codec's
name), so the meta is just the name and the payload's size is known before it arrives. The
decoder treats the payload as hostile: bounds must be finite, non-negative and ordered (a decoded
value lies between them, so it is finite), and every index must fall inside its chunk. A repeated
index overwrites itself: an honest encoder repeats one only to fill a chunk with fewer non-zero
values than slots (with the same value); a liar can only narrow what it sets.

Decoded parts are zero outside the kept values, and a reducer that averages them sends the average
back encoded the same way: the ``KEEP`` largest of each chunk of the average reach the group, the
rest reach no one. ``Codec.sparse`` says so, and error feedback (``error_feedback.py``) keeps in a
peer's residual whatever of its contribution the returned average left out.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from peer.buffers import byte_view
from peer.tensors import all_finite

from .compression import Codec, _check_meta, _empty, _prepare, get_codec, register_codec

__all__ = ["CHUNK", "KEEP", "TopK2BitCodec", "TopK4BitCodec", "TopK8BitCodec", "as_sent", "kept_per_chunk"]

# SparseLoCo's chunk and density: 64 of 4,096 (1.56%). A chunk index needs 12 bits.
CHUNK = 4096
KEEP = 64
INDEX_BITS = 12


def kept_per_chunk(length: int) -> int:
    """How many values a chunk of ``length`` keeps: ``KEEP`` of a full chunk, as many in
    proportion (at least one) of the part's shorter last chunk."""
    return min(length, -(-length * KEEP // CHUNK))


class _TopKCodec(Codec):
    """Chunked top-k with ``bits``-bit values (one sign bit, the rest a magnitude level)."""

    bits: ClassVar[int]
    sparse = True

    @property
    def levels(self) -> int:
        return 1 << (self.bits - 1)

    def reply_codec(self, checked: bool) -> Codec:
        """In a checked round the reducer replies in 8 bits (``TopK8BitCodec``): a sender that
        checks it can then bound every kept value's rounding to 1/256 of its chunk's range, where
        2 bits would leave a liar a quarter of the reply's norm to move it by."""
        return get_codec(TopK8BitCodec.name) if checked else self

    def payload_size(self, numel: int) -> int:
        chunks, kept = _layout(numel)
        return 8 * chunks + _index_bytes(kept) + _code_bytes(kept, self.bits)

    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], bytes | memoryview]:
        return self.encode_finite(_prepare(tensor))

    def encode_finite(self, tensor: torch.Tensor) -> tuple[dict[str, Any], bytes | memoryview]:
        numel = tensor.numel()
        indices, values, counts = _top_k(tensor)
        lo, hi, level = self._quantise(values.abs(), counts, numel)
        codes = level | ((values < 0).to(torch.uint8) << (self.bits - 1))
        payload = np.concatenate(
            [
                torch.stack([lo, hi], dim=1).reshape(-1).numpy().view(np.uint8),
                _pack_indices(indices.numpy()),
                _pack_codes(codes.numpy(), self.bits),
            ]
        )
        return {"codec": self.name}, memoryview(payload)

    def decode(self, meta: dict[str, Any], payload: Any, numel: int) -> torch.Tensor:
        return self.decode_into(meta, payload, _empty(numel))

    def decode_into(self, meta: dict[str, Any], payload: Any, out: torch.Tensor) -> torch.Tensor:
        _check_meta(meta, self.name, {})
        numel = out.numel()
        view = np.frombuffer(byte_view(payload, self.payload_size(numel)), dtype=np.uint8)
        chunks, kept = _layout(numel)
        bounds = torch.from_numpy(view[: 8 * chunks].view(np.float32).copy()).view(chunks, 2)
        lo, hi = bounds[:, 0], bounds[:, 1]
        if not all_finite(bounds) or bool((lo < 0).any()) or bool((hi < lo).any()):
            raise ValueError(f"{self.name}: chunk bounds must be finite, non-negative and ordered")
        index_end = 8 * chunks + _index_bytes(kept)
        indices = torch.from_numpy(_unpack_indices(view[8 * chunks : index_end], kept).astype(np.int64))
        codes = torch.from_numpy(_unpack_codes(view[index_end:], kept, self.bits))
        counts, lengths = _chunk_counts(numel)
        if bool((indices >= torch.repeat_interleave(lengths, counts)).any()):
            raise ValueError(f"{self.name}: an index falls outside its chunk")
        values = self._magnitudes(lo, hi, codes & (self.levels - 1), counts)
        values = torch.where(codes >> (self.bits - 1) > 0, -values, values)
        starts = torch.repeat_interleave(torch.arange(chunks, dtype=torch.int64) * CHUNK, counts)
        out.zero_()
        out.index_put_((starts + indices,), values)
        return out

    def _quantise(
        self, magnitudes: torch.Tensor, counts: torch.Tensor, numel: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each chunk's two bounds and each kept magnitude's level: ``levels`` bins of equal width
        between the chunk's smallest and largest kept magnitude."""
        lo, hi = _chunk_bounds(magnitudes, numel)
        step = (hi - lo) / self.levels
        per_value_lo = torch.repeat_interleave(lo, counts)
        per_value_step = torch.repeat_interleave(step, counts)
        safe_step = torch.where(per_value_step > 0, per_value_step, torch.ones_like(per_value_step))
        level = ((magnitudes - per_value_lo) / safe_step).floor_().clamp_(0, self.levels - 1).to(torch.uint8)
        return lo, hi, level

    def _magnitudes(
        self, lo: torch.Tensor, hi: torch.Tensor, level: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """The magnitude each level decodes to: the middle of its bin."""
        step = (hi - lo) / self.levels
        middle = level.to(torch.float32).add_(0.5)
        return middle.mul_(torch.repeat_interleave(step, counts)).add_(torch.repeat_interleave(lo, counts))


@register_codec
class TopK2BitCodec(_TopKCodec):
    """64 of every 4,096 values, each as a sign and one of 2 magnitude levels: ~137x less than float32.

    With two levels, equal-width bins decode most kept values too large: the largest of a chunk lie
    far above the rest, so most fall in the lower bin, well below its middle (a reducer's reply came
    out 12% too large on average). Here a chunk's two magnitudes are those of a two-level Lloyd-Max
    quantiser (each the mean of the values it stands for, the split midway between them), so every
    chunk's decoded magnitudes add up to what was kept: no bias where error feedback does not see."""

    name = "topk_2bit"
    bits = 2

    def _quantise(
        self, magnitudes: torch.Tensor, counts: torch.Tensor, numel: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        full = numel // CHUNK
        rows = [magnitudes[: full * KEEP].view(full, KEEP)] if full else []
        if numel > full * CHUNK:
            rows.append(magnitudes[full * KEEP :].view(1, -1))
        lower, upper, levels = [], [], []
        for row in rows:  # the full chunks as one 2-D view, then the shorter last one
            low, high, above = _two_means(row)
            lower.append(low)
            upper.append(high)
            levels.append(above.to(torch.uint8).reshape(-1))
        if not rows:
            return torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.uint8)
        return torch.cat(lower), torch.cat(upper), torch.cat(levels)

    def _magnitudes(
        self, lo: torch.Tensor, hi: torch.Tensor, level: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        return torch.where(level > 0, torch.repeat_interleave(hi, counts), torch.repeat_interleave(lo, counts))


@register_codec
class TopK4BitCodec(_TopKCodec):
    """64 of every 4,096 values, each as a sign and one of 8 magnitude levels: ~120x less than float32."""

    name = "topk_4bit"
    bits = 4


@register_codec
class TopK8BitCodec(_TopKCodec):
    """64 of every 4,096 values, each as a sign and one of 128 magnitude levels: ~95x less than
    float32. The replies of checked rounds (``_TopKCodec.reply_codec``)."""

    name = "topk_8bit"
    bits = 8


def as_sent(
    codec: Codec,
    shard: torch.Tensor,
    parts: list[tuple[int, int]],
    offset: int,
    encoded: dict[int, tuple[Any, Any]] | None = None,
) -> torch.Tensor:
    """A reducer's own contribution to its shard (``shard``, at flat ``offset``) as the other
    senders' arrive: each part encoded and decoded. Added dense among top-k rows, it would be the
    outlier CenteredClip steers away from, and its unsent values would compete for the shard's
    slots with what the others sent. ``encoded``: part index -> its encoding, where one was made
    already (a checked round commits to them): decoded, not made again, so what we add is exactly
    what we committed to."""
    out = torch.empty_like(shard)
    for index, (start, end) in enumerate(parts):
        made = (encoded or {}).get(index)
        if made is None:
            made = codec.encode_finite(shard[start - offset : end - offset].contiguous())
        out[start - offset : end - offset] = codec.decode(*made, end - start)
    return out


def _two_means(rows: torch.Tensor, rounds: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: two magnitudes and which values take the larger, by Lloyd's iteration from the
    split at the median (each magnitude the mean of its values, the next split midway between
    them); what it returns belongs to one split, so each magnitude is its values' mean."""
    rows = rows.double()  # sums of values near the float32 limit stay finite
    threshold = torch.sort(rows, dim=1).values[:, rows.shape[1] // 2 :][:, :1]
    for _ in range(rounds):
        above = rows >= threshold  # the median is in the upper half: never empty
        count_above = above.sum(dim=1)
        count_below = rows.shape[1] - count_above
        high = (rows * above).sum(dim=1) / count_above.clamp(min=1)
        low = torch.where(count_below > 0, (rows * ~above).sum(dim=1) / count_below.clamp(min=1), high)
        threshold = ((low + high) / 2).unsqueeze(1)
    return low.float(), high.float(), above


def _chunk_counts(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk: how many values it keeps, and its length."""
    full, tail = divmod(numel, CHUNK)
    lengths = [CHUNK] * full + ([tail] if tail else [])
    counts = [kept_per_chunk(length) for length in lengths]
    return torch.tensor(counts, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)


def _layout(numel: int) -> tuple[int, int]:
    """(chunks, kept values) of a part of ``numel`` values."""
    full, tail = divmod(numel, CHUNK)
    return full + (1 if tail else 0), full * KEEP + (kept_per_chunk(tail) if tail else 0)


def _index_bytes(kept: int) -> int:
    return 3 * (-(-kept // 2))  # two 12-bit indices in three bytes


def _code_bytes(kept: int, bits: int) -> int:
    return -(-kept * bits // 8)


def _top_k(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indices within their chunks (int16, chunk by chunk), the kept values, and per-chunk counts.

    A chunk with fewer non-zero values than slots points its spare slots at its largest value (the
    same index and value again; the decoder lets a repeated index overwrite itself): a kept zero
    would otherwise set the chunk's smallest magnitude to 0 and decode as half a step, not 0."""
    numel = part.numel()
    full = numel // CHUNK
    chunks = [part[: full * CHUNK].view(full, CHUNK)] if full else []
    if numel > full * CHUNK:
        chunks.append(part[full * CHUNK :].view(1, -1))
    indices, values = [], []
    for chunk in chunks:  # the full chunks as one 2-D view, then the shorter last one
        keep = kept_per_chunk(chunk.shape[1])
        chosen = torch.topk(chunk.abs(), keep, dim=1, sorted=False).indices
        kept = torch.gather(chunk, 1, chosen)
        largest = kept.abs().argmax(dim=1, keepdim=True)
        spare = kept == 0
        chosen = torch.where(spare, torch.gather(chosen, 1, largest), chosen)
        kept = torch.where(spare, torch.gather(kept, 1, largest), kept)
        indices.append(chosen.reshape(-1))
        values.append(kept.reshape(-1))
    counts, _ = _chunk_counts(numel)
    if not indices:
        empty = torch.empty(0)
        return empty.to(torch.int16), empty, counts
    return torch.cat(indices).to(torch.int16), torch.cat(values), counts


def _chunk_bounds(magnitudes: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest and largest kept magnitude of every chunk (full chunks as one 2-D view)."""
    full = numel // CHUNK
    head = magnitudes[: full * KEEP].view(full, KEEP)
    lo, hi = head.amin(dim=1), head.amax(dim=1)
    if numel > full * CHUNK:
        tail = magnitudes[full * KEEP :]
        lo, hi = torch.cat([lo, tail.min().view(1)]), torch.cat([hi, tail.max().view(1)])
    return lo, hi


def _pack_indices(indices: np.ndarray) -> np.ndarray:
    """Pairs of 12-bit indices into three bytes each (an odd count padded with a zero index)."""
    values = indices.astype(np.uint16)
    if values.size % 2:
        values = np.append(values, np.uint16(0))
    first, second = values[0::2], values[1::2]
    packed = np.empty((first.size, 3), dtype=np.uint8)
    packed[:, 0] = first & 0xFF
    packed[:, 1] = (first >> 8) | ((second & 0xF) << 4)
    packed[:, 2] = second >> 4
    return packed.reshape(-1)


def _unpack_indices(packed: np.ndarray, count: int) -> np.ndarray:
    triples = packed.reshape(-1, 3).astype(np.uint16)
    first = triples[:, 0] | ((triples[:, 1] & 0xF) << 8)
    second = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
    return np.stack([first, second], axis=1).reshape(-1)[:count]


def _pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    per_byte = 8 // bits
    padded = np.zeros(-(-codes.size // per_byte) * per_byte, dtype=np.uint8)
    padded[: codes.size] = codes
    groups = padded.reshape(-1, per_byte)
    packed = np.zeros(groups.shape[0], dtype=np.uint8)
    for slot in range(per_byte):  # 2 or 4 slots: a loop over bit positions, not over values
        packed |= groups[:, slot] << (slot * bits)
    return packed


def _unpack_codes(packed: np.ndarray, count: int, bits: int) -> np.ndarray:
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    slots = [(packed >> (slot * bits)) & mask for slot in range(per_byte)]
    return np.stack(slots, axis=1).reshape(-1)[:count].copy()
