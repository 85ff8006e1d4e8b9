"""Signing settled at first contact (`control.auth`), and how `unbroken drain` signs: pure
functions, no processes."""

from __future__ import annotations

import pytest

from unbroken.control.address import ControlAddress
from unbroken.control.auth import job_auth, mismatch
from unbroken.control.messages import JobAuth
from unbroken.control.signing import Signer
from unbroken.errors import ConfigError, ExitCode, UserError
from unbroken.launch.drain import DrainTarget, find_store, signer_for

A, B = bytes(range(32)), bytes(range(1, 33))


def test_equal_secrets_agree_and_the_fingerprint_does_not_carry_the_secret():
    assert job_auth(A) == job_auth(bytes(range(32)))
    assert job_auth(A).fingerprint != job_auth(B).fingerprint
    assert A.hex() not in job_auth(A).fingerprint
    assert job_auth(None) == JobAuth(signed=False)
    assert mismatch(job_auth(A), job_auth(A)) is None
    assert mismatch(job_auth(None), job_auth(None)) is None


@pytest.mark.parametrize(("job", "mine", "said"), [
    (A, B, "secret differs from the job's"),
    (A, None, "the job signs its control messages and this agent has no secret"),
    (None, A, "the job runs unsigned"),
])
def test_a_mismatch_is_one_line_that_says_how_to_fix_it(job, mine, said):
    why = mismatch(job_auth(job), job_auth(mine))
    assert said in why and "--secret-file or UNBROKEN_SECRET" in why and "\n" not in why


def test_drain_signs_as_the_job_does():
    assert signer_for(JobAuth(signed=False), A) is None  # unsigned job: a local secret is moot
    assert isinstance(signer_for(job_auth(A), A), Signer)
    with pytest.raises(UserError, match="give its secret"):
        signer_for(job_auth(A), None)
    with pytest.raises(ConfigError, match="this command's secret differs") as err:
        signer_for(job_auth(A), B)
    assert err.value.exit_code == ExitCode.USAGE


def test_drain_finds_the_control_plane_from_flags_or_this_hosts_control_file(tmp_path):
    etcd = DrainTarget(backend="etcd", endpoint="e1:2379,e2:2379", run_id="job")
    assert find_store(etcd) == (ControlAddress.parse("etcd://e1:2379,e2:2379"), "job")
    tcp = DrainTarget(endpoint="node0:29400", run_id="job")
    assert find_store(tcp)[0].endpoints == ("node0:29400",)
    (tmp_path / "control.json").write_text('{"control": "tcp://10.0.0.1:29500", "run_id": "r"}')
    assert find_store(DrainTarget(run_dir=str(tmp_path))) == (
        ControlAddress.parse("tcp://10.0.0.1:29500"), "r")
    with pytest.raises(UserError, match="--rdzv-endpoint"):
        find_store(DrainTarget(backend="etcd", run_id="job"))
    with pytest.raises(UserError, match="give the job's --rdzv-endpoint"):
        find_store(DrainTarget(endpoint="node0:29400"))
