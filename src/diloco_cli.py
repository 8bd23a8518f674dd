"""The `diloco` console script.

`diloco/__init__.py` imports the public API (torch, gRPC) eagerly, and Python runs a package's `__init__` before
any of its modules, `diloco.cli` included. This entry point registers the `diloco` package without running its
`__init__`, so the command line is read first and `diloco --help` or a mistyped flag answers in a fraction of a
second; each command imports what it uses by its full module path. `python -m diloco` imports the whole package.
"""

from __future__ import annotations

import importlib.util
import sys


def main() -> int:
    if "diloco" not in sys.modules:
        spec = importlib.util.find_spec("diloco")
        if spec is not None and spec.loader is not None:
            sys.modules["diloco"] = importlib.util.module_from_spec(spec)  # its modules import as usual
    from diloco.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
