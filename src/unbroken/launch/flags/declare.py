"""Declaring a flag once, as a field of a typed group: `flag(...)` gives the field its
spellings, help, value parser and `PET_` variable; `add_group` makes the group's argparse
options from its fields, and `read_group` builds the group back from a parsed namespace
(its `__post_init__` then validates it).

`PET_<NAME>` variables (as Kubeflow's PyTorchJob and TrainJob set them) are read the way
torch's launcher reads them (`torch.distributed.argparse_util`'s `env` and `check_env`): each
option's action takes its default from the environment when it is made, so a flag on the
command line still wins. A value outside the flag's choices stands in as a `BadPet`, which
`read_group` turns into one line naming the flag and the variable.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from unbroken.errors import UserError
from unbroken.launch.flags.values import truthy

_KEY = "unbroken.flag"


class Kind(Enum):
    """How a flag takes its value."""

    VALUE = "value"
    """`--flag VALUE` (torch's `env`)."""
    SWITCH = "switch"
    """`--flag` sets True (torch's `check_env`)."""
    OFF_SWITCH = "off"
    """`--no-thing` sets False; its PET_ variable, when true, also means the flag is given."""
    APPEND = "append"
    """`--flag VALUE`, repeatable; the PET_ variable is one value."""
    POSITIONAL = "positional"
    """The script; no PET_ variable."""
    REST = "rest"
    """Everything after the script; no PET_ variable."""


@dataclass(frozen=True)
class Flag:
    """One command-line flag, as declared on its field."""

    names: tuple[str, ...]
    """Its option strings, the first one named in errors; () for a positional."""
    help: str
    parse: Callable[[str], Any] | None = None
    """The argparse `type`: text to value (an `ArgumentTypeError` is a one-line usage error)."""
    choices: tuple[str, ...] | None = None
    kind: Kind = Kind.VALUE
    metavar: str | None = None
    pet: str | None = None
    """Its torchrun variable; None: `PET_<FIELD NAME>`."""
    renamed_from: tuple[str, ...] = ()
    """Its old names: still parsed, each saying in one stderr line that it is deprecated."""


def flag(*names: str, help: str, default: Any = None, parse: Callable[[str], Any] | None = None,
         choices: tuple[str, ...] | None = None, kind: Kind = Kind.VALUE,
         metavar: str | None = None, pet: str | None = None, torchrun: bool = False,
         renamed_from: tuple[str, ...] = ()) -> Any:
    """A dataclass field that is also a flag. `torchrun=True`: the first name is torchrun's,
    taken in its two spellings (`--nproc-per-node` and `--nproc_per_node`). `renamed_from`:
    the flag's old names, parsed with a one-line deprecation."""
    if torchrun and "-" in names[0][2:]:
        names = (names[0], "--" + names[0][2:].replace("-", "_"), *names[1:])
    meta = Flag(tuple(names), help, parse, choices, kind, metavar, pet, renamed_from)
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={_KEY: meta})
    return dataclasses.field(default=default, metadata={_KEY: meta})


def declared(group: type) -> list[tuple[dataclasses.Field, Flag]]:
    """The group's fields that are flags, in declaration order."""
    return [(f, f.metadata[_KEY]) for f in dataclasses.fields(group) if _KEY in f.metadata]


def pet_name(field: dataclasses.Field, spec: Flag) -> str | None:
    if spec.kind in (Kind.POSITIONAL, Kind.REST):
        return None
    return spec.pet or f"PET_{field.name.upper()}"


@dataclass(frozen=True)
class BadPet:
    """A `PET_` value outside its flag's choices, stood in for the flag's value."""

    message: str


class _Renamed(argparse.Action):
    """An action that says, in one stderr line, when it was called by an old name."""

    def __init__(self, option_strings: list[str], dest: str, renamed: tuple[str, ...] = (),
                 **kw: Any) -> None:
        self.renamed = renamed
        super().__init__(option_strings, dest, **kw)

    def deprecation(self, parser: Any, option_string: Any) -> None:
        if option_string in self.renamed:
            now = next(o for o in self.option_strings if o not in self.renamed)
            sys.stderr.write(f"{parser.prog}: {option_string} is deprecated: use {now} "
                             "(the old name will be removed in a later release)\n")


class PetValue(_Renamed):
    """torch's `env` action: the default is `PET_<NAME>` when set (a string, which argparse
    then passes through the flag's type, as it would the command line's)."""

    def __init__(self, option_strings: list[str], dest: str, pet: str, env: Mapping[str, str],
                 default: Any = None, choices: Any = None, **kw: Any) -> None:
        if pet in env:
            value = env[pet]
            default = value if choices is None or value in choices else BadPet(
                f"{option_strings[0]} must be one of {', '.join(map(str, choices))}, got "
                f"{value!r} (from {pet})")
        super().__init__(option_strings, dest, default=default, choices=choices, **kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        self.deprecation(parser, option_string)
        setattr(namespace, self.dest, values)


class PetSwitch(_Renamed):
    """torch's `check_env`: a switch whose default is its `PET_` variable read as a number
    (`true` and `yes` too); `const` is what the flag sets (False for `--no-...`)."""

    def __init__(self, option_strings: list[str], dest: str, pet: str, env: Mapping[str, str],
                 const: bool = True, **kw: Any) -> None:
        given = pet in env and truthy(env[pet])
        super().__init__(option_strings, dest, nargs=0, const=const,
                         default=const if given else not const, **kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        self.deprecation(parser, option_string)
        setattr(namespace, self.dest, self.const)


class PetAppend(_Renamed):
    """A repeatable flag; its `PET_` variable is the first value."""

    def __init__(self, option_strings: list[str], dest: str, pet: str, env: Mapping[str, str],
                 default: Any = None, **kw: Any) -> None:
        super().__init__(option_strings, dest, default=[env[pet]] if pet in env else default, **kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        self.deprecation(parser, option_string)
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), values])


_ACTIONS = {Kind.VALUE: PetValue, Kind.SWITCH: PetSwitch, Kind.OFF_SWITCH: PetSwitch,
            Kind.APPEND: PetAppend}


def add_group(parser: argparse.ArgumentParser, group: type, env: Mapping[str, str]) -> None:
    """Add the group's flags to `parser`, under the group's title (its docstring's first
    line), with defaults from the `PET_` variables in `env`."""
    title, _, _ = (group.__doc__ or group.__name__).partition("\n")
    out = parser.add_argument_group(title.rstrip("."))
    for field, spec in declared(group):
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING \
            else field.default
        if spec.kind == Kind.POSITIONAL:
            out.add_argument(field.name, help=spec.help)
            continue
        if spec.kind == Kind.REST:
            out.add_argument(field.name, nargs=argparse.REMAINDER, help=spec.help)
            continue
        kw: dict[str, Any] = {"dest": field.name, "help": spec.help, "action": _ACTIONS[spec.kind],
                              "pet": pet_name(field, spec), "env": env,
                              "renamed": spec.renamed_from}
        if spec.kind == Kind.OFF_SWITCH:
            kw["const"] = False
        elif spec.kind != Kind.SWITCH:
            kw.update(default=default, type=spec.parse, choices=spec.choices,
                      metavar=spec.metavar)
        out.add_argument(*spec.names, *spec.renamed_from, **kw)


def read_group(group: type, namespace: argparse.Namespace) -> Any:
    """The group, from the parsed namespace; a `PET_` value outside its choices, or the
    group's own validation, is a `UserError`."""
    values = {field.name: getattr(namespace, field.name) for field, _ in declared(group)}
    for value in values.values():
        if isinstance(value, BadPet):
            raise UserError(value.message)
    return group(**values)
