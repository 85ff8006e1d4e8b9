"""Reading DCP checkpoints without executing anything a checkpoint file contains.

DCP's `.metadata` file is a pickle, and `FileSystemReader` unpickles it with plain `pickle`,
so a crafted checkpoint could run code on load. This reader allows only the metadata
classes DCP itself writes. Tensors are read as raw bytes; DCP's default planner reads every
other value (a learning rate, a step count) with `torch.load(weights_only=False)`, which
executes pickles, so `SafeLoadPlanner` reads them with `weights_only=True`.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_ALLOWED: dict[str, set[str] | None] = {
    "torch.distributed.checkpoint.metadata": None,  # any class defined there
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "pathlib._local": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The checkpoint's metadata asks for something that is not checkpoint metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        allowed = _ALLOWED.get(module, set())
        if module == "torch.distributed.checkpoint.metadata":
            obj = getattr(dcp_metadata, name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        elif allowed and name in allowed:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


def load_metadata(path: str | pathlib.Path) -> Metadata:
    with open(path, "rb") as fh:
        metadata = _MetadataUnpickler(fh).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError("checkpoint metadata is not a DCP Metadata object")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = load_metadata(pathlib.Path(self.path) / ".metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor values as plain data only."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise UnsafeCheckpointError(
                f"value {fqn} is not plain data (a pickle that would build arbitrary objects)"
            ) from None
        if self.flatten_state_dict:  # as DefaultLoadPlanner does, minus the unsafe load
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
