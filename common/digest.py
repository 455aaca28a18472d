"""Content hashes: one blake2b helper for every digest the library keys or names things by.

Why this file exists: plan keys, schedule and layout digests, agreement keys, the bridge's
configuration word and the worlds' group names are all short blake2b hashes of bytes, strings
or int64 arrays; they must be computed one way (the same bytes for the same content on every
rank), so that a digest is never two different hashes of one thing.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

__all__ = ["Digest"]


class Digest:
    """A blake2b hash of ``size`` bytes, fed part by part (:meth:`update`).

    A part is ``bytes``, a ``str`` (its UTF-8 bytes), a NumPy array or a CPU tensor (its
    elements' bytes, C order, in its own dtype).
    """

    __slots__ = ("_h", "size")

    def __init__(self, *parts: bytes | str | np.ndarray | torch.Tensor, size: int = 16) -> None:
        self.size = size
        self._h = hashlib.blake2b(digest_size=size)
        for part in parts:
            self.update(part)

    def update(self, part: bytes | str | np.ndarray | torch.Tensor) -> Digest:
        """Feed one more part; returns this digest."""
        if isinstance(part, np.ndarray):  # its buffer, read in place when it is C-ordered
            self._h.update((part if part.flags.c_contiguous else np.ascontiguousarray(part)).data)
        elif isinstance(part, str):
            self._h.update(part.encode())
        elif isinstance(part, torch.Tensor):
            self._h.update(np.ascontiguousarray(part.numpy()).data)
        else:
            self._h.update(part)
        return self

    def digest(self) -> bytes:
        """The hash's ``size`` bytes."""
        return self._h.digest()

    def hexdigest(self) -> str:
        """The hash in hex (``2 * size`` characters)."""
        return self._h.hexdigest()

    def word(self, *, bits: int | None = None) -> int:
        """The hash as a non-negative integer (little-endian), its top bits dropped down to
        ``bits`` (e.g. 62: an int64 word that stays positive)."""
        value = int.from_bytes(self._h.digest(), "little")
        return value if bits is None else value >> (8 * self.size - bits)
