"""`diloco status ADDRESS`: any syncer's /status in the terminal (its learners, rounds, tokens and refusals) with the
table `diloco run` shows of its own run, refreshed until Ctrl-C; `--once` prints one snapshot, `--json` the status
itself."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from diloco.options import UserError, positive_seconds

TIMEOUT = 5.0
"""Seconds one read of /status may take before the syncer counts as unreachable."""


def status_url(address: str) -> str:
    """http://HOST:PORT/status from HOST:PORT, or from a URL of the syncer's (its path is replaced)."""
    text = address.strip()
    parts = urlsplit(text if "://" in text else f"http://{text}")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise UserError(f"{address!r} is not a syncer's HTTP address: give HOST:PORT of its dashboard and /status "
                        f"(`diloco syncer --http`, 127.0.0.1:8080 by default)")
    return f"{parts.scheme}://{parts.netloc}/status"


def fetch(url: str, token: str | None = None, timeout: float = TIMEOUT) -> dict:
    """The syncer's /status; a UserError in one line when nothing answers there or what answers is no syncer."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            body = reply.read(64 << 20)
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise UserError(f"{url} needs a secret: pass --token (the syncer's --status-token or --token)") from None
        if e.code == 503:
            raise UserError(f"{url}: the syncer is starting; try again in a moment") from None
        raise UserError(f"{url} answered HTTP {e.code}: not a diloco syncer's /status") from None
    except http.client.HTTPException:  # what answers is no HTTP server: a gRPC port, most likely
        raise UserError(f"{url} does not answer HTTP: give the syncer's HTTP address (`diloco syncer --http`), not "
                        f"its gRPC one") from None
    except (urllib.error.URLError, OSError) as e:
        raise UserError(f"cannot reach a syncer at {url}: {getattr(e, 'reason', None) or e}; is it running, and is "
                        f"this its HTTP address (`diloco syncer --http`)?") from None
    try:
        status = json.loads(body)
    except ValueError:
        status = None
    if not isinstance(status, dict) or not {"rounds", "learners", "versions"} <= status.keys():
        raise UserError(f"{url} answered, but not as a diloco syncer's /status")
    return status


def budget_text(status: dict) -> str:
    tokens, progress = status.get("token_budget"), status.get("budget_progress")
    spent = "" if progress is None else f" ({100 * progress:.0f}% spent)"
    if tokens:
        return f"budget {tokens:,} tokens{spent}"
    return f"budget{spent}" if spent else "no budget"


def view(status: dict):
    from diloco.status_view import progress_table

    return progress_table(status, status.get("uptime_seconds") or 0.0, budget_text(status))


def run(address: str, token: str | None, once: bool, as_json: bool, every: float) -> int:
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    url = status_url(address)
    status = fetch(url, token)
    if as_json:
        print(json.dumps(status, indent=2))
        return 0
    console = Console()
    if once:
        console.print(view(status))
        return 0
    shown = view(status)
    try:
        with Live(shown, console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(every)
                try:
                    shown = view(fetch(url, token))
                    live.update(shown)
                except UserError as e:  # the syncer stopped or is restarting: the last view stays, with why
                    live.update(Group(shown, Text(f"{e} (retrying)", style="red")))
    except KeyboardInterrupt:  # how a watch ends
        return 0


def register(sub) -> None:
    p = sub.add_parser("status", help="a live view of any syncer: learners, rounds, tokens, refusals",
                       description="Show a running syncer's /status as the table `diloco run` shows, refreshed until "
                                   "Ctrl-C: per learner its state, step, loss, tokens a second, pushes and applied "
                                   "fragments; the rounds, versions, tokens trained and merged, wire bytes and the "
                                   "refusals by reason.")
    p.add_argument("address", metavar="ADDRESS",
                   help="the syncer's HTTP HOST:PORT (`diloco syncer --http`, 127.0.0.1:8080 by default) or a URL")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="print the syncer's /status as JSON, once")
    p.add_argument("--every", type=positive_seconds, default=1.0, metavar="SECONDS", help="refresh period (1 s)")
    p.add_argument("--token", help="beyond loopback: the syncer's --status-token (or its run --token); "
                                   "else --token-file, else $DILOCO_STATUS_TOKEN")
    p.add_argument("--token-file", metavar="FILE", help="a file holding that token alone")
    p.set_defaults(func=lambda args: run(args.address, args.token, args.once, args.json, args.every))
