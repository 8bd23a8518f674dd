"""Byte-level tokenizer: token ids are the UTF-8 bytes of the text, so it needs no training and no files."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        """UTF-8 bytes of text as a uint8 array."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: np.ndarray | torch.Tensor | Sequence[int]) -> str:
        """Text for ids; bytes that do not form valid UTF-8 (e.g. a cut multi-byte character) become U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
        arr = np.asarray(ids).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"byte token ids must be in 0..255, got {arr.min()}..{arr.max()}")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
