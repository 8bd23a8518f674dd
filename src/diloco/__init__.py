"""Decoupled DiLoCo: many independent learners, one central syncer, one model.

The public API is imported lazily so that `diloco --help` does not pay for torch and gRPC.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "Learner": "diloco.learner.learner",
    "GrpcTransport": "diloco.learner.grpc_transport",
    "ShardedTransport": "diloco.learner.sharded",
    "LocalSyncer": "diloco.learner.transport",
    "LocalTransport": "diloco.learner.transport",
    "SyncerError": "diloco.learner.transport",
    "SyncConfig": "diloco.config",
    "for_mode": "diloco.config",
    "SyncerThread": "diloco.syncer.server",
    "ServerOptions": "diloco.syncer.server",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'diloco' has no attribute {name!r}")
