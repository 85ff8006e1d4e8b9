"""A module of the script's own (tests/scripts/plain_imports.py): never pre-imported."""
