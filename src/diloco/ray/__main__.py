"""`python -m diloco.ray`: start a whole run on an existing Ray cluster and wait for it (docs/deploy.md, "Ray").

    python -m diloco.ray --address auto --state /data/diloco-syncer --syncer-resource site_a \\
        --island island-a:2:site_a --island island-b:1:site_b \\
        --syncer-args "--token s3cret --insecure --learners 2" --learner-args "--token s3cret --insecure --num-shards 2"

Island i gets `--shard i` unless --learner-args names a shard. Exits with the worst island's exit code.
"""

from __future__ import annotations

import argparse
import shlex
import sys


def island_spec(text: str):
    from diloco.ray.run import IslandSpec

    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or not parts[0] or (len(parts) > 1 and not parts[1].isdigit()):
        raise argparse.ArgumentTypeError(f"expected ID[:RANKS[:RESOURCE]], got {text!r}")
    return IslandSpec(parts[0], ranks=int(parts[1]) if len(parts) > 1 else 1,
                      resource=parts[2] if len(parts) > 2 and parts[2] else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m diloco.ray", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--address", default="auto", help="the Ray cluster (auto: the one this machine belongs to)")
    p.add_argument("--state", required=True, help="the syncer's state folder, on its node's disk")
    p.add_argument("--syncer-resource", help="custom resource pinning the syncer to a node (e.g. site_a)")
    p.add_argument("--listen-host", default="0.0.0.0", help="address the syncer binds (0.0.0.0)")
    p.add_argument("--island", type=island_spec, action="append", required=True, metavar="ID[:RANKS[:RESOURCE]]",
                   help="an island: its learner id, ranks (1) and the custom resource of its nodes; repeat")
    p.add_argument("--max-restarts", type=int, default=10, help="Ray restarts per rank (10)")
    p.add_argument("--syncer-args", default="", help="further `diloco syncer` flags, as one string")
    p.add_argument("--learner-args", default="", help="further `diloco learner` flags for every island, one string")
    args = p.parse_args(argv)

    from diloco.ray.run import start_run

    common = shlex.split(args.learner_args)
    for i, spec in enumerate(args.island):
        spec.max_restarts = args.max_restarts
        spec.learner_args = [*common, *([] if "--shard" in common else ["--shard", str(i)])]
    run = start_run(args.island, state=args.state, syncer_args=shlex.split(args.syncer_args),
                    syncer_resource=args.syncer_resource, listen_host=args.listen_host, address=args.address)
    print(f"syncer at {run.address}; status, probes and dashboard at http://{run.http_address}/", flush=True)
    try:
        codes = run.wait()
    except KeyboardInterrupt:
        print("stopping the run (the syncer's state stays in --state)", file=sys.stderr)
        run.stop()
        return 130
    for name, code in codes.items():
        print(f"island {name}: exit code {code}")
    return max(codes.values(), default=0)


if __name__ == "__main__":
    sys.exit(main())
