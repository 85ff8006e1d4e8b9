"""`unbroken run`'s flags are declared once, as fields of typed groups, and the parser is
generated from them: each field carries its flag, its help and its PET_ variable, no option
or variable is declared twice, and the generated parser has exactly the flags, variables,
choices and defaults that the hand-written one had (tests/unit/golden/run_flags.json,
captured from it before it was replaced)."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest

from unbroken.errors import UserError
from unbroken.launch.flags.declare import Kind, declared, pet_name
from unbroken.launch.flags.groups import GROUPS, Etcd, Hangs, Recovery, Rendezvous
from unbroken.launch.flags.parser import add_run_flags

GOLDEN = Path(__file__).parent / "golden" / "run_flags.json"

# The hand-written parser's defaults of None were resolved later to these values; the
# groups declare the effective default instead.
RESOLVED_DEFAULTS = {"--monitor-interval": 0.05, "--shutdown-timeout": 3.0}


def _declared():
    return [(field, spec) for group in GROUPS for field, spec in declared(group)]


def _options(entries) -> Counter:
    return Counter(opt for entry in entries for opt in entry)


def test_each_field_declares_its_flag_help_and_pet_variable_once() -> None:
    fields = _declared()
    names = Counter(field.name for field, _ in fields)
    assert [n for n, k in names.items() if k > 1] == [], "a field name (argparse dest) twice"
    options = _options(spec.names + spec.renamed_from for _, spec in fields)
    assert [o for o, k in options.items() if k > 1] == [], "an option string twice"
    pets = Counter(pet_name(field, spec) for field, spec in fields)
    del pets[None]  # the script and its arguments
    assert [p for p, k in pets.items() if k > 1] == [], "a PET_ variable twice"
    for field, spec in fields:
        assert spec.help.strip(), f"{field.name} has no help"
        if spec.kind not in (Kind.POSITIONAL, Kind.REST):
            assert spec.names and pet_name(field, spec).startswith("PET_"), field.name


def test_the_generated_parser_has_exactly_the_flags_the_hand_written_one_had() -> None:
    golden = json.loads(GOLDEN.read_text())
    ours = {spec.names + spec.renamed_from: (field, spec) for field, spec in _declared()
            if spec.names}
    assert sorted(ours) == sorted(tuple(g["options"]) for g in golden)
    for g in golden:
        field, spec = ours[tuple(g["options"])]
        flag = g["options"][0]
        assert pet_name(field, spec) == g["pet"], flag
        assert (spec.kind not in (Kind.SWITCH, Kind.OFF_SWITCH)) == g["takes_value"], flag
        assert list(spec.choices or ()) == (g["choices"] or []), flag
        default = field.default_factory() if callable(field.default_factory) else field.default
        assert default == RESOLVED_DEFAULTS.get(flag, g["default"]), flag


def test_the_parser_reads_pet_variables_from_the_mapping_it_is_given() -> None:
    """As torch's `env` and `check_env` actions: a default from the environment, read when
    the option is made; the command line still wins."""
    parser = argparse.ArgumentParser()
    add_run_flags(parser, {"PET_MAX_RESTARTS": "4", "PET_STANDALONE": "1", "PET_FAULT": "crash",
                           "PET_FORK_SERVER": "1", "PET_SHUTDOWN_TIMEOUT": "7"})
    args = parser.parse_args(["--fault", "hang", "s.py"])
    assert (args.max_restarts, args.standalone, args.fault) == (4, True, ["crash", "hang"])
    assert args.fork_server is False and args.kill_grace == 7.0
    assert parser.parse_args(["--max-restarts", "1", "s.py"]).max_restarts == 1
    quiet = argparse.ArgumentParser()
    add_run_flags(quiet, {})
    assert quiet.parse_args(["s.py"]).max_restarts == 0


def test_a_renamed_flag_parses_with_a_one_line_deprecation(capsys) -> None:
    parser = argparse.ArgumentParser(prog="unbroken run")
    add_run_flags(parser, {})
    assert parser.parse_args(["--no-warm-restarts", "s.py"]).fork_server is False
    assert capsys.readouterr().err == ("unbroken run: --no-warm-restarts is deprecated: use "
                                       "--no-fork-server (the old name will be removed in a "
                                       "later release)\n")
    assert parser.parse_args(["--no-fork-server", "s.py"]).fork_server is False
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("make,says", [
    (lambda: Recovery(max_restarts=-1), "--max-restarts must be 0 or more, got -1"),
    (lambda: Recovery(spares=1, on_fault="restart"), "--spares takes failed workers' ranks"),
    (lambda: Recovery(quarantine_after=-2), "--quarantine-after must be 0 or more"),
    (lambda: Etcd(etcd_cert="/nonexistent.pem"), "file not found: /nonexistent.pem"),
    (lambda: Rendezvous(nnodes="3:1"), "MIN must not exceed MAX"),
    (lambda: Rendezvous(rdzv_backend="etcd"), "needs --rdzv-endpoint"),
    (lambda: Rendezvous(run_id="a/b"), "--rdzv-id may hold"),
])
def test_each_group_validates_itself_in_one_line(make, says) -> None:
    with pytest.raises(UserError, match=says) as err:
        make()
    assert len(str(err.value).splitlines()) == 1


def test_the_groups_defaults_are_valid() -> None:
    """`LaunchConfig` holds Recovery, Hangs, Etcd and Telemetry whole, made with defaults
    where a caller (the demo) names none."""
    assert Recovery().quarantine.after == 3 and Hangs().monitor_interval == 0.05
    assert Etcd().credentials.cacert is None and Rendezvous().node_range.max == 1
