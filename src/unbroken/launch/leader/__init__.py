"""The leader role: a thin shell of I/O around the planner.

Owns the leader (`leader.Leader`), each attempt's rendezvous (`leader_rendezvous`), its
dealings with the other agents (`leader_followers`), the chores that decide nothing
(`leader_chores`: telemetry, records) and the executor that reads the inbox, calls
`planning.planner.decide` and carries out its commands (`plan_executor`). May import
`launch.planning`, `launch.workers`, `launch.role`, `control`, `telemetry` and `errors`;
the planning package never imports it back.
"""
