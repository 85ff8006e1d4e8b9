"""A worker that says how it was started, then waits to be looked at from outside.

Writes OUT/rank<R>.json (its pid, parent, session, torch's thread count, sys.argv, whether
torch was imported before the script ran), then waits for OUT/go and exits with the code
OUT/exit<R> holds (0 if none). Plain torchrun style: no unbroken API, no process group.
"""

import sys

_torch_before = "torch" in sys.modules

import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

out = sys.argv[1]
rank = int(os.environ["RANK"])
with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as fh:
    json.dump({"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0),
               "threads": torch.get_num_threads(), "argv": sys.argv,
               "torch_before": _torch_before}, fh)
os.replace(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
    time.sleep(0.02)
code = os.path.join(out, f"exit{rank}")
sys.exit(int(open(code).read()) if os.path.exists(code) else 0)
