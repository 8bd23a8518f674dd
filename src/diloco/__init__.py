"""Decoupled DiLoCo: many independent learners, one central syncer, one model.

The public API is imported here, eagerly, so that editors and type checkers resolve `from diloco import Learner`.
That costs torch and gRPC, which is why the `diloco` console script (diloco_cli) reads the command line without
running this file: `diloco --help` answers without them.
"""

__version__ = "0.1.0"

from diloco.config import SyncConfig, for_mode
from diloco.inprocess import LocalSyncer, LocalTransport
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.learner import Learner
from diloco.learner.sharded import ShardedTransport
from diloco.learner.transport import SyncerError
from diloco.syncer.server import ServerOptions, SyncerThread

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
