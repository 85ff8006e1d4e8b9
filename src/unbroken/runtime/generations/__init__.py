"""Leaving a generation and joining the next, inside a worker: the in-place protocol's moves.

Owns the worker's side of the generation protocol (`membership`), leaving and joining
(`recovery.Generations`), state from peers after a switch (`state_sync`), the fence before
every update (`fence`), and the watchdog thread that aborts a generation on the leader's
notice (`watchdog`) and dumps torch's flight recorder (`flight_recorder`). May import
`runtime.groups`, the runtime's plumbing (`heartbeat`, `position`, `config`, `tracked`),
`control`, `telemetry` and `errors`; never the engine, the sharded state or the launcher.
The engine drives it through `runtime/switching.py`; the sequence is in
docs/design-notes.md ("In-place recovery", "NCCL's asynchronous semantics").
"""
