"""Inside the worker: the step loop, heartbeat, checkpoint hooks and fault injection."""
