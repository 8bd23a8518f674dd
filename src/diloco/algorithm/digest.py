"""Digests of a model's initial values, so that a learner which already holds them is not sent them again.

Learners that build the same model from the same seed, or load the same checkpoint, hold the global model's
initial values before they join. A joining learner sends one digest per tensor; the syncer skips every fragment
still at version 0 whose tensors all match, and the learner keeps its own values for it. The digest is BLAKE2b
over the tensor's values as fp32 (what a fragment carries), so an accidental match is out of reach, unlike CRC-32.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch

from diloco.algorithm.fragments import Fragment, TensorSpec, full

DIGEST_BYTES = 16


def values_digest(flat: torch.Tensor) -> bytes:
    """The digest of flat fp32 CPU values."""
    return hashlib.blake2b(flat.contiguous().numpy().data, digest_size=DIGEST_BYTES).digest()


def tensor_digests(specs: list[TensorSpec], state: dict[str, torch.Tensor]) -> list[bytes]:
    """One digest per spec, in spec order, of what a learner holds (empty for an alias, which is not sent)."""
    out = []
    for s in specs:
        if s.kind == "alias":
            out.append(b"")
            continue
        out.append(values_digest(full(state[s.name]).detach().reshape(-1).to("cpu", torch.float32)))
    return out


def fragment_digests(layout: Iterable[Fragment], flats: Iterable[torch.Tensor]) -> dict[str, bytes]:
    """Digests by tensor name of the fragments' flat fp32 values (the syncer's initial model)."""
    out, pieces = {}, {}
    for fragment, flat in zip(layout, flats):
        offset = 0
        for s in fragment.specs:
            values = flat[offset : offset + s.numel]
            if s.whole:
                out[s.name] = values_digest(values)
            else:  # a split tensor: its pieces in order, digested as the whole tensor's values
                pieces.setdefault(s.name, []).append((s.start, values))
            offset += s.numel
    for name, parts in pieces.items():
        h = hashlib.blake2b(digest_size=DIGEST_BYTES)
        for _, values in sorted(parts, key=lambda part: part[0]):
            h.update(values.contiguous().numpy().data)
        out[name] = h.digest()
    return out


def check_held(specs: list[TensorSpec], held: list[bytes]) -> dict[str, bytes]:
    """A joiner's digests by tensor name, after checking their shape: none, or one per spec of DIGEST_BYTES (an
    alias's may be empty). Raises ValueError saying what is wrong."""
    if not held:
        return {}
    if len(held) != len(specs):
        raise ValueError(f"{len(held)} value digests for {len(specs)} tensors: send one per tensor, or none")
    for s, d in zip(specs, held):
        if len(d) != DIGEST_BYTES and not (s.kind == "alias" and not d):
            raise ValueError(f"the digest of {s.name!r} has {len(d)} bytes, not {DIGEST_BYTES}")
    return {s.name: d for s, d in zip(specs, held) if s.kind != "alias"}


def held_fragments(fragments: Iterable[tuple[Fragment, int]], initial: dict[str, bytes],
                   held: dict[str, bytes]) -> set[int]:
    """The fragments a joiner already holds: still at version 0 (`fragments` gives each with its version), with
    every tensor's digest equal to the initial model's."""
    if not initial or not held:
        return set()
    return {f.index for f, version in fragments if version == 0 and f.specs
            and all(s.name in initial and held.get(s.name) == initial[s.name] for s in f.specs)}
