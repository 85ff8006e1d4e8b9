"""The events of an unchanged script, measured from outside it (`runtime/watch/`): its steps,
seen by torch's global optimizer hooks, and its own checkpoint saves and loads, seen by
wrapping the libraries' calls. Written by every worker under `unbroken run` whose script
does not report to unbroken itself (source `worker`); `--no-integrations` turns them off.

A step here is the script's own: `step` counts the steps this worker process saw, from 1.
Which step of the job it was is known only once the accounting has matched a restarted
attempt's load to the save it came from (docs/goodput.md, "Scripts that report no steps").
"""

from __future__ import annotations

from unbroken.telemetry.event_names import Event
from unbroken.telemetry.schema.base import EventBody, doc, event

SECTION = "Events of an unchanged script (workers)"


@event(Event.SCRIPT_WATCHED)
class ScriptWatched(EventBody):
    """A worker's first line, before the script runs: what will be measured."""

    pid: int = doc("its process id")
    startup: float | None = doc("process start (a fork, for a worker the fork server forked) "
                                "to now: the interpreter and its imports")
    hooks: list[str] = doc("the calls watched so far: `optimizer.step`, `backward`, "
                           "`GradScaler.update`, and each save or load function of a library "
                           "already imported (the others are wrapped when their library is)")
    failed: list[str] = doc("hooks that could not be installed, each with why")


@event(Event.SCRIPT_STEPS)
class ScriptSteps(EventBody):
    """A step of the script ended (`runtime/watch/clock.py` says when one does); written at
    once, so that a SIGKILL loses none but the open one. A list, so that a writer may batch."""

    steps: list[list] = doc("each step as `[step, began, ended, updated, loss]`: `step` "
                            "counts the steps this worker process has seen (from 1); "
                            "`began`, the end of the step before (the process's first "
                            "`backward()` for its first); `ended`, its last optimizer "
                            "update; `updated` 0 where a GradScaler skipped the update; "
                            "`loss`, the tensor `backward()` was called on where reading it "
                            "needs no device sync (a one-element CPU tensor), else null")


@event(Event.SCRIPT_SAVE)
class ScriptSave(EventBody):
    """The script saved a checkpoint with a library's call (the outermost of nested ones)."""

    call: str = doc("the call: `torch.save`, `torch.distributed.checkpoint.save`, "
                    "`safetensors.torch.save_file`, `Trainer._save_checkpoint`, ...")
    path: str | None = doc("the file or directory; null for a stream (then the resume step "
                           "of a later load from it is unknown)")
    bytes: int | None = doc("bytes written, where a path tells")
    duration: float = doc("seconds inside the call (for an async save: the call only)")
    step: int = doc("the script's steps this process had seen when it was called")
    files: list[list[int]] = doc("each file it wrote, as `[st_dev, st_ino, st_size, "
                                 "st_mtime_ns]`: what a rename keeps")


@event(Event.SCRIPT_SAVE_WAIT)
class ScriptSaveWait(EventBody):
    """The script waited on an asynchronous save's future (`result()` on what
    `torch.distributed.checkpoint.async_save` returned): the wait stopped its loop."""

    call: str = doc("the save's call")
    path: str | None = doc("the save's file or directory")
    duration: float = doc("seconds the script waited")
    step: int = doc("the save's step (`script_save.step`)")
    files: list[list[int]] = doc("the save's files once written (for DCP, the directory's "
                                 "`.metadata`), as `[st_dev, st_ino, st_size, st_mtime_ns]`: "
                                 "a later load is matched to the save by them")


@event(Event.SCRIPT_LOAD)
class ScriptLoad(EventBody):
    """The script loaded a checkpoint with a library's call (the outermost of nested ones)."""

    call: str = doc("the call: `torch.load`, `torch.distributed.checkpoint.load`, ...")
    path: str | None = doc("the file or directory; null for a stream")
    bytes: int | None = doc("bytes read, where a path tells")
    duration: float = doc("seconds inside the call")
    step: int = doc("the script's steps this process had seen when it was called")
    files: list[list[int]] = doc("each file it read, as `[st_dev, st_ino, st_size, "
                                 "st_mtime_ns]`")
