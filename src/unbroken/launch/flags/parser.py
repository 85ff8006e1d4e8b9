"""`unbroken run`'s parser, generated from the flag groups, and read back into a
`LaunchConfig`."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from unbroken.launch.flags.declare import add_group, read_group
from unbroken.launch.flags.groups import GROUPS, RunFlags

if TYPE_CHECKING:
    from unbroken.launch.config import LaunchConfig


def add_run_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] = os.environ) -> None:
    """Every group's flags, with their defaults from the `PET_` variables in `env`."""
    for group in GROUPS:
        add_group(parser, group, env)


def read_run_flags(args: argparse.Namespace) -> RunFlags:
    """The groups, each validated; a `UserError` names the first mistake."""
    return RunFlags(*(read_group(group, args) for group in GROUPS))


def config_from_args(args: argparse.Namespace, warn: Callable[[str], None]) -> LaunchConfig:
    """The `LaunchConfig` of parsed `unbroken run` flags (see `resolve.launch_config`)."""
    from unbroken.launch.flags.resolve import launch_config  # imports torch: not at `--help`

    return launch_config(read_run_flags(args), warn)
