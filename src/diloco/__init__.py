"""Decoupled DiLoCo: many independent learners, one central syncer, one model.

The public API is imported here, eagerly, so that editors and type checkers resolve `from diloco import Learner`.
That costs torch and gRPC, which is why the `diloco` console script (diloco_cli) reads the command line without
running this file: `diloco --help` answers without them.
"""

__version__ = "0.1.0"

import os

# gRPC's fork support restarts its poller in a forked child; a child that closes its descriptors before exec
# (subprocess with preexec_fn, as `diloco run` starts its processes) then aborts in that poller: about 1 such start
# in 20 while a Learner's channel is live (grpc/grpc#43055). Nothing here uses gRPC in a forked child, so it is off
# unless the process set it. gRPC reads it at its first import: a process that imported grpc before diloco keeps
# what it had.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from diloco.config import SyncConfig, for_mode  # noqa: E402  (after the setting above: gRPC reads it at import)
from diloco.inprocess import LocalSyncer, LocalTransport
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.learner.sharded import ShardedTransport
from diloco.learner.transport import SyncerError
from diloco.syncer.serving.server import ServerOptions, SyncerThread

__all__ = [
    "GrpcTransport",
    "Learner",
    "LocalSyncer",
    "LocalTransport",
    "ServerOptions",
    "ShardedTransport",
    "SyncConfig",
    "SyncerError",
    "SyncerThread",
    "for_mode",
]
