"""An unmodified torchrun-style script (env:// gloo, no unbroken API) for warm imports.

First thing, before its own imports, it records which of `networkx` (an installed library
that `import torch` does not import) and `plain_imports_local` (a module of its own, beside
it) were already imported: OUT/attempt<A>_rank<R>.json. In attempt 0 every rank waits for
OUT/go, then rank 1 exits 1; attempt 1 does one all-reduce and ends.
"""

import sys

_already = {name: name in sys.modules for name in ("networkx", "plain_imports_local")}

import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import networkx  # noqa: E402, F401
import plain_imports_local  # noqa: E402, F401
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

out = sys.argv[1]
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
with open(os.path.join(out, f"attempt{attempt}_rank{rank}.json"), "w") as fh:
    json.dump(_already, fh)
dist.init_process_group("gloo")
if attempt == 0:
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
    if rank == 1:
        sys.exit(1)
    time.sleep(120)  # stopped by the agent's restart
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
