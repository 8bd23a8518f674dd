"""diloco on Ray (optional extra `ray`: `pip install 'diloco[ray]'`): the syncer as an actor pinned to a node, each
island as a placement group of rank actors, restarted by Ray and rejoining under its id (docs/deploy.md, "Ray").

    from diloco.ray import IslandSpec, start_run
    run = start_run([IslandSpec("site-a", ranks=2, resource="site_a"), IslandSpec("site-b", resource="site_b")],
                    state="/data/diloco-state", syncer_resource="site_a", address="auto")
    print(run.wait())

Importing `diloco` never imports Ray; importing `diloco.ray` does.
"""

try:
    import ray  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("diloco.ray needs Ray: pip install 'diloco[ray]'") from e

from diloco.ray.run import IslandSpec, RayRun, start_island, start_run, start_syncer

__all__ = ["IslandSpec", "RayRun", "start_island", "start_run", "start_syncer"]
