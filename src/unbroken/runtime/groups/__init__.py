"""Process groups a worker forms in a generation, and aborts from the inside.

Owns the abortable groups of a generation and the errors their backends report
(`process_group`), generation 0's group (`first_group`), a group the script forms itself,
made the launcher's (`script_group`), what kind of model and world a worker has (`world`),
and the exact, bucket-independent gradient reduction (`exact_reduce`). May import the
runtime's plumbing (`step_probe`), `control`, `telemetry` and `errors`; nothing else of the
runtime.
"""
