"""`unbroken run`'s flags, their PET_ variables and their validation: pure, no processes.
The torchrun side-by-side table is tests/integration/test_torchrun_compat.py."""

from __future__ import annotations

import pytest

from unbroken.cli import _build_parser
from unbroken.errors import UserError
from unbroken.launch.config import ExtraNodes
from unbroken.launch.flags.parser import config_from_args
from unbroken.launch.flags.values import NodeRange, parse_nnodes, parse_rdzv_conf
from unbroken.launch.log_spec import LogSpec, Std, parse_std


def _config(tmp_path, *flags, env=None, monkeypatch=None):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    warnings = []
    parser = _build_parser() if env is None else _pet_parser(env, monkeypatch)
    args = parser.parse_args(["run", *flags, str(script)])
    return config_from_args(args, warnings.append), warnings


def _pet_parser(env, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return _build_parser()


def test_node_ranges_parse_as_torchrun_reads_them():
    assert parse_nnodes("2") == NodeRange(2, 2) and parse_nnodes("1:4") == NodeRange(1, 4)
    for bad, says in (("3:1", "MIN must not exceed MAX"), ("0:2", "at least 1"),
                      ("a:b", "whole numbers"), ("0", "at least 1")):
        with pytest.raises(UserError, match=says):
            parse_nnodes(bad)


def test_redirect_maps_parse_and_bad_ones_name_the_flag():
    assert parse_std("-r", "3") == Std.ALL
    assert parse_std("-r", "0:1,1:2") == {0: Std.OUT, 1: Std.ERR}
    for bad in ("4", "0:9", "x:1", "1,2"):
        with pytest.raises(UserError, match="--tee"):
            parse_std("--tee", bad)


def test_rdzv_conf_maps_timeouts_and_warns_of_unknown_keys():
    said = []
    conf = parse_rdzv_conf("join_timeout=60,last_call_timeout=2,keep_alive_interval=2,"
                           "keep_alive_max_attempt=4,close_timeout=5,frobnicate=1", said.append)
    assert (conf.join_timeout, conf.last_call, conf.node_timeout) == (60.0, 2.0, 8.0)
    assert len(said) == 2 and "close_timeout" in said[0] and "frobnicate" in said[1]
    with pytest.raises(UserError, match="--rdzv-conf"):
        parse_rdzv_conf("join_timeout", said.append)


def test_the_prefix_template_and_the_filter_are_torchruns():
    spec = LogSpec(tee=Std.ALL, local_ranks_filter=frozenset({0}), role="trainer")
    assert spec.prefix(3, 1) == "[trainer1]:"
    templated = LogSpec(prefix_template="[${role_name}-${rank}/${local_rank}]:", role="t")
    assert templated.prefix(3, 1) == "[t-3/1]:"
    assert spec.teed(0) == Std.ALL and spec.teed(1) == Std.NONE and spec.hidden(1)
    assert spec.redirected(1) == Std.ALL  # a hidden rank's tee still reaches its files


def test_elastic_flags_become_an_elastic_config(tmp_path):
    cfg, _ = _config(tmp_path, "--nnodes", "2:4", "--rdzv-endpoint", "127.0.0.1:29400",
                     "--rdzv-conf", "last_call_timeout=1")
    assert (cfg.least, cfg.cap, cfg.last_call, cfg.elastic, cfg.assign_rank) == (2, 4, 1.0, True, True)
    cfg, _ = _config(tmp_path, "--nnodes", "2:4", "--extra-nodes", "standby")
    assert cfg.cap == 2 and cfg.extra_nodes == ExtraNodes.STANDBY
    cfg, warned = _config(tmp_path, "--nnodes", "1:2", "--node-rank", "1")
    assert cfg.assign_rank and "--node-rank 1 is ignored" in warned[0]
    cfg, _ = _config(tmp_path, "--nnodes", "2", "--node-rank", "1")
    assert not cfg.elastic and not cfg.assign_rank and cfg.node_rank == 1
    with pytest.raises(UserError, match="needs --nnodes MIN:MAX"):
        _config(tmp_path, "--extra-nodes", "standby")
    with pytest.raises(UserError, match="static rendezvous"):
        _config(tmp_path, "--nnodes", "1:2", "--rdzv-backend", "static")
    with pytest.raises(UserError, match="--no-python cannot be used with -m"):
        _config(tmp_path, "--no-python", "-m")


def test_every_pet_variable_sets_its_flag_and_the_command_line_wins(tmp_path, monkeypatch):
    env = {"PET_NNODES": "1:3", "PET_NPROC_PER_NODE": "2", "PET_RDZV_ID": "job7",
           "PET_MAX_RESTARTS": "4", "PET_MONITOR_INTERVAL": "0.5", "PET_TEE": "3",
           "PET_SHUTDOWN_TIMEOUT": "7", "PET_VIRTUAL_LOCAL_RANK": "1", "PET_ROLE": "trainer"}
    cfg, _ = _config(tmp_path, "--max-restarts", "1", env=env, monkeypatch=monkeypatch)
    assert (cfg.least, cfg.nnodes, cfg.nproc_per_node, cfg.run_id) == (1, 3, 2, "job7")
    assert (cfg.recovery.max_restarts, cfg.hangs.monitor_interval, cfg.kill_grace) == (1, 0.5, 7.0)
    assert cfg.logs.tee == Std.ALL and cfg.virtual_local_rank and cfg.role == "trainer"


def test_pet_no_python_runs_the_program_as_an_executable(tmp_path, monkeypatch):
    monkeypatch.setenv("PET_NO_PYTHON", "1")
    args = _build_parser().parse_args(["run", "true"])
    cfg = config_from_args(args, print)
    assert cfg.no_python and not cfg.module


def test_a_bad_flag_value_is_one_line_naming_the_flag_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        _build_parser().parse_args(["run", "--monitor-interval", "x", "s.py"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--monitor-interval" in err


def test_a_pet_value_outside_a_flags_choices_is_one_line_naming_flag_and_variable(
        tmp_path, monkeypatch):
    for var, value, flag in (("PET_RDZV_BACKEND", "foo", "--rdzv-backend"),
                             ("PET_EXTRA_NODES", "bogus", "--extra-nodes")):
        monkeypatch.setenv(var, value)
        with pytest.raises(UserError, match=f"{flag} must be one of .*{var}"):
            _config(tmp_path)
        monkeypatch.delenv(var)
    with pytest.raises(UserError, match="join_timeout must be 0 or more"):
        _config(tmp_path, "--rdzv-conf", "join_timeout=-5")


def test_a_standby_node_without_a_rank_takes_one_in_join_order(tmp_path):
    cfg, _ = _config(tmp_path, "--nnodes", "2", "--standby")
    assert cfg.standby and cfg.assign_rank and cfg.spares_when_standing_by
    cfg, _ = _config(tmp_path, "--nnodes", "2", "--standby", "--node-rank", "2")
    assert cfg.standby and not cfg.assign_rank and cfg.node_rank == 2


def test_group_rank_is_the_nodes_place_in_the_plan_not_its_join_number():
    from unbroken.control.worker_env import WorkerEnv

    env = WorkerEnv(node_rank=5, group_rank=1, nnodes=2).to_environ()
    assert env["GROUP_RANK"] == "1" and env["UNBROKEN_NODE_RANK"] == "5"
    assert WorkerEnv.from_environ(env).node_rank == 5
