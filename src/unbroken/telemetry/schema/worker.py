"""The workers' events (scripts using `unbroken.init`). (Their checkpoints:
`schema.checkpoint`; the fork server's and the old warm interpreters': `schema.warm`.)"""

from __future__ import annotations

from unbroken.telemetry.event_names import Event
from unbroken.telemetry.schema.base import EventBody, doc, event, optional

SECTION = "Worker events (scripts using `unbroken.init`)"


@event(Event.WORKER_START)
class WorkerStart(EventBody):
    """A worker finished `unbroken.init`."""

    pid: int = doc("its process id")
    world_size: int = doc("the world size")
    startup: float | None = doc("process start (a fork, for a worker the fork server forked) "
                                "to the end of `init`, imports included")
    process_group: float = doc("`init_process_group` time")
    wid: str | None = doc("its worker id")
    joining: bool = doc("a replacement")


@event(Event.RESUME)
class Resume(EventBody):
    """Training (re)starts."""

    step: int = doc("the first step to run")
    total: int | None = doc("the steps to run in all")
    gen: int | None = optional("the generation")


@event(Event.STEP)
class Step(EventBody):
    """A step was committed. Its `extra` keys are the metrics given to `run.log` (the example
    logs `loss` and `data`, a CRC of the batch)."""

    step: int = doc("the step")
    duration: float = doc("the loop body; with `run.train`, the step function plus the "
                          "optimizer update")
    gen: int | None = optional("the generation that committed it")

    @property
    def loss(self) -> float | None:
        """The `loss` metric, if the script logged one."""
        return self.extra.get("loss")


@event(Event.STEP_FAILED)
class StepFailed(EventBody):
    """In place: the step function raised; a `user` error: the worker recovers in place;
    `own_device` (a CUDA error, or NCCL's about its own device): the worker exits and a fresh
    process takes its rank."""

    step: int = doc("the step")
    gen: int = doc("the generation")
    error: str = doc("the error's first line")
    traceback: str = doc("the traceback")
    error_class: str = doc("`peer`, `own_device` or `user`")


@event(Event.GEN_LEAVE)
class GenLeave(EventBody):
    """In place: the worker left its generation."""

    gen: int = doc("the generation left")
    step: int = doc("committed steps held")
    reason: str = doc("`peer`: a collective failed; `exception`; `switch`: asked to move at a "
                      "step boundary; `superseded`: a member died before the generation "
                      "formed; `no_state`: the state cannot come from a peer; "
                      "`out_of_memory`: the switch ran out of memory, and is tried again")
    holds_state: bool = doc("whether it holds the committed state")
    duration: float = doc("seconds to leave")
    error: str | None = optional("the error it left on (`peer`, `exception`), first line: "
                                 "`UpdateRefused` where the fence refused the step's update")
    drained: bool | None = optional(
        "a planned switch on a GPU: whether the device's work in flight finished before the "
        "old groups were aborted (false: the drain's bound passed, and it was aborted)")


@event(Event.SWITCH_FAILED)
class SwitchFailed(EventBody):
    """In place: a member died or left while this generation formed; the worker waits for the
    next plan."""

    gen: int = doc("the generation")
    error: str = doc("the error")
    out_of_memory: bool | None = optional(
        "the switch ran out of memory (its state sync or the rebuild): a fault of the switch, "
        "never the user's; the old generation's memory is freed and the switch tried once "
        "more, then the job restarts")


@event(Event.GEN_SWITCH)
class GenSwitch(EventBody):
    """In place: the worker joined a generation."""

    gen: int = doc("the generation joined")
    reason: str = doc("why it left the last one")
    step: int = doc("its step")
    world_size: int = doc("the generation's size")
    state_from: int | None = doc("rank that sent this worker the state, or null")
    received_bytes: int = doc("bytes received")
    tries: int = doc("tries to form it")
    rolled_back: int = doc("committed steps this worker gave up: sharded state resumed from an "
                           "older snapshot")
    duration: float = doc("leave → ready to train")
    free: float | None = optional("phase: the old generation's memory collected and the "
                                  "CUDA cache emptied, before the new one is made")
    wait_plan: float | None = optional("phase: waiting for the plan")
    gather: float | None = optional("phase: gathering the members")
    form: float | None = optional("phase: forming the process groups")
    sync: float | None = optional("phase: state from peers")
    build: float | None = optional("phase: the user's `build()`")


@event(Event.IN_PLACE_UNAVAILABLE)
class InPlaceUnavailable(EventBody):
    """Faults restart every worker from the checkpoint (said at the start of `run.train`, or
    where a framework's first updates broke the order its adapter relies on; never at the
    first fault)."""

    reason: str = doc("the script initialised the process group itself, or its state cannot "
                      "be recovered in place (a second device mesh, a placement other than "
                      "Shard/Replicate, optimizer state that is not plain data; named)")


@event(Event.LOADER_POSITIONED)
class LoaderPositioned(EventBody):
    """`run.steps(data=...)`: a stateful loader (torchdata's `StatefulDataLoader`) was placed
    at a step it had not just drawn (a promoted spare, a replacement, a restart)."""

    step: int = doc("the step whose batch it draws next")
    mark: str = doc("the state it loaded: `own` (this worker's), `store` (the rank's mark "
                      "in the control store, published by whoever held the rank) or `start` "
                      "(the loader's first state: no usable mark)")
    dropped: int = doc("batches drawn and dropped after loading it")
    seconds: float = doc("time to place it")


@event(Event.LOADER_MARK_UNPUBLISHED)
class LoaderMarkUnpublished(EventBody):
    """A stateful loader's mark could not be written to the control store; the next step's
    tries again (a rank lost meanwhile is placed from an older mark, by more draws)."""

    error: str = doc("the error")


@event(Event.JOINER_UNUSED)
class JoinerUnused(EventBody):
    """A replacement or spare that the job finished without; it exits 0."""

    wid: str | None = optional("its worker id")


@event(Event.SPARE_READY)
class SpareReady(EventBody):
    """A spare warmed up on a private group."""

    wid: str = doc("the spare")
    shadow_steps: int = doc("steps it ran to warm up")
    duration: float = doc("its warm-up")
    sharded: bool | None = optional("it warmed up as one rank of the real world size, so it "
                                    "holds shards only")
    shard_bytes: int | None = optional("sharded: its shards' bytes")
    largest_tensor_bytes: int | None = optional("sharded: its largest tensor's bytes")
    cpu: float | None = optional("its own CPU seconds from its start to ready (forked by the "
                                 "node's fork server: from the fork, the imports excluded)")


@event(Event.SHARD_SYNC)
class ShardSync(EventBody):
    """A sharded switch."""

    gen: int = doc("the generation")
    step: int = doc("resumed from")
    committed: int | None = doc("this rank's step before, or null")
    restored: bool = doc("from its own in-memory snapshot")
    sender: int | None = doc("the rank it received its shard from, or null")
    received_bytes: int = doc("bytes received")
    transfers: list[list[int | bool]] = doc("[src, dst, live] for every shard moved")


@event(Event.SNAPSHOT_CONFIG)
class SnapshotConfig(EventBody):
    """Sharded, in place: the in-memory snapshots' settings."""

    every: int = doc("steps between in-memory snapshots")
    auto: bool = doc("chosen by unbroken")
    replicas: int = doc("copies kept on peers")
    shard_bytes: int = doc("this rank's shards")
    host_bytes: int = doc("host memory per rank for every copy: (1 + 2 x replicas) x "
                          "shard_bytes, the storage checkpoint's included, and "
                          "`transient_bytes`")
    round_s: float | None = optional("a round's exchange and copy")
    step_s: float | None = optional("the step time")
    checkpoint_every: int | None = optional("the checkpoint interval in steps, which `every` "
                                            "never exceeds")
    transient_bytes: int | None = optional(
        "GPU shards: the pinned chunks a round's exchange stages its sends through")


@event(Event.SNAPSHOTS_REFUSED)
class SnapshotsRefused(EventBody):
    """Sharded: in-memory snapshots would not fit in host memory."""

    reason: str = doc("with the figures")
    need_bytes: int = doc("host memory they need")
    available_bytes: int | None = doc("host memory available")


@event(Event.ABORT_ON_NOTICE)
class AbortOnNotice(EventBody):
    """In place: the leader broke the generation while this worker was inside a step; its
    watchdog thread aborted the generation's groups so that a collective blocked on a silent
    peer fails now."""

    gen: int = doc("the generation aborted")
    target_gen: int = doc("the generation to come")
    step: int = doc("the step")


@event(Event.PHASE)
class Phase(EventBody):
    """A phase the script declared long (`with run.phase(name):`) ended; no step timeout ran
    meanwhile."""

    name: str = doc("the phase")
    step: int = doc("the step")
    duration: float = doc("seconds")


@event(Event.FLIGHT_RECORDER_DUMPED)
class FlightRecorderDumped(EventBody):
    """In place, where the user turned torch's flight recorder on: the worker's watchdog
    dumped it before the evidence of a hang is destroyed (`runtime/generations/flight_recorder.py`)."""

    path: str = doc("the file written (torch's analyser, `fr_trace`, reads a folder of them)")
    bytes: int = doc("its size")
    reason: str = doc("`abort`: before its watchdog aborted its generation on the leader's "
                      "notice; `peer`: a collective failed on a peer's fault, before the "
                      "worker left the generation (the first of the two, once a generation); "
                      "`asked`: its agent asked, before killing a rank blamed for a hang")


@event(Event.FAULT_INJECTED)
class FaultInjected(EventBody):
    """Just before an injected fault fires."""

    fault: str = doc("the fault as given")
    kind: str = doc("its kind")
    step: int | None = doc("the step")
    at: str = doc("a process fault's point: `step`, `join`, `send`, `teardown`, `update`, "
                  "`persist` (the fault language's `FAULT_POINTS`); a numeric fault's: `grad` "
                  "(nan), `loss` (spike), `update` (bitflip)")


@event(Event.TRAINING_DONE)
class TrainingDone(EventBody):
    """The worker finished training."""

    step: int = doc("the last step + 1")
    gen: int | None = optional("the generation")
    pid: int | None = optional("its process id")


@event(Event.STEP_DROPPED)
class StepDropped(EventBody):
    """The loop dropped a step before its update (`Engine.drop`): nothing of it was
    committed, and it runs again."""

    step: int = doc("the step dropped")
    gen: int = doc("the generation")
    reason: str = doc("why, as the loop said it")


@event(Event.MICRO_BATCHES_REPLAYED)
class MicroBatchesReplayed(EventBody):
    """After an in-place recovery inside a gradient-accumulation update, a framework
    integration ran the update's earlier micro-batches again on the same inputs: the
    half-accumulated update was dropped, never committed."""

    step: int = doc("the step whose update was redone")
    gen: int = doc("the generation it was redone in")
    micro_batches: int = doc("the earlier micro-batches run again")


@event(Event.ROLLED_BACK)
class RolledBack(EventBody):
    """The loop rolled back (`Engine.rollback`, collective): to the newest host copy of the
    state (a sharded job's own in-memory copy, or a replicated job's last checkpoint's staged
    copy), else to the newest checkpoint in storage."""

    step: int = doc("the step resumed from")
    from_step: int = doc("the step it was at")
    reason: str = doc("why, as the loop said it")
    restored_from: str = doc("`host` (the host copy, no storage read) or `storage`")
