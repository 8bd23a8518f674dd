"""Peak memory of a syncer's core for GPT-2 small (124M parameters) as the number of learners grows.

    python -m benchmarks.syncer.memory --learners 2 16 --rounds 2

Each measurement runs in a fresh process: a `SyncerCore` with the decoupled defaults (P = 24, int4 up, int8 down)
adopts a zero model, M synthetic learners join, and for every round each fragment in turn gets one int4 push from
every learner and is closed (the results, chains of changes or full values, are made and dropped as the service
would after sending them). Reported: the process's peak RSS (`resource.getrusage`) over the model's fp32 size,
before (`baseline`: Python and torch loaded, model specs built) and at the end. The gRPC service is not included.
The model's shapes come from transformers' GPT2LMHeadModel(GPT2Config()) when transformers is importable.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess

import numpy as np
from benchmarks import child_env, module_command
from diloco.procs import die_with_parent
from benchmarks.provenance import stamped


def gpt2_specs():
    try:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        from diloco.algorithm.fragments import tensor_specs

        with torch.device("meta"):
            return tensor_specs(GPT2LMHeadModel(GPT2Config())), "transformers GPT2LMHeadModel(GPT2Config())"
    except ImportError:
        from diloco.algorithm.fragments import TensorSpec

        specs = [TensorSpec("wte", (50257, 768), "float32", True), TensorSpec("wpe", (1024, 768), "float32", True)]
        for layer in range(12):  # GPT-2 small's block shapes
            for name, shape in (("attn", (768, 2304)), ("proj", (768, 768)), ("fc", (768, 3072)), ("out", (3072, 768)),
                                ("b_attn", (2304,)), ("b_fc", (3072,)), ("ln", (4, 768))):
                specs.append(TensorSpec(f"h{layer}.{name}", shape, "float32"))
        return specs, "synthetic GPT-2 small shapes"


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def random_payload(numel: int, codec_name: str, rng):
    """A valid int8/int4 payload of random values built as bytes, as it arrives from the wire: encoding a float
    tensor here would add the benchmark's own temporaries to the syncer's peak."""
    import torch

    from diloco.algorithm import codec

    blocks = -(-numel // codec.BLOCK)
    scales = torch.full((blocks,), 1e-4, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    body = rng.integers(0, 256, codec.encoded_size(numel, codec_name) - len(scales), dtype=np.uint8)
    if codec_name == "int8":
        body = (body.view(np.int8) // 2).view(np.uint8)  # within the int8 codec's levels
    data = scales + body.tobytes()
    return codec.Encoded(codec_name, numel, data, codec.checksum(data))


def measure(learners: int, rounds: int) -> dict:
    import torch

    from diloco.config import for_mode
    from diloco.algorithm.fragments import fitted_layout
    from diloco.syncer.core import SyncerCore

    specs, source = gpt2_specs()
    model_bytes = 4 * sum(s.numel for s in specs if s.kind != "alias")
    baseline = peak_rss_bytes()
    cfg = for_mode("decoupled", learners, grace=0.0)
    # a clock that stands still: every push of a round arrives as it opens, so each round takes all of them (a push
    # arriving after a round was due would open the next one) until the forced poll
    core = SyncerCore(cfg, clock=lambda: 0.0)
    layout = fitted_layout(specs, cfg.fragments)
    core.initialize(specs, [torch.zeros(f.numel) for f in layout])
    sessions = {f"l{i}": core.join(f"l{i}", specs) for i in range(learners)}
    rng = np.random.default_rng(0)
    for seq in range(1, rounds + 1):
        for fs in core.fragments:
            if fs.fragment.role != "params":
                continue
            payload = random_payload(fs.fragment.numel, cfg.codec, rng)
            for lid, session in sessions.items():
                result = core.push(lid, session, seq, fs.fragment.index, fs.version, cfg.sync_every,
                                   100 * cfg.sync_every, payload)
                assert result.accepted, result.reason
            del payload
            assert core.poll(force=True)
    peak = peak_rss_bytes()
    return {"learners": learners, "rounds": rounds, "model": source, "fp32_model_bytes": model_bytes,
            "baseline_rss_bytes": baseline, "peak_rss_bytes": peak, "peak_over_model": round(peak / model_bytes, 2),
            "peak_above_baseline_over_model": round((peak - baseline) / model_bytes, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--learners", type=int, nargs="+", default=[2, 16])
    parser.add_argument("--rounds", type=int, default=2, help="rounds per fragment")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.child, args.rounds)))
        return
    results = []
    for m in args.learners:  # a process each, so that one's peak does not hide the next one's
        out = subprocess.run([*module_command(__spec__.name), "--child", str(m), "--rounds", str(args.rounds)],
                             check=True, capture_output=True, text=True, env=child_env(),
                             preexec_fn=die_with_parent()).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        r = results[-1]
        print(f"M = {m:3d}: peak RSS {r['peak_rss_bytes'] / 2**20:8.0f} MiB = {r['peak_over_model']:5.2f} × fp32 model "
              f"({r['fp32_model_bytes'] / 2**20:.0f} MiB); above the {r['baseline_rss_bytes'] / 2**20:.0f} MiB "
              f"baseline: {r['peak_above_baseline_over_model']:.2f} × model", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(stamped({"learners": results}, args), f, indent=2)


if __name__ == "__main__":
    main()
