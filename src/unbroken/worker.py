"""Entry point of every worker process under `unbroken run`: `python -m unbroken.worker`.

It arms the framework integrations (`integrations/automatic.py`: they act only if the script
imports the framework), then hands over to the runtime's bootstrap, which runs the script
(`runtime/bootstrap.py`). It sits above both, so that neither depends on the other.
"""

from __future__ import annotations

from unbroken.integrations import automatic
from unbroken.runtime import bootstrap


def main() -> None:
    automatic.arm()
    bootstrap.main()


if __name__ == "__main__":
    main()
