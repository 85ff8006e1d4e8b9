"""Inside the worker: the step transaction, its recovery in place, and what it tracks.

Public (what the integrations and users import): `run` (`unbroken.init`, `Run`), `engine`
(the step transaction any loop drives), `position`. Layers, highest first (the `runtime`
contract in pyproject.toml): the entry points (`bootstrap`, `session`); `run`; `engine`;
its moves between generations (`switching`, `spare`); what they move and check (the
packages `anomalies` and `sharded`, and `checkpoint_duty`); the protocol's moves
(`generations`); process groups (`groups`); the plumbing (`config`, `tracked`, `position`,
`heartbeat`, `progress`, `step_probe`, `control_link`, `host`, `warm_imports`).
"""
