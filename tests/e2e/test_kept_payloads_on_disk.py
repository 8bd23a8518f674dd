"""`--agreement-buffer`: a syncer keeps the agreement test's payloads of open rounds in memory up to a share of the
model, the rest in unnamed files in its state folder, read back only if a round is folded in anew and emptied as
rounds close; /status says how many bytes wait on disk."""

import torch

from diloco import GrpcTransport, Learner, ServerOptions, SyncerThread, for_mode
from liveness import wait_for
from syncers import wide


def test_payloads_beyond_the_buffer_wait_on_disk_until_their_round_closes(tmp_path):
    cfg = for_mode("decoupled", 2, fragments=2, sync_every=4, heartbeat_seconds=0.05)
    syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, out=tmp_path,
                                             agreement_buffer_share=1e-9))
    try:
        model = wide(seed=1)
        learner = Learner(model, GrpcTransport(syncer.address), "a")
        kept = syncer.service.core.kept_payloads
        assert kept.share == 1e-9 and kept.folder == tmp_path
        for _ in range(8):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p), alpha=1e-3)
            learner.step(16, loss=1.0)
        core = syncer.service.core
        wait_for(lambda: all(fs.version >= 1 for fs in core.fragments) and kept.spilled >= 2, timeout=30)
        assert kept.in_memory == 0  # every payload went to disk, none stayed in memory
        assert "kept_payloads_on_disk" in syncer.service.stats()
        learner.finish()
        wait_for(lambda: not any(fs.pending for fs in core.fragments), timeout=30)
        assert kept.on_disk == 0  # emptied as the rounds closed
    finally:
        syncer.stop()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tmp")]  # unnamed files: nothing left behind
