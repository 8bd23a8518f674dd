"""A learner's connection to N syncer shards: shard i serves the fragments p with p mod N = i.

Each shard gets its own GrpcTransport (its own threads, so a slow or dead shard never holds up the others'
fragments); they share one Receiver, so merged fragments from every shard reach the Learner as from one syncer.
Every shard hears every heartbeat, so each keeps the whole membership and the same token counts: budget and stop
are decided alike everywhere, and the learner stops when any shard says so."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from diloco.algorithm.fragments import TensorSpec
from diloco.learner.grpc_transport import GrpcTransport
from diloco.learner.transport import Arrival, JoinInfo, PushJob, Receiver, SyncerError
from diloco.algorithm.schedule import leading_position


class ShardedTransport:
    """Connects a Learner to the syncer shards at `addresses`, in shard order (shard i first at position i).
    Keyword arguments are GrpcTransport's, applied to every shard."""

    def __init__(self, addresses: list[str], **options):
        if not addresses:
            raise ValueError("ShardedTransport needs the address of every syncer shard")
        self.shards = [GrpcTransport(address, **options) for address in addresses]
        self.receiver = Receiver()
        for i, shard in enumerate(self.shards):
            shard.receiver = self.receiver
            shard.keeps_initial = lambda fragment, i=i: fragment % len(self.shards) == i  # its own fragments only

    def _of(self, fragment: int) -> GrpcTransport:
        return self.shards[fragment % len(self.shards)]

    def join(self, learner_id: str, specs: list[TensorSpec], initial) -> JoinInfo:
        infos = []
        try:
            for shard in self.shards:
                infos.append(shard.join(learner_id, specs, initial))
            return self._joined(infos)
        except SyncerError:
            for shard in self.shards[: len(infos)]:  # leave the shards it joined: no session left behind
                try:
                    shard.close(timeout=shard.rpc_timeout)
                except SyncerError:
                    pass
            raise

    def _joined(self, infos: list[JoinInfo]) -> JoinInfo:
        first = infos[0]
        for i, info in enumerate(infos[1:], 1):
            if info.config != first.config:
                raise SyncerError(f"syncer shards disagree on the run's configuration (shard 0 at "
                                  f"{self.shards[0].address}, shard {i} at {self.shards[i].address}): start every "
                                  f"shard with the same settings, and give the learner their addresses in shard order")
        fragments = sorted((f for info in infos for f in info.fragments), key=lambda f: f[0])
        wrong = [index for i, info in enumerate(infos) for index, _, _ in info.fragments
                 if index % len(self.shards) != i]
        if wrong or len(fragments) != first.config.fragments:
            raise SyncerError(f"the syncers at {', '.join(s.address for s in self.shards)} do not serve the "
                              f"{first.config.fragments} fragments as shards 0..{len(self.shards) - 1} in this order "
                              f"(fragments {sorted(f[0] for f in fragments)}); check each syncer's --shard")
        self.receiver.reset(fragments, keep_overlap=first.config.keep_overlap)
        # each shard records where this learner's merged work on its fragments ended: resume at the earliest, so
        # no data is skipped (a little is read again)
        return JoinInfo(first.config, first.session, fragments, min(info.data_position for info in infos),
                        leading_position([info.start_position for info in infos], first.config.sync_every))

    def push(self, job: PushJob) -> None:
        self._of(job.fragment).push(job)

    def arrivals(self, timeout: float | None = None) -> list[Arrival]:
        for shard in self.shards:
            shard.check()
        return self.receiver.drain(timeout)

    def report(self, **progress) -> None:
        for shard in self.shards:
            shard.report(**progress)

    @property
    def stop_requested(self) -> bool:
        return any(shard.stop_requested for shard in self.shards)

    @property
    def budget_progress(self) -> float | None:
        known = [p for p in (shard.budget_progress for shard in self.shards) if p is not None]
        return max(known) if known else None

    def take_phase_lead(self) -> float | None:
        leads = [shard.take_phase_lead() for shard in self.shards]
        return leads[0]  # every shard sees the same schedule; the first speaks for them

    @property
    def wire_bytes(self) -> int:
        return sum(shard.wire_bytes for shard in self.shards)

    @property
    def error(self) -> SyncerError | None:
        return next((shard.error for shard in self.shards if shard.error is not None), None)

    def close(self, timeout: float | None = 300.0) -> None:
        """Every shard's close at once (each waits for its own pushes), so the whole takes `timeout` at most."""
        with ThreadPoolExecutor(len(self.shards)) as pool:
            outcomes = list(pool.map(lambda shard: self._close_one(shard, timeout), self.shards))
        errors = [e for e in outcomes if e]
        if errors:
            raise SyncerError("; ".join(errors))

    @staticmethod
    def _close_one(shard: GrpcTransport, timeout: float | None) -> str | None:
        try:
            shard.close(timeout)
        except SyncerError as e:
            return f"shard at {shard.address}: {e}"
        return None
