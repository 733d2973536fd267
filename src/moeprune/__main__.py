"""`python -m moeprune ...`: the same command line as `moeprune ...`."""

from moeprune.cli import main

if __name__ == "__main__":
    main()
