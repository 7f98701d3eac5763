"""`python -m perfxlm ...`: the same command line as the `perfxlm` script."""

from perfxlm.entrypoints.cli import main

if __name__ == "__main__":
    main()
