"""Fails at import on every rank, as a script with a typo in a dependency does."""

import this_module_does_not_exist  # noqa: F401
import torch  # noqa: F401
