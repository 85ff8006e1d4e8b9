"""`unbroken k8s` on the command line, in process (as tests/unit/test_cli_errors.py does):
YAML on stdout or files in a directory, the Secret's command on stderr and never a secret,
one line and exit 2 for a mistake."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from unbroken.cli import _build_parser, main

DOC = Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md"
FLAGS = ["--name", "job", "--image", "img:1", "--nnodes", "2", "--checkpoint-pvc", "ckpt"]
HEX64 = re.compile(r"\b[0-9a-fA-F]{64}\b")
SECRET_COMMAND = ('kubectl create secret generic job-secret --namespace default '
                  '--from-literal=secret="$(openssl rand -hex 32)"')


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_stdout_is_the_yaml_and_stderr_says_how_to_make_the_secret(capsys):
    code, out, err = run(["k8s", *FLAGS, "--metrics", "train.py", "--steps", "5"], capsys)
    assert code == 0
    objs = list(yaml.safe_load_all(out))
    assert [o["kind"] for o in objs] == ["JobSet", "Service", "ServiceMonitor", "PrometheusRule",
                                         "ConfigMap"]
    assert objs[0]["spec"]["replicatedJobs"][0]["template"]["spec"]["completions"] == 2
    assert SECRET_COMMAND in err.splitlines()
    assert not HEX64.search(out) and not HEX64.search(err)
    assert "wrote" not in err


def test_output_dir_gets_one_file_per_object_and_a_line_each(tmp_path, capsys):
    out_dir = tmp_path / "manifests"
    code, out, err = run(["k8s", *FLAGS, "--control-plane", "etcd", "-o", str(out_dir),
                          "train.py"], capsys)
    assert code == 0 and out == ""
    files = sorted(out_dir.iterdir())
    assert [f.name for f in files] == ["00-service-job-etcd.yaml", "01-statefulset-job-etcd.yaml",
                                       "02-poddisruptionbudget-job-etcd.yaml",
                                       "03-jobset-job.yaml"]
    assert [line for line in err.splitlines() if line.startswith("wrote ")] == [
        f"wrote {f}" for f in files]
    assert [yaml.safe_load(f.read_text())["kind"] for f in files] == [
        "Service", "StatefulSet", "PodDisruptionBudget", "JobSet"]
    assert SECRET_COMMAND in err.splitlines() and not HEX64.search(err)


def test_a_missing_checkpoint_volume_is_a_warning_not_an_error(capsys):
    code, out, err = run(["k8s", "--name", "job", "--image", "img", "train.py"], capsys)
    assert code == 0 and out.startswith("apiVersion: jobset.x-k8s.io/v1alpha2")
    assert "unbroken k8s: warning: no --checkpoint-pvc" in err


BAD = [
    (["--workload", "cronjob"], ["--workload", "cronjob"]),
    (["--nnodes", "0"], ["--nnodes", "at least 1"]),
    (["--nnodes", "x"], ["--nnodes"]),
    (["--nproc-per-node", "two"], ["--nproc-per-node"]),
    (["--node-timeout", "-1"], ["--node-timeout"]),
    (["--name", "Bad_Name"], ["--name"]),
    (["--checkpoint-host-path", "/c"], ["--checkpoint-host-path", "--checkpoint-pvc"]),
    (["--toleration", "nocolon"], ["--toleration"]),
    (["--node-selector", "novalue"], ["--node-selector"]),
    (["--standby-nodes", "1", "--nnodes", "1:2"], ["--standby-nodes", "fixed --nnodes"]),
    (["--etcd-tls-secret", "tls"], ["--control-plane etcd"]),
    (["--workload", "trainjob", "--standby-nodes", "1"], ["--standby-nodes"]),
    (["--no-such-flag"], ["--no-such-flag"]),
]


@pytest.mark.parametrize(("extra", "said"), BAD, ids=[" ".join(e) for e, _ in BAD])
def test_a_mistake_is_one_line_and_exit_2(extra, said, capsys):
    code, out, err = run(["k8s", *FLAGS, *extra, "train.py"], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    for needle in said:
        assert needle in lines[0], lines[0]


def test_required_flags_and_the_script_are_asked_for(capsys):
    for argv, said in ((["k8s", "--image", "i", "t.py"], "--name"),
                       (["k8s", "--name", "j", "t.py"], "--image"),
                       (["k8s", "--name", "j", "--image", "i"], "script")):
        code, _, err = run(argv, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and said in err


def test_a_directory_with_other_manifests_is_refused(tmp_path, capsys):
    (tmp_path / "other.yaml").write_text("kind: Pod\n")
    code, out, err = run(["k8s", *FLAGS, "-o", str(tmp_path), "train.py"], capsys)
    assert code == 2 and "other.yaml" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.yaml"]


def test_the_doc_lists_every_flag():
    parser = _build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    k8s = sub.choices["k8s"]
    text = DOC.read_text()
    flags = [s for a in k8s._actions for s in a.option_strings if s.startswith("--")]
    assert flags and all(f"`{f}" in text for f in flags if f != "--help"), [
        f for f in flags if f"`{f}" not in text]
