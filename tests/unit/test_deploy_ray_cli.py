"""`python -m diloco.ray`'s island specs, and `import diloco` never importing Ray (an optional extra)."""

import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="Ray is not installed: pip install 'diloco[ray]'")


def test_island_specs_parse_and_bad_ones_are_refused():
    import argparse

    from diloco.ray.__main__ import island_spec

    spec = island_spec("site-a:2:site_a")
    assert (spec.id, spec.ranks, spec.resource) == ("site-a", 2, "site_a")
    assert (island_spec("b").ranks, island_spec("b").resource) == (1, None)
    for bad in ("", "a:x", "a:1:b:c"):
        with pytest.raises(argparse.ArgumentTypeError, match="ID\\[:RANKS"):
            island_spec(bad)


def test_importing_diloco_does_not_import_ray():
    code = "import sys, diloco, diloco.cli, diloco.exits; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
