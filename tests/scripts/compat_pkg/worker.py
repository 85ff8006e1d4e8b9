"""`python -m compat_pkg.worker`: the compat worker run as a module."""

from compat_worker import main

if __name__ == "__main__":
    main()
