"""Scripts that regenerate the parity fixtures under `tests/data/parity/` by running each method's official code
from a checkout given on the command line (`python -m testkit.parity.<method> --official <checkout> --out <folder>`):
they import that code, they do not contain it, and each writes its fixture's README with the official repository,
commit and command.
"""
