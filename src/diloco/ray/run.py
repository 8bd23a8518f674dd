"""A whole diloco run on an existing Ray cluster, from one call: `start_run(...)` (or `python -m diloco.ray`).

The syncer is an actor pinned to the node that holds `syncer_resource` (a custom resource such as `site_a`, given
to that node with `ray start --resources`), with its state on that node's disk; each island is a placement group
with one bundle per rank (on the nodes holding the island's resource), whose actors form the island's gloo group.
A dead rank makes its island restart under Ray's `max_restarts`, and the island rejoins under its id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from diloco.ray.actors import RankActor, SyncerActor

PIN = 0.001
"""How much of a site's custom resource each actor asks for: any amount pins it to a node that has the resource."""


@dataclass
class IslandSpec:
    """One learner of `ranks` ranks."""

    id: str
    """The learner id; a restarted island rejoins under it and resumes its data."""
    ranks: int = 1
    """Ranks (processes) of the island, one CPU (or `gpus_per_rank` GPUs) each, in one gloo group."""
    resource: str | None = None
    """A custom resource of the nodes the island must run on (e.g. "site_b"); None: anywhere."""
    learner_args: list[str] = field(default_factory=list)
    """Further `diloco learner` flags: --shard, --num-shards, --train-config, --max-steps, --token, ..."""
    max_restarts: int = 10
    """How many times Ray may restart each of the island's ranks."""
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    strategy: str = "PACK"
    """Placement group strategy: PACK (ranks on as few nodes as possible) or SPREAD / STRICT_SPREAD."""


@dataclass
class Island:
    spec: IslandSpec
    group: object
    ranks: list
    master: tuple[str, int]
    runs: list
    pids: list[int]
    """Each rank's first process id (a restarted rank gets a new one; its log says which)."""


@dataclass
class RayRun:
    """A started run: its syncer actor and islands. `wait()` for the islands, `stop()` to end everything."""

    syncer: object
    address: str
    http_address: str
    islands: dict[str, Island]

    def wait(self, timeout: float | None = None) -> dict[str, int]:
        """Each island's exit code (diloco/exits.py) once every island has ended."""
        refs = {name: island.runs[0] for name, island in self.islands.items()}  # the leader's code is the island's
        return dict(zip(refs, ray.get(list(refs.values()), timeout=timeout)))

    def stop(self) -> None:
        """End the islands and the syncer at once (no last pushes; every merged round is already durable in the
        syncer's state on its node's disk) and free their placement groups."""
        for island in self.islands.values():
            for rank in island.ranks:
                ray.kill(rank, no_restart=True)
            remove_placement_group(island.group)
        ray.kill(self.syncer, no_restart=True)


def start_syncer(state: str, syncer_args: list[str], resource: str | None = None, listen_host: str = "0.0.0.0",
                 max_restarts: int = -1):
    """The syncer actor, pinned to a node holding `resource`; Ray restarts it there on its state (resumed)."""
    options = {"max_restarts": max_restarts, "max_task_retries": -1}
    if resource:
        options["resources"] = {resource: PIN}
    return SyncerActor.options(**options).remote(state, syncer_args, listen_host)


def start_island(spec: IslandSpec, syncer, address: str, log_dir: str = "/tmp/diloco-ray-logs") -> Island:
    """Place the island's ranks, form their group at rank 0's node and start `diloco learner` on every rank."""
    bundle = {"CPU": spec.cpus_per_rank}
    if spec.gpus_per_rank:
        bundle["GPU"] = spec.gpus_per_rank
    if spec.resource:
        bundle[spec.resource] = PIN
    group = placement_group([dict(bundle) for _ in range(spec.ranks)], strategy=spec.strategy)
    ray.get(group.ready())
    ranks = [RankActor.options(
        max_restarts=spec.max_restarts, max_task_retries=-1, num_cpus=spec.cpus_per_rank, num_gpus=spec.gpus_per_rank,
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
    ).remote(spec.id, i, spec.ranks, syncer, log_dir) for i in range(spec.ranks)]
    master = ray.get(ranks[0].endpoint.remote())
    pids = ray.get([rank.pid.remote() for rank in ranks])  # asked now: a rank answers nothing else while it trains
    args = ["--syncer", address, *spec.learner_args]
    runs = [rank.run.remote(master, args) for rank in ranks]
    return Island(spec, group, ranks, master, runs, pids)


def start_run(islands: list[IslandSpec], state: str, syncer_args: list[str] | None = None,
              syncer_resource: str | None = None, listen_host: str = "0.0.0.0", address: str | None = None) -> RayRun:
    """Start a syncer and every island on the Ray cluster at `address` (None: the one this process is connected
    to, or `ray.init()`'s default); returns at once with the run under way."""
    if not ray.is_initialized():
        ray.init(address=address)
    syncer = start_syncer(state, syncer_args or [], syncer_resource, listen_host)
    grpc_address, http_address = ray.get([syncer.address.remote(), syncer.http_address.remote()])
    started = {spec.id: start_island(spec, syncer, grpc_address) for spec in islands}
    return RayRun(syncer, grpc_address, http_address, started)
