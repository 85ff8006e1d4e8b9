"""Entry point of every worker process under `unbroken run`: `python -m unbroken.worker`.

It arms the hooks that watch an unchanged script (`runtime/watch/`: its steps and its own
checkpoints, timed for the goodput report) and the framework integrations (`integrations/automatic.py`: they act only if the script
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
from unbroken.runtime.watch import hooks


def main() -> None:
    hooks.arm()  # first: before anything the script or a framework imports
    automatic.arm()
    bootstrap.main()


if __name__ == "__main__":
    if sys.argv[1:2] == [FORK_SERVER_FLAG]:
        hooks.arm()  # before the server's imports and preimports: its children inherit them
        fork_server.serve(main)
    else:
        main()
