"""A joiner that already holds the initial model (same seed, same checkpoint) is not sent it again: its digests
say so, the syncer skips every fragment still at version 0 that matches, and anything else is sent as before."""

import logging

import grpc
import pytest
import torch

from diloco.algorithm.digest import DIGEST_BYTES, check_held, fragment_digests, held_fragments, tensor_digests
from diloco.algorithm.fragments import TensorSpec, gather, plan_fragments, tensor_specs
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.initial import InitialModel
from diloco.learner.learner import Learner
from diloco.learner.transport import SyncerError
from diloco.wire import diloco_pb2 as pb
from diloco.wire.messages import specs_to_proto

from liveness import wait_for
from rpc import join_replies
from syncers import model_bytes, params, proxy_to, same, syncer_running, wide

pytestmark = pytest.mark.timeout(120)


def test_digests_match_exactly_the_same_values_and_only_fragments_at_version_0():
    model = wide(seed=1)
    specs = tensor_specs(model)
    state = dict(model.state_dict())
    layout = plan_fragments(specs, 2)
    initial = fragment_digests(layout, [gather(state, f) for f in layout])
    held = check_held(specs, tensor_digests(specs, state))
    assert held == initial and all(len(d) == DIGEST_BYTES for d in held.values())
    assert held_fragments([(f, 0) for f in layout], initial, held) == {0, 1}
    assert held_fragments([(layout[0], 0), (layout[1], 3)], initial, held) == {0}  # moved on: sent
    state["1.bias"] = state["1.bias"].clone()
    state["1.bias"][7] += 2.0 ** -20  # one value, one ulp-scale step: a different model
    changed = check_held(specs, tensor_digests(specs, state))
    owner = next(f.index for f in layout if any(s.name == "1.bias" for s in f.specs))
    assert held_fragments([(f, 0) for f in layout], initial, changed) == {0, 1} - {owner}
    assert held_fragments([(f, 0) for f in layout], {}, held) == set()  # a syncer without digests sends all


def test_malformed_digests_are_refused_with_what_is_wrong():
    specs = [TensorSpec("w", (2,), "float32"), TensorSpec("head", (2,), "float32", kind="alias", alias_of="w")]
    assert check_held(specs, [b"x" * DIGEST_BYTES, b""]) == {"w": b"x" * DIGEST_BYTES}
    with pytest.raises(ValueError, match="1 value digests for 2 tensors"):
        check_held(specs, [b"x" * DIGEST_BYTES])
    with pytest.raises(ValueError, match="digest of 'w' has 3 bytes, not 16"):
        check_held(specs, [b"abc", b""])
    with pytest.raises(ValueError, match="digest of 'w' has 0 bytes"):
        check_held(specs, [b"", b""])


def test_learners_with_the_same_initial_model_download_none_of_it(caplog):
    caplog.set_level(logging.INFO, logger="diloco")
    size = model_bytes(wide(seed=1))
    with syncer_running() as syncer, proxy_to(syncer.address) as p0, proxy_to(syncer.address) as p1, \
            proxy_to(syncer.address) as p2:
        first = Learner(wide(seed=1), GrpcTransport(p0.address), "a")  # uploads it, and is not sent it back
        assert p0.bytes_up >= size and p0.bytes_down < size / 10
        twin_model = wide(seed=1)
        twin = Learner(twin_model, GrpcTransport(p1.address), "b")  # built the same way: nothing to download
        assert p1.bytes_down < size / 10 and p1.bytes_up < size / 10
        assert same(params(twin_model), params(wide(seed=1)))
        assert "learner b holds 2 of 2 fragments already: not sent" in caplog.text
        other_model = wide(seed=2)
        other = Learner(other_model, GrpcTransport(p2.address), "c")  # different values: sent the whole model
        assert p2.bytes_down >= size
        assert same(params(other_model), params(wide(seed=1)))
        for learner in (first, twin, other):
            learner.close()


def test_a_fragment_that_moved_on_is_sent_to_a_joiner_holding_the_initial_values():
    with syncer_running(heartbeat_seconds=0.05) as syncer:
        model = wide(seed=1)
        learner = Learner(model, GrpcTransport(syncer.address), "a")
        for _ in range(4):  # H = 4, P = 2: both fragments are pushed and merged at least once
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)
            learner.step(16, loss=1.0)
        wait_for(lambda: all(fs.version >= 1 for fs in syncer.service.core.fragments), timeout=30)
        late_model = wide(seed=1)
        late = Learner(late_model, GrpcTransport(syncer.address), "b")
        assert not same(params(late_model), params(wide(seed=1)))  # it was sent what the rounds made
        state = dict(late_model.state_dict())
        for fs in syncer.service.core.fragments:  # what learners hold (P), bit for bit
            assert torch.equal(gather(state, fs.fragment), fs.values), fs.fragment.index
        late.close()
        learner.close()


def test_bad_digests_over_the_wire_are_refused_and_the_syncer_goes_on():
    with syncer_running() as syncer:
        model = wide(seed=1)
        learner = Learner(model, GrpcTransport(syncer.address), "a")
        specs = specs_to_proto(tensor_specs(model))
        for held, why in (([b"x" * 16], "1 value digests for 3 tensors"),
                          ([b"x" * 16, b"y" * 500, b"z" * 16], "'1.weight' has 500 bytes")):
            with pytest.raises(grpc.RpcError) as e:
                join_replies(syncer.address, pb.JoinRequest(learner_id="h", specs=specs, held=held))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details()
        assert Learner(wide(seed=1), GrpcTransport(syncer.address), "b")  # still serving
        learner.close()


def test_a_learner_refuses_a_held_mark_it_cannot_honour():
    model = wide(seed=1)
    specs = tensor_specs(model)
    transport = GrpcTransport("127.0.0.1:9")  # never connected: only the check runs
    header = pb.JoinHeader(config_json=syncer_config_json(fragments=2), fragments=2)
    initial = InitialModel(specs, dict(model.state_dict()))
    numel = initial(2).flat(1).numel()
    sent = pb.JoinRequest(held=initial.digests())
    assert torch.equal(transport._held(pb.Blob(fragment=1, numel=numel, held=True), header, sent, initial)[2],
                       initial(2).flat(1))
    for blob, request in ((pb.Blob(fragment=1, numel=numel, held=True), pb.JoinRequest()),  # we sent no digests
                          (pb.Blob(fragment=1, version=3, numel=numel, held=True), sent),  # not the initial values
                          (pb.Blob(fragment=2, numel=numel, held=True), sent),  # no such fragment
                          (pb.Blob(fragment=1, numel=numel + 1, held=True), sent)):  # another model
        with pytest.raises(SyncerError, match="faulty"):
            transport._held(blob, header, request, initial)
    transport.channel.close()


def syncer_config_json(**kw) -> str:
    from diloco.config import for_mode

    return for_mode("decoupled", 2, sync_every=4, **kw).to_json()


def save_model(model, path):
    from safetensors.torch import save_file

    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def test_a_syncer_started_from_a_checkpoint_needs_no_upload_and_sends_nothing_to_its_holders(tmp_path):
    checkpoint = save_model(wide(seed=3), tmp_path / "model.safetensors")
    size = model_bytes(wide(seed=3))
    with syncer_running(initial_model=checkpoint) as syncer, proxy_to(syncer.address) as p0, \
            proxy_to(syncer.address) as p1:
        first = Learner(wide(seed=3), GrpcTransport(p0.address), "a")  # loaded the same checkpoint
        assert p0.bytes_up < size / 10 and p0.bytes_down < size / 10
        other_model = wide(seed=4)
        other = Learner(other_model, GrpcTransport(p1.address), "b")  # the checkpoint, downloaded
        assert p1.bytes_up < size / 10 and p1.bytes_down >= size
        assert same(params(other_model), params(wide(seed=3)))
        first.close()
        other.close()


def test_a_model_the_checkpoint_does_not_fit_is_refused_with_what_differs(tmp_path):
    checkpoint = save_model(wide(seed=3), tmp_path / "model.safetensors")
    with syncer_running(initial_model=checkpoint) as syncer:
        with pytest.raises(SyncerError, match=r"does not match the syncer's --initial-model model.safetensors: tensor "
                                              r"'0.weight' is \[16, 1024\] in the file and \[8, 4\] in the model"):
            Learner(small_model(), GrpcTransport(syncer.address, connect_timeout=2), "x")
        learner = Learner(wide(seed=3), GrpcTransport(syncer.address), "a")  # the file waited for a model it fits
        learner.close()


def test_unreadable_checkpoints_are_refused_at_start(tmp_path):
    from diloco.syncer.at_rest.initial_model import load

    with pytest.raises(ValueError, match="no such file"):
        load(tmp_path / "absent.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load(tmp_path / "junk.safetensors")
    model = wide(seed=3)
    with torch.no_grad():
        model[1].bias[0] = float("nan")
    with pytest.raises(ValueError, match="tensor '1.bias' holds NaN or Inf"):
        load(save_model(model, tmp_path / "nan.safetensors"))


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
