"""deploy/install.sh, the one install step of both images (deploy/Dockerfile.cuda, .cpu),
run as CI runs it: in a fresh virtual environment that already holds a torch of NVIDIA's
kind (a local pre-release build, `2.16.0a0+git...`, pinned by a pip constraint file as
NVIDIA's containers pin theirs). The torch is kept, unbroken and its other requirements
are installed, and the script says the torch is outside the tested range. Needs the
package index (pip), as `make install` does."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv

from conftest import REPO

NGC_TORCH = "2.16.0a0+git4b8e1f2"


def _fake_torch(site) -> None:
    """A torch distribution as pip sees an installed one: its package and its dist-info."""
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text(f'__version__ = "{NGC_TORCH}"\n')
    info = site / f"torch-{NGC_TORCH}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {NGC_TORCH}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("torch/__init__.py,,\n")


def _source_tree(dest):
    """The repository's tracked files copied to `dest`, as an image's build context holds
    them: pip builds in its source tree (setuptools writes build/ there), never in ours."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                           check=True, timeout=60).stdout.decode().split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def test_install_keeps_a_pre_release_torch_and_installs_the_rest(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site = next((env_dir / "lib").glob("python3*/site-packages"))
    _fake_torch(site)
    constraint = tmp_path / "constraint.txt"
    constraint.write_text(f"torch=={NGC_TORCH}\n")
    source = _source_tree(tmp_path / "context")
    done = subprocess.run(["bash", str(source / "deploy" / "install.sh"), str(source)],
                          env={"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin", "PYTHON": str(python),
                               "PIP_CONSTRAINT": str(constraint), "HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"install.sh: keeping the installed torch {NGC_TORCH}" in done.stderr
    assert f"torch {NGC_TORCH} is outside the range unbroken is tested on" in done.stderr
    versions = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m, numpy, prometheus_client; "
         "print(m.version('torch'), m.version('unbroken'))"],
        capture_output=True, text=True, timeout=60)
    assert versions.returncode == 0, versions.stderr
    torch_version, unbroken_version = versions.stdout.split()
    assert torch_version == NGC_TORCH and unbroken_version
    assert sys.executable != str(python)
