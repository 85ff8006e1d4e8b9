"""Adapters that put unbroken's in-place recovery inside someone else's training loop.

Not written yet: the Hugging Face Trainer and Lightning adapters will live here, each a client
of the recovery engine's step transaction, as `Run.train` is.

The rule, checked by the "integrations" contract in pyproject.toml (tests/unit/test_layers.py):
from the worker runtime an integration imports only the engine's public modules,
`unbroken.runtime.engine`, `unbroken.runtime.run` and `unbroken.runtime.position`. What it needs
and cannot reach through them is a gap in the engine's public surface, to be closed there, not
worked around from here. Nor does an integration import the agent (`unbroken.launch`).
"""
