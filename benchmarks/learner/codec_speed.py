"""How fast a fragment's Δ is encoded and a change decoded, on one host thread or on a GPU: the payload's bytes made
from base − θ by `codec.encode_into` (the host codec and a device-codec learner's alike), and a change decoded a
chunk at a time into a reused buffer (a keep-overlap apply).

    python -m benchmarks.learner.codec_speed                      # 16M values (a 64 MB fragment), CPU
    python -m benchmarks.learner.codec_speed --device cuda         # the same on a GPU (decoding is host-only)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from diloco.algorithm import codec
from diloco.learner.staging import DEVICE_STEP


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--values", type=int, default=16_000_000, help="values in the fragment (16M)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is shown (5)")
    args = p.parse_args(argv)
    if args.values <= 0 or args.repeats <= 0:
        p.error("--values and --repeats must be positive")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    torch.set_num_threads(1)
    g = torch.Generator(device=device).manual_seed(0)
    base, theta = (torch.randn(args.values, generator=g, device=device) for _ in range(2))
    step = DEVICE_STEP if device.type == "cuda" else codec.CHUNK_BLOCKS * codec.BLOCK
    print(f"{args.values:,} values on {device}, median of {args.repeats}:")
    for name in codec.CODECS:
        out = torch.empty(codec.encoded_size(args.values, name), dtype=torch.uint8, device=device)
        ms = median_ms(lambda: codec.encode_into(args.values, lambda lo, hi: base[lo:hi] - theta[lo:hi], name, out,
                                                 step), device, args.repeats)
        line = f"  {name:5s} encode Δ {ms:7.1f} ms"
        if name in ("int8", "int4"):
            payload = codec.encode(base.cpu(), name)
            chunk = torch.empty(codec.chunk_scratch(args.values))
            decode = median_ms(lambda: [None for _ in codec.decoded_chunks(payload, chunk)], torch.device("cpu"),
                               args.repeats)
            line += f", decode into a reused chunk {decode:6.1f} ms (host)"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
