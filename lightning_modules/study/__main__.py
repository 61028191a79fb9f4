"""`python -m lightning_modules.study`: the study's report command (`command.py`)."""
from lightning_modules.study.command import main

if __name__ == "__main__":
    main()
