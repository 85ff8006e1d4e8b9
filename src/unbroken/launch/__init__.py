"""The agent: spawns and watches workers, holds the control store on node 0, restarts.

Layers, highest first (the `launcher` contract in pyproject.toml): the `agent`; its roles
and commands (`leader` package, `follower`, `drain`, `returning`, `first_contact`,
`failure_report`); what both roles share (`role`, `attempt`, `election`, `dead_job`); one
node's processes (`workers`); the configuration (`config`, `flags`, `log_spec`); and the
planner's pure decisions (`planning`). The agent never loads the worker runtime.
"""
