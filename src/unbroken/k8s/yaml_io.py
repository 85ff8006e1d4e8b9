"""PyYAML, imported where `unbroken k8s` needs it (the `k8s` extra), or one clear line."""

from __future__ import annotations

from typing import Any

from unbroken.errors import UserError


def pyyaml() -> Any:
    """The `yaml` module, or a UserError saying how to install it."""
    try:
        import yaml
    except ImportError:
        raise UserError("unbroken k8s writes YAML with PyYAML: pip install 'unbroken[k8s]'") from None
    return yaml
