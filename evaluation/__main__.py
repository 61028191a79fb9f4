"""`python -m evaluation`: the same CLI as `python -m evaluation.evaluate`."""
from evaluation.evaluate import main

if __name__ == "__main__":
    main()
