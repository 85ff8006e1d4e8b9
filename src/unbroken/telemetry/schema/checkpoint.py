"""The workers' checkpoint events."""

from __future__ import annotations

from unbroken.telemetry.event_names import Event
from unbroken.telemetry.schema.base import EventBody, doc, event, optional

SECTION = "Checkpoint events (workers)"


@event(Event.CHECKPOINT_INTERVAL)
class CheckpointInterval(EventBody):
    """Rank 0, when the interval is set or changes."""

    steps: int = doc("steps between saves")
    reason: str = doc("`every N steps`, `every T s`, or the Young/Daly inputs: cost, MTBF, "
                      "persist time")


@event(Event.CHECKPOINT_SAVED)
class CheckpointSaved(EventBody):
    """Every rank, once the checkpoint is committed."""

    step: int = doc("the step")
    path: str = doc("the checkpoint's directory")
    bytes: int | None = doc("rank 0: the checkpoint's size")
    stall: float = doc("what it cost this rank's loop: the call plus any wait for the copy "
                       "before the next optimizer update")
    snapshot: float = doc("the background copy into host memory: the staged copy (the "
                          "field's name predates the term; not the peer snapshots)")
    persist: float = doc("write, fsync, commit, retention")
    durable: float = doc("call to commit")
    deleted: list[int] | None = doc("steps removed by retention (rank 0)")
    retention_error: str | None = doc("why retention failed, or null")
    staged_bytes: int | None = optional(
        "bytes this rank staged: its shards and the replicated tensors it writes (a "
        "data-parallel rank leaves the others' to them)")
    pinned_bytes: int | None = optional(
        "host bytes pinned for the staged copy (GPU: exactly its size; 0 on CPU)")


@event(Event.CHECKPOINT_FAILED)
class CheckpointFailed(EventBody):
    """Every rank: nothing was committed and the previous checkpoint stays the latest."""

    step: int = doc("the step")
    error: str = doc("each failing rank's first line, e.g. `rank 1: OSError: [Errno 28] No "
                     "space left on device`")
    stall: float | None = optional("what it cost this rank's loop")
    duration: float | None = optional("seconds")
    final: bool = doc("the end-of-training save could not be made because the last one was "
                      "still being written", False)


@event(Event.CHECKPOINT_DIR_NOT_SHARED)
class CheckpointDirNotShared(EventBody):
    """Rank 0, at its first refused save (once per worker process, with the one line on
    stderr): checkpoint_dir is not storage every node can see (each host's own disk at that
    path); nothing is committed, now or at any later save (each is a `checkpoint_failed`),
    and training goes on."""

    step: int = doc("the step")
    path: str = doc("checkpoint_dir as rank 0 resolves it")
    unseen: int = doc("files other ranks wrote that rank 0 cannot see in the directory it was "
                      "about to commit, or sees with another size")
    files: int = doc("how many files the other ranks wrote")
    examples: list[str] = doc("up to 3, e.g. `rank 1's __1_0.distcp`")


@event(Event.CHECKPOINT_DEFERRED)
class CheckpointDeferred(EventBody):
    """A save fell due while the last was still being written somewhere; training did not
    wait."""

    step: int = doc("the step")
    retry_at: int | float | None = doc("when it is tried again")
    writing: int | None = doc("the step this rank is still writing, or null if another rank "
                              "is")


@event(Event.CHECKPOINT_STUCK)
class CheckpointStuck(EventBody):
    """A save has been in flight longer than `checkpoint_timeout`; saves stay deferred until
    it ends."""

    step: int = doc("the step")
    seconds: float = doc("in flight")
    timeout: float = doc("`checkpoint_timeout`")


@event(Event.CHECKPOINT_LOADED)
class CheckpointLoaded(EventBody):
    """A checkpoint was loaded."""

    step: int = doc("its step")
    path: str = doc("its directory")
    duration: float | None = doc("seconds")


@event(Event.CHECKPOINT_INVALID)
class CheckpointInvalid(EventBody):
    """Rank 0: a checkpoint cannot be loaded, or is passed over; the next older one is tried."""

    step: int = doc("its step")
    path: str = doc("its directory")
    reason: str = doc("torn, truncated, corrupt; or `unverified: ...` (its replicas "
                      "disagreed, and a verified checkpoint exists)")
