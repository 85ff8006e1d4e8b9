"""The anomaly detectors and their executors: what does not crash.

Owns the pure detectors (`numerics`: NaN, Inf, loss spikes; `replicas`: silent data
corruption between replicas, by `checksum`; `stragglers`: a rank persistently slower than
its peers) and their executors (`anomaly_duty`, `replica_checks`, `straggler_watch`), which
gather what every rank measured (`gather`: one collective on the current generation's
default group) and act on the verdict. May import the runtime's plumbing (`config`,
`tracked`, `position`, `step_probe`), `telemetry` and `errors`; never the engine or its
switch between generations (the `detectors` and `runtime` contracts in pyproject.toml): the
engine calls in, the detectors never call out.
"""
