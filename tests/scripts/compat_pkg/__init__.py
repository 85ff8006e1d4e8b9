"""A package for the `-m` case of tests/test_torchrun_compat.py (on PYTHONPATH=tests/scripts)."""
