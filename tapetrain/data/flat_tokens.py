"""FlatTokenFile: LongLoRA-style evaluation data, a headerless file of raw token ids (e.g. Llama-2 uint16)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from tapetrain.data.errors import DataError


class FlatTokenFile:
    """Memory-maps `path` as a flat array of `dtype` ids; optional check that every id < vocab_size."""

    def __init__(self, path: str, dtype: np.dtype | type = np.uint16, vocab_size: int | None = None):
        self.path = path
        self.dtype = np.dtype(dtype).newbyteorder("<")  # LongLoRA files are little-endian
        if not os.path.isfile(path):
            raise DataError(f"token file {path} does not exist; check the eval data path (LongLoRA's "
                            "proof-pile test set is a flat .bin of uint16 Llama-2 ids)")
        size = os.path.getsize(path)
        if size % self.dtype.itemsize:
            raise DataError(f"token file {path} is {size} bytes, not a multiple of {self.dtype.itemsize} "
                            f"({self.dtype.name}): it is truncated or not {self.dtype.name}; pass the dtype "
                            "it was written with")
        if size == 0:
            raise DataError(f"token file {path} is empty; regenerate it")
        self.tokens: np.ndarray = np.memmap(path, dtype=self.dtype, mode="r")
        if vocab_size is not None:
            self.check_vocab(vocab_size)

    def check_vocab(self, vocab_size: int, block: int = 1 << 24) -> None:
        """Raise DataError naming the first id >= vocab_size (scans in blocks to bound memory)."""
        for start in range(0, len(self.tokens), block):
            part = self.tokens[start:start + block]
            if int(part.max()) >= vocab_size:
                pos = start + int(np.argmax(part >= vocab_size))
                raise DataError(f"token file {self.path} holds id {int(self.tokens[pos])} at position {pos} "
                                f"but vocab_size is {vocab_size}; use the tokenizer/model the file was made "
                                "for")

    def __len__(self) -> int:
        return len(self.tokens)

    def num_windows(self, seq_len: int, stride: int | None = None) -> int:
        stride = stride or seq_len
        return max(0, (len(self.tokens) - seq_len - 1) // stride + 1)

    def windows(self, seq_len: int, stride: int | None = None) -> Iterator[np.ndarray]:
        """Yield (seq_len + 1,) int64 windows starting at 0, stride, 2*stride, ...

        stride defaults to seq_len (non-overlapping); inputs w[:-1], labels w[1:]; the incomplete tail is
        dropped.
        """
        if seq_len < 1 or (stride is not None and stride < 1):
            raise DataError(f"seq_len ({seq_len}) and stride ({stride}) must be >= 1")
        stride = stride or seq_len
        for i in range(self.num_windows(seq_len, stride)):
            yield self.tokens[i * stride:i * stride + seq_len + 1].astype(np.int64)
