"""Weights as what changed: a packed bucket (:func:`~trl_nrollout.rollout.ranks.buckets.pack_bucket`'s flat byte
buffer, in the engine's dtype) encoded against the same bucket of the version the receivers hold, as whichever of
three forms is smallest:

- ``full``: the buffer itself (``B`` bytes);
- ``indices``: the positions of the changed words (int32) and their new words (``6 k`` bytes for ``k`` changed
  bf16 words);
- ``mask``: one bit per word, set where it changed, and the changed words (about ``B / 16 + 2 k`` bytes for bf16).

A *word* is 2 bytes when the buffer's length is even (every engine dtype of a weight is 2 or 4 bytes wide and the
packing aligns each tensor), else 1 byte: comparing words bit for bit is exact for any dtype, so decoding restores the
new buffer bit for bit (a 4-byte float whose low half changed sends one word). Nothing here knows about tensors'
names or shapes: the layout travels as it does for a full bucket.

With Adam, an optimizer step moves every float32 master weight, but the engine keeps bf16 (8 bits of mantissa): a
weight's bf16 value changes only when the update crosses a rounding boundary, so at the small learning rates of RL
(1e-6) most words stay the same from one version to the next; at a large one, or for an adapter merged into every
weight, most change and ``full`` is sent."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_CHUNK = 1 << 22  # words per slice of the checksum (32 MiB of int64 at a time)
#: encodings, in the order they are tried on a tie (the simplest first)
FULL, INDICES, MASK = "full", "indices", "mask"


@dataclass(frozen=True)
class DeltaHeader:
    """How one bucket's data travels: ``kind`` (``full``, ``indices`` or ``mask``), the bucket's size in bytes
    ``size`` (what the receiver's buffer holds after decoding), the word width ``word`` (1 or 2 bytes), the number of
    changed words ``changed`` and the bytes on the wire ``wire``."""

    kind: str
    size: int
    word: int
    changed: int
    wire: int
    checksum: int = 0


def checksum(buf: Tensor) -> int:
    """A position-weighted sum of ``buf``'s bytes (uint8 ``[B]``): a decoded bucket must give the sender's, so a
    word put at the wrong place, dropped or decoded against another version's copy is caught (int64, wraps)."""
    words = buf.view(torch.int32) if buf.numel() % 4 == 0 else buf
    total = 0
    for start in range(0, words.numel(), _CHUNK):  # a bounded int64 temporary per slice
        part = words[start:start + _CHUNK].to(torch.int64)
        total += int((part * (torch.arange(start, start + part.numel(), dtype=torch.int64) % 65521 + 1)).sum())
    return total


def word_width(size: int) -> int:
    """2 bytes per word for an even-sized buffer, else 1."""
    return 2 if size % 2 == 0 else 1


def _words(buf: Tensor, word: int) -> Tensor:
    """``buf`` (uint8 ``[B]``) as words ``[B / word]`` (int16 or uint8), a view."""
    return buf.view(torch.int16) if word == 2 else buf


def wire_bytes(kind: str, size: int, word: int, changed: int) -> int:
    """Bytes one bucket of ``size`` bytes takes on the wire in ``kind`` with ``changed`` words changed."""
    if kind == FULL:
        return size
    words = size // word
    if kind == INDICES:
        return changed * (4 + word)
    return mask_bytes(words) + changed * word


def mask_bytes(words: int) -> int:
    """Bytes of the bit mask over ``words`` words: one bit each, rounded up to 4 bytes (the words after it stay
    aligned)."""
    return (words + 31) // 32 * 4


def encode(prev: Tensor | None, new: Tensor) -> tuple[DeltaHeader, Tensor]:
    """``new`` (uint8 ``[B]``, a packed bucket) against ``prev`` (the receivers' copy of the same bucket, or None
    when they hold none): the smallest encoding's header and its bytes (uint8 ``[wire]``)."""
    size = new.numel()
    word = word_width(size)
    if prev is None or prev.numel() != size:
        return DeltaHeader(FULL, size, word, size // word, size, checksum(new)), new
    new_w, prev_w = _words(new, word), _words(prev, word)
    changed = new_w != prev_w  # bit for bit: int words, no float comparison (NaN, -0.0)
    k = int(changed.sum())
    costs = {kind: wire_bytes(kind, size, word, k) for kind in (FULL, INDICES, MASK)}
    kind = min(costs, key=lambda c: (costs[c], (FULL, INDICES, MASK).index(c)))
    header = DeltaHeader(kind, size, word, k, costs[kind], checksum(new))
    if kind == FULL:
        return header, new
    values = new_w[changed].contiguous().view(torch.uint8)
    if kind == INDICES:
        where = changed.nonzero().reshape(-1).to(torch.int32).view(torch.uint8)
        return header, torch.cat([where, values])
    bits = torch.zeros(mask_bytes(changed.numel()) * 8, dtype=torch.bool)
    bits[:changed.numel()] = changed
    packed = (bits.view(-1, 8).to(torch.uint8) << torch.arange(8, dtype=torch.uint8)).sum(1, dtype=torch.uint8)
    return header, torch.cat([packed, values])


def decode(header: DeltaHeader, data: Tensor, prev: Tensor | None) -> Tensor:
    """The new bucket (uint8 ``[header.size]``) from ``data`` (uint8 ``[header.wire]``) and the receiver's copy
    ``prev``, updated in place for ``indices`` and ``mask`` (and returned); a ``full`` bucket is ``data`` itself."""
    out = _apply(header, data, prev)
    if header.checksum and checksum(out) != header.checksum:
        raise RuntimeError(f"a weights bucket of {header.size} bytes sent as {header.kind} ({header.changed} changed "
                           "words) decoded to other bytes than the trainer sent (checksum): the receiver's copy is "
                           "not the version the sender encoded against; set weight_sync_delta=False to send whole "
                           "buckets, and report it")
    return out


def _apply(header: DeltaHeader, data: Tensor, prev: Tensor | None) -> Tensor:
    """:func:`decode` without the check."""
    if header.kind == FULL:
        return data
    if prev is None or prev.numel() != header.size:
        raise RuntimeError(f"a {header.kind} weight delta of {header.size} bytes reached a receiver that holds "
                           f"{'no copy' if prev is None else f'{prev.numel()} bytes'} of the bucket: the sender "
                           "sends deltas only to receivers that hold the previous version")
    word, k = header.word, header.changed
    words = _words(prev, word)
    if header.kind == INDICES:
        where = data[:4 * k].view(torch.int32).long()
        words[where] = _words(data[4 * k:], word)
        return prev
    n = header.size // word
    at = mask_bytes(n)
    bits = (data[:at].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1
    changed = bits.reshape(-1)[:n].bool()
    words[changed] = _words(data[at:], word)
    return prev
