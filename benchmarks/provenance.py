"""What a benchmark's numbers hold for, written beside them: the commit (and whether the tree had changes), the
command and its full settings, the machine, and when. Every benchmark that writes a results file passes it through
`stamped`, so a figure quoted in the docs can be traced to the code and the machine that made it."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """HEAD of the tree this script is in, "+changes" when tracked files differ from it; "unknown" outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def machine() -> dict:
    """The hardware and software the numbers came from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "system": platform.platform()}
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages * size / 2**30, 1)
    except (ValueError, OSError):
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def invocation() -> str:
    """How this process was started: `python -m benchmarks.<study>.<script>`, or the script's name."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return f"python -m {spec.name}" if spec is not None else Path(sys.argv[0]).name


def provenance(settings) -> dict:
    """The provenance record of a run with `settings` (an argparse Namespace or a dict)."""
    values = vars(settings) if hasattr(settings, "__dict__") else dict(settings)
    return {"commit": commit(), "command": " ".join([invocation(), *sys.argv[1:]]),
            "settings": {k: v if isinstance(v, (int, float, bool, str, type(None))) else str(v)
                         for k, v in values.items()},
            "machine": machine(), "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def stamped(results: dict, settings) -> dict:
    """`results` with its provenance under "provenance": a file resumed over several invocations keeps the first
    one's and gains one per invocation under "provenance_more" when the commit or command differs."""
    record = provenance(settings)
    first = results.get("provenance")
    if first is None:
        return {**results, "provenance": record}
    if (first.get("commit"), first.get("command")) == (record["commit"], record["command"]):
        return results
    more = [r for r in results.get("provenance_more", []) if (r["commit"], r["command"]) != (record["commit"],
                                                                                          record["command"])]
    return {**results, "provenance_more": [*more, record]}
