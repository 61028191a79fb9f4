"""The real-data fixtures that travel with the repository, under `tests/data/` (each folder's README names its
source, commit and licence), for the tests and the timing scripts.

A fixture is tracked by git, so a missing one is a damaged checkout, never a reason to skip: `fixture` raises
with the command that restores it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "data"


class MissingFixture(FileNotFoundError):
    """A fixture file or folder under `tests/data/` is not in the checkout."""


def fixture(relative: Union[str, Path]) -> Path:
    """The path of a committed fixture, checked to exist.

    Args:
        relative: The path under `tests/data/`, e.g. `"sugarcrepe/swap_att.json"` or `"sugarcrepe"`.

    Returns:
        The absolute path of the file or folder.

    Raises:
        MissingFixture: It is not there; the message names the `git checkout` that restores it (an installed
            package has no fixtures: they live in a clone of the repository).
    """
    path = FIXTURES / relative
    if not path.exists():
        tracked = Path("tests", "data", relative).as_posix()
        raise MissingFixture(f"the test fixture {tracked} is missing from {FIXTURES.parent.parent}; it is committed "
                             f"with the repository: restore it with `git checkout -- {tracked}`")
    return path
