#!/usr/bin/env bash
# Install unbroken into a Python environment, never replacing a torch that is already there.
#
#   deploy/install.sh [SOURCE] [EXTRAS]
#
# SOURCE: what pip installs unbroken from: this source tree (default: the directory above
# this script), a wheel, or a requirement such as "unbroken==0.9". EXTRAS: pip extras, e.g.
# "[hf,k8s]" (default none). Environment: PYTHON (default python3); TORCH_SPEC, the torch
# to install when there is none (default "torch>=2.13,<2.16"); TORCH_INDEX, an extra index
# for it (e.g. https://download.pytorch.org/whl/cpu). pip honours PIP_CONSTRAINT, as
# NVIDIA's PyTorch containers set it (/etc/pip/constraint.txt pins their torch build).
#
# With a torch installed (NVIDIA's containers: a local build such as 2.16.0a0+git...),
# unbroken is installed without its dependencies, then every dependency but torch: pip
# never sees a reason to replace it. A version outside the range unbroken is tested on is
# said in one line, and kept. Both Dockerfiles (deploy/Dockerfile.cuda, .cpu) and CI
# (tests/integration/test_install.py) run this one script, so they cannot drift.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source="${1:-$here/..}"
extras="${2:-}"
py="${PYTHON:-python3}"
torch_spec="${TORCH_SPEC:-torch>=2.13,<2.16}"
pip=("$py" -m pip install --no-input --disable-pip-version-check)

say() { echo "install.sh: $*" >&2; }

target="$source$extras"
if [[ -d "$source" ]]; then target="$(cd "$source" && pwd)$extras"; fi

torch_version="$("$py" -c 'import importlib.metadata as m; print(m.version("torch"))' \
    2>/dev/null || true)"
if [[ -z "$torch_version" ]]; then
  say "no torch here: installing $torch_spec"
  extra=()
  if [[ -n "${TORCH_INDEX:-}" ]]; then extra=(--extra-index-url "$TORCH_INDEX"); fi
  "${pip[@]}" "${extra[@]}" "$torch_spec"
  "${pip[@]}" "$target"
  exit 0
fi

say "keeping the installed torch $torch_version"
"${pip[@]}" --no-deps "$target"
# unbroken's own requirements (those of the extras asked for too), torch left out.
mapfile -t deps < <("$py" - "$extras" <<'PY'
import importlib.metadata as m
import re
import sys

extras = set(re.findall(r"[A-Za-z0-9_.-]+", sys.argv[1]))
for req in m.requires("unbroken") or []:
    name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
    marker = req.split(";", 1)[1] if ";" in req else ""
    wanted = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
    if name.lower() == "torch" or (wanted and wanted.group(1) not in extras):
        continue
    print(req.split(";", 1)[0].strip())
PY
)
if ((${#deps[@]})); then "${pip[@]}" "${deps[@]}"; fi
"$py" - "$torch_version" <<'PY'
import importlib.metadata as m
import re
import sys

have = sys.argv[1]
spec = next((r for r in m.requires("unbroken") or [] if re.match(r"torch\b", r)), "")
try:
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:  # a fresh environment: pip's own copy
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.version import Version
    ok = Requirement(spec).specifier.contains(Version(have), prereleases=True)
except Exception:  # neither: say nothing rather than guess
    ok = True
if not ok:
    print(f"install.sh: torch {have} is outside the range unbroken is tested on "
          f"({spec}); kept as it is", file=sys.stderr)
PY
