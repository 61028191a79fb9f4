"""`python -m study`: the study's report command (`cli.py`)."""
from study.cli import main

if __name__ == "__main__":
    main()
