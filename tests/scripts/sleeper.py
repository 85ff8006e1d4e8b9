"""A worker that spawns a child of its own and then sleeps: for tests that kill the agent."""

import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(f"child {child.pid}", flush=True)
time.sleep(600)
