"""Screenshot of the syncer's dashboard during a real run, for docs/dashboard.png (needs Debian's `chromium`).

    python scripts/dashboard_screenshot.py [--seconds 45] [--out docs/dashboard.png]

Starts `diloco run` (three learners of the built-in model, one at half speed, one killed for a fifth of the run by
the chaos harness, a snapshot every few seconds evaluated as it appears); after --seconds the page is rendered by
headless Chromium while they train, so the held-out loss of the global model and the fault show up on it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=45.0, help="seconds of training before the screenshot")
    p.add_argument("--duration", type=float, default=75.0, help="the run's length")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "dashboard.png")
    args = p.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        raise SystemExit("needs chromium: apt-get install chromium")
    with tempfile.TemporaryDirectory() as folder:
        run_dir = Path(folder) / "run"
        run = subprocess.Popen([sys.executable, "-m", "diloco", "run", "--learners", "3", "--speeds", "1,1,0.5",
                                "--model", "tiny", "--duration", str(args.duration), "--snapshots", "15",
                                "--chaos", "kill-one", "--no-progress", "--json", "--out", str(run_dir)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            ready = run_dir / "syncer" / "ready.json"
            deadline = time.monotonic() + 120
            while not ready.exists():
                if run.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the run did not start: {run.stderr.read()[-2000:] if run.stderr else ''}")
                time.sleep(0.5)
            time.sleep(args.seconds)
            port = json.loads(ready.read_text())["http_port"]
            subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            "--window-size=1400,1450", "--virtual-time-budget=4000",
                            f"--user-data-dir={Path(folder) / 'profile'}", f"--screenshot={args.out.resolve()}",
                            f"http://127.0.0.1:{port}/"], check=True, capture_output=True, timeout=120)
        finally:
            run.terminate()
            run.wait(120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
