"""Entry point of every worker process under `unbroken run`: `python -m unbroken.worker`.

It arms the framework integrations (`integrations/automatic.py`: they act only if the script
imports the framework), then hands over to the runtime's bootstrap, which runs the script
(`runtime/bootstrap.py`). It sits above both, so that neither depends on the other.

`python -m unbroken.worker --fork-server` is the node's fork server
(`runtime/fork_server.py`): each worker it forks runs `main` as this entry point would.
"""

from __future__ import annotations

import sys

from unbroken.control.fork_requests import FORK_SERVER_FLAG
from unbroken.integrations import automatic
from unbroken.runtime import bootstrap, fork_server


def main() -> None:
    automatic.arm()
    bootstrap.main()


if __name__ == "__main__":
    if sys.argv[1:2] == [FORK_SERVER_FLAG]:
        fork_server.serve(main)
    else:
        main()
