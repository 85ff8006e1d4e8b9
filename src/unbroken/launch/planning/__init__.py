"""The leader's decisions, as pure functions: no I/O, no clock, no process.

Owns `planner.decide(state, inbox, config) -> (state, commands)` and what it is made of:
its state (`planner_state`), its commands (`planner_commands`), the node lifecycle
(`node_life`) and node set (`node_set`), the culprit of a hang (`culprit`), drains
(`planner_drains`), refills of lost slots (`planner_refills`) and the restart budget
(`budget`). May import `control.messages`, `control.schema`, `telemetry.schema` and
`errors` (values only); never a backend, a channel, the leader's executor or the agent.
Its unit tests run without a process.
"""
