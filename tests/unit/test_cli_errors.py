"""A user's mistake on the command line is one clear line on stderr and exit 2, found before
anything starts: `unbroken.cli.main` in process, no launcher, no worker. (A drain that cannot
reach its job, which needs a socket, is in tests/integration/test_lifecycle.py.)"""

from __future__ import annotations

import pytest
from conftest import EXAMPLE

from unbroken.cli import main

E = str(EXAMPLE)
CASES = [
    (["run", "--no-such-flag", E], ["--no-such-flag"]),
    (["run", "{tmp}/missing.py"], ["script not found", "missing.py"]),
    (["run", "--nproc-per-node", "0", E], ["at least 1"]),
    (["run", "--nnodes", "2", "--node-rank", "2", E], ["--node-rank"]),
    (["run", "--fault", "explode:rank=0,step=1", E], ["explode"]),
    (["run", "--nnodes", "4:1", E], ["--nnodes", "MIN"]),
    (["run", "--tee", "0:7", E], ["--tee"]),
    (["report", "{tmp}"], ["no event log"]),
    (["run", "--standby", "--nnodes", "2", "--node-rank", "1", E],
     ["--standby", "--node-rank of 2 or more"]),
    (["drain", "{tmp}", "--rank", "1"], ["control.json not found"]),
    (["drain", "--rank", "1"], ["give the job's --rdzv-endpoint"]),
    (["drain", "{tmp}"], ["one of the arguments --rank --node"]),
]


@pytest.mark.parametrize(("argv", "said"), CASES, ids=[" ".join("train.py" if x == E else x for x in a[:3]) for a, _ in CASES])
def test_bad_input_gets_one_clear_line_and_exit_2(argv, said, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a default run dir would land here
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines  # one clear line: no usage dump, no traceback
    for needle in said:
        assert needle in lines[0], lines[0]


def test_every_flag_of_every_sub_command_has_help():
    from unbroken.cli import _build_parser

    parser = _build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    bare = [(name, a.option_strings[0]) for name, p in sub.choices.items()
            for a in p._actions if a.option_strings and not a.help]
    assert not bare, bare


def test_an_unknown_flag_is_named_by_its_sub_command(capsys):
    from unbroken.cli import main

    with pytest.raises(SystemExit) as done:
        main(["report", "--bogus", "x"])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("unbroken report: error: unrecognized arguments: --bogus "
                   "(see `unbroken report --help`)")


def test_every_flag_with_a_default_shows_it_in_its_help():
    import argparse

    from unbroken.cli import _build_parser

    parser = _build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    silent = []
    for name, p in sub.choices.items():
        formatter = p._get_formatter()
        for a in p._actions:
            if not a.option_strings or a.default in (None, False, "", [], argparse.SUPPRESS):
                continue
            shown = formatter._get_help_string(a) % {"default": a.default}
            if "default" not in shown:
                silent.append((name, a.option_strings[0]))
    assert not silent, silent
    run_help = sub.choices["run"].format_help()
    assert "(default: 30.0)" in " ".join(run_help.split())  # --control-retry-window
