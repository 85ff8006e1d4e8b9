"""The library calls that save or load a checkpoint, declared once: the hooks wrap each when
its module is imported (`hooks.arm`), and docs/goodput.md lists them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Op(StrEnum):
    SAVE = "save"
    LOAD = "load"


@dataclass(frozen=True)
class Call:
    """One function or method to wrap."""

    module: str
    """The module that defines it (waited for with `import_hooks.when_imported`)."""
    attribute: str
    """Its path in the module: `save`, or `Trainer._save_checkpoint` for a method."""
    op: Op
    name: str
    """The name the events give it (`script_save.call`)."""
    position: int | None = None
    """The positional index of its file or directory argument (a method's `self` is 0)."""
    keyword: str | None = None
    """The keyword of that argument."""
    directory_marker: str | None = None
    """For a directory: the file in it whose identity stands for the checkpoint (DCP's
    `.metadata`); None: every file the call wrote is collected from the calls inside it."""
    returns_future: bool = False
    """An asynchronous save: the script's waits on what it returns are timed too
    (`script_save_wait`), and the files are read when a wait ends."""


CALLS: tuple[Call, ...] = (
    Call("torch", "save", Op.SAVE, "torch.save", 1, "f"),
    Call("torch", "load", Op.LOAD, "torch.load", 0, "f"),
    Call("torch.distributed.checkpoint", "save", Op.SAVE, "torch.distributed.checkpoint.save",
         None, "checkpoint_id", ".metadata"),
    Call("torch.distributed.checkpoint", "async_save", Op.SAVE,
         "torch.distributed.checkpoint.async_save", None, "checkpoint_id", ".metadata",
         returns_future=True),
    Call("torch.distributed.checkpoint", "load", Op.LOAD, "torch.distributed.checkpoint.load",
         None, "checkpoint_id", ".metadata"),
    Call("safetensors.torch", "save_file", Op.SAVE, "safetensors.torch.save_file", 1,
         "filename"),
    Call("safetensors.torch", "load_file", Op.LOAD, "safetensors.torch.load_file", 0,
         "filename"),
    Call("transformers.trainer", "Trainer._save_checkpoint", Op.SAVE,
         "Trainer._save_checkpoint"),
    Call("transformers.trainer", "Trainer._load_from_checkpoint", Op.LOAD,
         "Trainer._load_from_checkpoint", 1, "resume_from_checkpoint"),
    Call("lightning.pytorch.trainer.trainer", "Trainer.save_checkpoint", Op.SAVE,
         "lightning Trainer.save_checkpoint", 1, "filepath"),
    Call("pytorch_lightning.trainer.trainer", "Trainer.save_checkpoint", Op.SAVE,
         "pytorch_lightning Trainer.save_checkpoint", 1, "filepath"),
)
"""Every save and load the hooks time. Nested calls (a `torch.save` inside the Trainer's
save) count once, as the outermost; the files the inner ones touched are the outer's."""
