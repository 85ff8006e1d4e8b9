"""No tracker issue numbers in what users and readers of the code see: README.md, docs/
and src/ say what a thing is and why, not which ticket brought it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ISSUE = re.compile(r"\b[Ii]ssues? #?\d+\b|\(#\d+\)")


def test_no_tracker_issue_numbers_in_the_readme_docs_or_source():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "src").rglob("*.py"))]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in files
             for n, line in enumerate(p.read_text().splitlines(), 1) if ISSUE.search(line)]
    assert not found, "\n".join(found[:20])
