"""The project's benchmarks, one folder per study (README.md maps each script to its results and to the section of
docs/results.md that quotes them). Run one from the repository root: `python -m benchmarks.<study>.<script>`.

Where the package is not installed (a machine given only a checkout), its source folder is used."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

if importlib.util.find_spec("diloco") is None:
    sys.path.insert(0, str(ROOT / "src"))


def module_command(module: str) -> list[str]:
    """The command that runs benchmark `module` (a `__spec__.name`) in a child interpreter."""
    return [sys.executable, "-m", module]


def child_env() -> dict[str, str]:
    """The environment for `module_command`: this checkout's benchmarks (and its source, for a checkout that is not
    installed) found from any working directory."""
    paths = [str(ROOT), str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
