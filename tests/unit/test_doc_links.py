"""Every relative link in the README and docs/ points at a file that exists, and at a heading it has."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "DEVELOPERS.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "LOG.md",
         ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_benchmarks_map_names_every_study_and_script():
    folder = ROOT / "benchmarks"
    text = (folder / "README.md").read_text()
    scripts = [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*.py")) if p.name != "__init__.py"]
    studies = sorted({s.split("/")[0] + "/" for s in scripts if "/" in s})
    missing = [s for s in scripts + studies if f"]({s})" not in text]
    assert len(studies) >= 5 and not missing, f"benchmarks/README.md does not map {missing}"
