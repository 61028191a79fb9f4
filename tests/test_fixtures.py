"""The real-data fixtures under tests/data/: a missing one fails with the command that restores it, and each file
is the one its README describes (the README lists the sha256 of every data file beside it)."""
from __future__ import annotations

import hashlib
import re

import pytest

from testkit.fixtures import FIXTURES, MissingFixture, fixture

# The folders whose README lists a sha256 for each of its data files.
HASHED_FOLDERS = ("sugarcrepe", "negclip", "parser-gold")
SHA256 = re.compile(r"\b[0-9a-f]{64}\b")


def test_a_fixture_resolves_inside_the_repository():
    path = fixture("sugarcrepe/swap_att.json")
    assert path == FIXTURES / "sugarcrepe" / "swap_att.json" and path.is_file()
    assert fixture("negclip").is_dir()


def test_a_missing_fixture_fails_naming_the_restore_command():
    with pytest.raises(MissingFixture, match=re.escape("git checkout -- tests/data/sugarcrepe/absent.json")):
        fixture("sugarcrepe/absent.json")
    with pytest.raises(FileNotFoundError):  # callers that catch the built-in error still see it
        fixture("absent")


@pytest.mark.parametrize("folder", HASHED_FOLDERS)
def test_every_data_file_is_the_one_its_readme_describes(folder):
    directory = fixture(folder)
    readme = (directory / "README.md").read_text(encoding="utf-8")
    data = [path for path in sorted(directory.iterdir()) if path.name != "README.md" and
            not path.name.startswith("LICENSE")]
    assert data, folder
    digests = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in data}
    assert {name for name, digest in digests.items() if digest not in readme} == set()
    assert set(SHA256.findall(readme)) == set(digests.values()), "the README lists a digest of no file here"
