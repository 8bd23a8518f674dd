"""Durable state folders written by a real syncer core, and what a test of a tampered one checks."""

import hashlib
import json

import pytest
import torch

from diloco.algorithm.fragments import plan_fragments
from diloco.syncer.at_rest.state_key import StateKey
from diloco.syncer.at_rest.store import MANIFEST, StateError, StateStore, key_path
from cores import SPECS
from fakes import push_value, stored_core

def make_core(folder, recover=False, **overrides):
    """A core writing its state to `folder` (restored from it by `.restore()`)."""
    return stored_core(StateStore(folder, recover=recover), **overrides)


def run(folder, rounds=3, **overrides):
    """A core that initialised and closed `rounds` rounds of fragment 1 (one generation per round)."""
    core = make_core(folder, **overrides)
    core.initialize(SPECS, [torch.arange(f.numel, dtype=torch.float32) for f in plan_fragments(SPECS, 3)])
    session = core.join("a", SPECS)
    for seq in range(1, rounds + 1):
        push_value(core, "a", session, seq)
        assert core.poll()
    return core, session


def manifest(folder, name=MANIFEST):
    return json.loads((folder / name).read_text())


def rehash(folder, name):
    """Record a file's current size and hash in the manifest, signed with the state key: a forger holding the key
    (or a bug in the syncer itself) still meets the checks behind the signature. Without the key: test_state_at_rest."""
    m = manifest(folder)
    data = (folder / name).read_bytes()
    m["integrity"][name] = [len(data), hashlib.sha256(data).hexdigest()]
    (folder / MANIFEST).write_text(json.dumps(StateKey(key_path(folder)).sign(m)))


def refused(folder) -> str:
    with pytest.raises(StateError) as e:
        make_core(folder).restore()
    return str(e.value)
