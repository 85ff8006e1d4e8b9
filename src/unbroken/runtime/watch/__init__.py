"""Watching an unchanged script: its steps and its own checkpoints, measured from outside.

A script run by `unbroken run` that never calls `unbroken.init()` reports nothing to us. So
that its goodput is known all the same, every worker wraps, before the script or any library
is imported (`hooks.arm`: in the fork server before its preimports, in a cold worker before
the script), the calls that say what the script does: torch's global optimizer step hooks,
`backward()`, a GradScaler's `update`, and each library's save and load (`calls.CALLS`).
`clock` decides from those calls where one step ends (pure); `watcher.Watch` writes the
`script_*` events (`telemetry/schema/watched.py`). The accounting
(`telemetry/watched_steps.py`) turns them into steps, checkpoint time and redone work.

It may import the telemetry and control layers and `import_hooks`; nothing of the engine.
A script that makes a `Run` reports its own steps: the step hooks then stay silent.
"""
