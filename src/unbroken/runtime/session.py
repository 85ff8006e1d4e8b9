"""Deprecated module path: the worker API lives in `unbroken.runtime.run` (`unbroken.init`,
`unbroken.Run`). Kept so that `from unbroken.runtime.session import Run, init` goes on
working, with a deprecation line."""

import warnings

from unbroken.runtime.run import Run, init

warnings.warn("unbroken.runtime.session is deprecated: import Run and init from unbroken "
              "(or unbroken.runtime.run)", DeprecationWarning, stacklevel=2)

__all__ = ["Run", "init"]
