"""Deprecated module path: the worker API lives in `unbroken.runtime.run`.

Kept so that `from unbroken.runtime.session import Run, init` goes on working."""

from unbroken.runtime.run import Run, init

__all__ = ["Run", "init"]
