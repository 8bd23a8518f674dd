"""Screenshot of the syncer's dashboard during a short run, for docs/dashboard.png (needs Debian's `chromium`).

    python scripts/dashboard_screenshot.py [--seconds 20] [--out docs/dashboard.png]

A syncer on loopback and three learners in threads (one at half speed) train a small model; after --seconds the
page is rendered by headless Chromium while they are still training.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

from diloco import GrpcTransport, Learner, ServerOptions, SyncerThread, for_mode


def train(learner: Learner, model: nn.Module, stop: threading.Event, pause: float, seed: int) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    while not stop.is_set():
        x = torch.randint(0, 64, (16, 8), generator=g)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), (x.roll(1, dims=1)).flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        learner.step(x.numel(), loss=loss.item())
        time.sleep(pause)
    learner.finish()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "dashboard.png")
    args = p.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        raise SystemExit("needs chromium: apt-get install chromium")
    torch.set_num_threads(1)
    syncer = SyncerThread(for_mode("decoupled", 3, fragments=4, sync_every=8),
                          ServerOptions(listen="127.0.0.1:0", http="127.0.0.1:0", duration=600))
    stop = threading.Event()
    threads = []
    for i, pause in enumerate((0.02, 0.02, 0.05)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.Linear(32, 64))
        learner = Learner(model, GrpcTransport(syncer.address), f"site-{'abc'[i]}")
        threads.append(threading.Thread(target=train, args=(learner, model, stop, pause, i), daemon=True))
        threads[-1].start()
    time.sleep(args.seconds)
    port = syncer.status["http_port"]
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--window-size=1400,1300", "--virtual-time-budget=4000", f"--user-data-dir={profile}",
                        f"--screenshot={args.out}", f"http://127.0.0.1:{port}/"], check=True, capture_output=True,
                       timeout=120)
    stop.set()
    for t in threads:
        t.join(60)
    syncer.stop()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
