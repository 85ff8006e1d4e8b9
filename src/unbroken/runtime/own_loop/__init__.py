"""The user's own training loop, recovered in place with a two-line change.

    for step, batch in run.steps(total, data=loader):   # the same batch again after a recovery
        with run.try_step():                             # a peer's fault in here: recovered
            loss = model(batch).loss
            loss.backward()
            optimizer.step(); optimizer.zero_grad()

Owns the loop form (`loop.OwnLoop`: the generator behind `run.steps(total, data=...)`), one
try of a step (`step_block.StepBlock`: what `run.try_step()` returns, and the step hooks on the
tracked optimizers that commit it), the data position (`batches.Batches`: the loader's
batches as a function of the step), and the user's DDP object re-pointed at each new
generation's group (`ddp_rebind`). The semantics are in docs/your-loop.md; the sequence in
docs/design-notes.md ("Your own loop").

It drives the engine through its public calls (docs/engine.md) and may import the engine,
the runtime's plumbing, `telemetry` and `errors`; `run` imports it, never the reverse.
"""
