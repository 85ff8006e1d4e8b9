"""Count the Python interpreters a test run starts, by kind (issue 45's table).

    python tests/interpreters.py install .venv      # a .pth that logs each start (off by default)
    UNBROKEN_INTERPRETER_LOG=/tmp/starts make test  # or any pytest command
    python tests/interpreters.py report /tmp/starts
    python tests/interpreters.py uninstall .venv

The .pth file runs at every start of the venv's interpreter (`site`), and only when
UNBROKEN_INTERPRETER_LOG names a file does it append one line: the process's command line
from /proc. A child the fork server forks is not an interpreter start and is not counted
(the fork server reports those: `workers_started`'s `forked`). Kinds are read from the
command line: agent (`unbroken run`), fork server, cold worker or spare (our bootstrap),
torchrun, pytest, and other (the most frequent shown).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

PTH = "zz_unbroken_interpreter_log.pth"
VARIABLE = "UNBROKEN_INTERPRETER_LOG"
# One line, run by `site` at start-up (a .pth line that begins with `import` is executed).
_LINE = ("import os; p = os.environ.get('" + VARIABLE + "'); p and open(p, 'ab').write("
         "open('/proc/self/cmdline', 'rb').read().replace(b'\\n', b' ').replace(b'\\0', b' ')"
         ".strip() + b'\\n')\n")


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise SystemExit(f"no site-packages under {venv}: is it a venv?")
    return found[0]


def kind(cmdline: str) -> str:
    words = cmdline.split()
    if "--fork-server" in words:
        return "fork server"
    if "unbroken.worker" in words or any(w.endswith("unbroken/worker.py") for w in words):
        return "worker or spare, cold"
    if "run" in words[1:4] and (words[1:3] == ["-m", "unbroken"]
                                or any(w.endswith("/unbroken") for w in words[1:2])):
        return "agent"
    if any(w.endswith("torchrun") or w == "torch.distributed.run" for w in words[:3]):
        return "torchrun"
    if any(w.endswith("pytest") or w == "pytest" for w in words[:3]):
        return "pytest"
    if "libc.mount(source.encode()," in cmdline:
        return "namespace shim (tests/netns.py)"
    if words[1:3] == ["-m", "unbroken"] or words[1:3] == ["-u", "-m"]:
        return "unbroken CLI (report, k8s, ...)"
    if len(words) > 2 and words[1] == "-u" and words[2].endswith(".py"):
        return "torchrun's worker"
    return "other"


def records(text: str) -> list[str]:
    """One command line per start. (A log written before the writer replaced newlines has a
    `python -c` program's lines on lines of their own: each record begins with the path of
    an interpreter, so a line that does not is joined to the record before it.)"""
    found: list[str] = []
    for line in filter(None, (line.strip() for line in text.splitlines())):
        first = line.split()[0]
        if found and not (first.startswith("/") and "python" in first.rsplit("/", 1)[-1]):
            found[-1] += " " + line
        else:
            found.append(line)
    return found


def report(log: Path) -> dict:
    lines = records(log.read_text(errors="replace"))
    kinds = collections.Counter(kind(line) for line in lines)
    others = collections.Counter(" ".join(line.split()[:3])[:80] for line in lines
                                 if kind(line) == "other")
    return {"total": len(lines), "by_kind": dict(kinds.most_common()),
            "other_most_frequent": dict(others.most_common(8))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("install", "uninstall"):
        sub.add_parser(name).add_argument("venv", type=Path)
    sub.add_parser("report").add_argument("log", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "report":
        print(json.dumps(report(args.log), indent=1))
        return 0
    path = site_packages(args.venv) / PTH
    if args.cmd == "install":
        path.write_text(_LINE)
    else:
        path.unlink(missing_ok=True)
    print(f"{args.cmd}ed {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
