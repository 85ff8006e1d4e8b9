"""The control plane: the one package `launch`, `runtime` and `checkpoint` talk through.

- `backend`: what a control store must do (get, set, compare-and-set, add, wait, leases,
  a c10d store for process-group rendezvous), and `tcp`, its embedded TCPStore backend;
- `schema`: every key, declared once, with its message type and its writer;
- `messages`: the typed messages (faults, plans, departures, drains, results, orders);
- `channel`: typed reads and writes of the schema over a backend.

Nothing outside this package builds a key string or a message dict.
"""
