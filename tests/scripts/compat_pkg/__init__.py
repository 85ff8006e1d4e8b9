"""A package for the `-m` case of tests/integration/test_torchrun_compat.py (on PYTHONPATH=tests/scripts)."""
