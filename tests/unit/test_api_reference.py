"""The API reference (docs/reference/, built by `make docs` with mkdocstrings) documents every
public name of the package: each name in `unbroken.__all__` is the object of one of its
`::: dotted.path` directives, and each directive names an object that exists."""

import importlib
import re
from pathlib import Path

import unbroken

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference"


def _resolve(dotted: str):
    """The object a `::: a.b.C` directive names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def _directives() -> dict[str, object]:
    found = {}
    for page in sorted(REFERENCE.glob("*.md")):
        for dotted in re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), flags=re.M):
            found[dotted] = _resolve(dotted)
    return found


def test_every_directive_names_an_object_that_exists():
    assert len(_directives()) >= 10


def test_every_public_name_is_in_the_reference():
    documented = {id(obj) for obj in _directives().values()}
    missing = [name for name in unbroken.__all__ if id(getattr(unbroken, name)) not in documented]
    assert not missing, f"add to docs/reference/: {missing}"


def test_dir_shows_the_public_names():
    assert {"init", "Run"} <= set(dir(unbroken))
    assert set(unbroken.__all__) <= set(dir(unbroken))
