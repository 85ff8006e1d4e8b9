"""torchrun's parser against `unbroken run`'s, in process: every torchrun option and every
PET_ variable is accepted and means the same, and the comparison table covers the flags
torchrun users pass. (Both launchers run each row in tests/integration/test_torchrun_compat.py.)
"""

from __future__ import annotations

import argparse
import os

import pytest
from torchrun_cases import CASES

from unbroken.cli import _build_parser


def test_the_table_covers_the_issue() -> None:
    assert len(CASES) >= 20
    assert len({c.name for c in CASES}) == len(CASES)
    flags = {a for c in CASES for a in c.args}
    for flag in ("--standalone", "--nproc_per_node", "--max-restarts", "-m", "--no-python",
                 "--run-path", "--redirects", "-r", "--tee", "-t", "--log-dir",
                 "--local-ranks-filter", "--role", "--virtual-local-rank", "--nnodes"):
        assert flag in flags, flag
    assert any(c.agents == 2 for c in CASES)
    assert any(k.startswith("PET_") for c in CASES for k in c.env)


def _torch_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def _unbroken_run_parser() -> argparse.ArgumentParser:
    sub = next(a for a in _build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


# A sensible value per torchrun flag (dest); a flag a newer torch adds falls back below.
SAMPLE = {"nnodes": "1:2", "nproc_per_node": "2", "rdzv_backend": "c10d",
          "rdzv_endpoint": "127.0.0.1:29400", "rdzv_id": "job7",
          "rdzv_conf": "join_timeout=60,last_call_timeout=1", "max_restarts": "2",
          "monitor_interval": "0.5", "event_log_handler": "null", "role": "trainer",
          "log_dir": "logs", "redirects": "0:1,1:2", "tee": "3", "local_ranks_filter": "0,1",
          "duplicate_stdout_filters": "loss,step", "duplicate_stderr_filters": "error",
          "node_rank": "0", "master_addr": "127.0.0.1", "master_port": "29501",
          "local_addr": "127.0.0.1", "signals_to_handle": "SIGTERM,SIGUSR1",
          "shutdown_timeout": "5", "logs_specs": "default"}


def _sample(action: argparse.Action) -> list[str]:
    if not _takes_value(action):
        return []
    if action.dest in SAMPLE:
        return [SAMPLE[action.dest]]
    if action.choices:
        return [next((c for c in action.choices if c != action.default), action.default)]
    if action.type is int:
        return ["1"]
    if action.type is float:
        return ["0.5"]
    if isinstance(action.default, str) and action.default:
        return [action.default]
    return ["x"]


def _torch_options() -> list[tuple[str, argparse.Action]]:
    return [(opt, a) for a in _torch_parser()._actions if not isinstance(a, argparse._HelpAction)
            for opt in a.option_strings]


@pytest.fixture
def no_pet(monkeypatch):
    for name in list(os.environ):
        if name.startswith("PET_"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("option,action",
                         [pytest.param(opt, a, id=opt) for opt, a in _torch_options()])
def test_every_torchrun_option_is_accepted(option: str, action: argparse.Action, no_pet, capsys):
    run = _unbroken_run_parser()
    ours = run._option_string_actions.get(option)
    assert ours is not None, f"`unbroken run` has no {option} (torchrun has it)"
    assert _takes_value(ours) == _takes_value(action), (
        f"{option} takes a value under {'torchrun' if _takes_value(action) else 'unbroken'} only")
    argv = ["run", option, *_sample(action), "train.py", "--lr", "1"]
    try:
        args = _build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`unbroken {' '.join(argv)}` was refused: {capsys.readouterr().err}")
    assert args.script == "train.py" and args.script_args == ["--lr", "1"], vars(args)


def test_no_unbroken_option_shadows_a_torchrun_abbreviation() -> None:
    """argparse lets torchrun read `--redirect 3` as `--redirects 3`; an unbroken option of
    that name with another arity (a boolean --redirect) would read `3` as the script."""
    torch_opts = dict(_torch_options())
    for option, ours in _unbroken_run_parser()._option_string_actions.items():
        if option in torch_opts or not option.startswith("--"):
            continue
        meant = {id(a): a for t, a in torch_opts.items() if t.startswith(option)}
        if len(meant) == 1:
            (theirs,) = meant.values()
            assert _takes_value(ours) == _takes_value(theirs), (
                f"unbroken's {option} takes {'a' if _takes_value(ours) else 'no'} value; "
                f"torchrun reads {option} as {max(theirs.option_strings, key=len)}")


@pytest.mark.parametrize("option,action",
                         [pytest.param(a.option_strings[0], a, id=a.option_strings[0])
                          for a in _torch_parser()._actions
                          if type(a).__name__ in ("env", "check_env")])
def test_every_pet_variable_sets_its_flag(option: str, action: argparse.Action, no_pet):
    """torchrun reads PET_<DEST> as the default of every flag of its `env`/`check_env`
    actions; unbroken reads the same variable to the same effect."""
    value = _sample(action)
    by_flag = vars(_build_parser().parse_args(["run", option, *value, "train.py"]))
    no_pet.setenv(f"PET_{action.dest.upper()}", value[0] if value else "1")
    by_env = vars(_build_parser().parse_args(["run", "train.py"]))
    assert by_env == by_flag, f"PET_{action.dest.upper()} differs from {option}"
