"""Sharded state in place (FSDP2, HSDP): a rank's shards, their host copies and snapshots.

Owns what a rank holds of a sharded model (`shards`), the flat host copy of it
(`host_copy`), the in-memory snapshot rounds replicated to buddies on other nodes
(`snapshots`, paced by `snapshot_pacer`), the pure plan of where each rank of a new
generation gets its shard (`shard_plan`), and the switch of a sharded job into a new
generation (`shard_sync`). May import `runtime.generations` (its state transfer),
`runtime.groups`, `checkpoint`, `control`, `telemetry` and `errors`; never the engine.
"""
