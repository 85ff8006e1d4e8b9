"""One node's processes: workers, spares and the fork server they start from, and the watch
over them.

Owns the node supervisor (`supervisor`), starting and stopping a node's processes
(`worker_spawn`, `worker_process`), where their output goes (`worker_logs`), the
node's fork server as the agent holds it (`fork_client`), the board of ready spares
(`spare_board`), the heartbeat pages read on the agent's side (`heartbeat_reader`), the hang watch (`hang_watch`,
`hang_detector`), the orphan guard process (`orphan_guard`) and the relay of posted
departures (`departure_relay`). May import `launch.config`, `launch.log_spec`,
`launch.planning` (values), `control`, `telemetry` and `errors`; never the leader or the
agent.
"""
