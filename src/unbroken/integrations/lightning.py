"""Lightning's `Trainer.fit`, recovered in place: `Trainer(strategy="unbroken_ddp")`, or
automatically for `strategy="ddp"` (and `"auto"` with several processes) under
`unbroken run` (`unbroken.integrations.automatic`).

What holds (docs/integrations.md):
- Each optimizer step is a committed step (`trainer.global_step`). The engine's `begin` and
  `enter` come at the strategy's `on_train_batch_start` of the update's first batch; the
  last batch's closure (forward, backward, DDP's all-reduce) and the update run inside the
  strategy's `optimizer_step`; `updating` spans the update, and `commit` follows it.
- Survivors never leave `fit()`. A collective that fails because a peer died, inside the
  closure, leaves the generation and joins the next one in the strategy's `optimizer_step`:
  the engine brings the committed state, every member builds a fresh DDP on the new group
  (`FitSteps.build` says why not the old one re-pointed), and the step is redone: under
  gradient accumulation its earlier batches first, on the same inputs and RNG, their
  reduction deferred as Lightning defers it (a half-accumulated update is dropped, never
  committed). A peer's
  fault met in the strategy's own collectives outside a step (validation's `sync_dist`, callbacks'
  broadcasts) returns the local value and is recovered at the next step.
- A joiner (a spare, or a replacement running the same script) calls `fit()` like everyone.
  In the strategy's `setup` it joins and takes the state from a peer: the LightningModule,
  the optimizers, and what Lightning's checkpoint carries besides (loops, callbacks, LR
  schedulers, precision, datamodule), which Lightning's own restore then applies. A
  `ckpt_path` the script passes is not read by a joiner. Its first epoch skips the batches
  already trained (those of the update in flight excepted: it trains them again). Until it
  reaches the batch its peer was in, its strategy collectives are local (the survivors are
  past theirs).
- The world size never changes (the sampler and `max_steps` depend on it): run the job
  with `--on-fault wait`, or with spares.

Not recovered in place (the worker fails, and the job recovers as it would without the
integration): an exception of the script's own outside a step (a callback's
`on_train_batch_end`, say: it leaves `fit()` as Lightning raises it), a peer's fault met
in a raw collective outside a step (DDP's buffer broadcast in a validation forward).
Manual optimization trains unprotected, saying so in one line.
The private Lightning attributes used are those of the versions in `TESTED`; any other
version trains unprotected, saying so in one line.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any

import lightning
import torch
import torch.distributed as dist
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel

from unbroken.errors import is_peer_error
from unbroken.runtime.engine import Engine
from unbroken.runtime.run import Run, init
from unbroken.telemetry import schema as ev

TESTED = ("2.6",)
"""lightning minor versions whose private attributes the integration relies on (the
checkpoint connector's `_loaded_checkpoint`, the fit loop's `_combined_loader`,
`_data_fetcher`, the epoch loop's `_batches_that_stepped`, `_broadcast_sigterm_tensor`
and `_build_kwargs`, automatic optimization's `_make_closure`, `ModelCheckpoint`'s
`_last_global_step_saved` and `_last_checkpoint_saved`)."""

NAME = "unbroken_ddp"


def supported(version: str = lightning.__version__) -> bool:
    return ".".join(version.split(".")[:2]) in TESTED


def _fake_world() -> bool:
    """A joiner's stand-in world (the worker's bootstrap formed it for the script's call)."""
    return dist.is_initialized() and dist.get_backend() == "fake"


class UnbrokenDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy, whose `fit()` recovers in place (the module's docstring).
    Outside `fit()` (validate, test, predict) it is Lightning's DDP."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.local = False
        """A joiner before its first batch: collectives return the local value."""
        self.steps: FitSteps | None = None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(NAME, cls, description="DDP, recovered in place by unbroken",
                                   override=True, start_method="popen")

    # ------------------------------------------------------------------ setup
    def setup_environment(self) -> None:
        super().setup_environment()
        self.local = _fake_world()
        if self.local:  # its state comes from a peer, never from the script's ckpt_path
            connector = self.lightning_module.trainer._checkpoint_connector
            connector.resume_start = lambda *args, **kwargs: None

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.steps is None:
            why = _unprotected(trainer)
            if why is not None:
                print(f"unbroken: {why}: this fit trains unprotected, and a fault restarts "
                      "every worker", file=sys.stderr, flush=True)
                self.local = False
                return
            self.steps = FitSteps(trainer, self, init())

    @property
    def root_device(self) -> torch.device:
        """A spare's device: its own, past the workers' (`LOCAL_RANK` counts the spares)."""
        devices = self.parallel_devices
        if devices and self.local_rank >= len(devices):
            first = devices[0]
            return first if first.type == "cpu" else torch.device(first.type, self.local_rank)
        return super().root_device

    @property
    def global_rank(self) -> int:
        """The rank in the job: the engine's once it entered (a promoted spare's slot; its
        `RANK` says -1), else the cluster environment's."""
        steps = self.steps
        if steps is not None and steps.started:
            return steps.engine.position.rank
        return super().global_rank

    @property
    def lightning_restore_optimizer(self) -> bool:
        """A joiner's optimizers come from a peer (tracked), not from Lightning's restore."""
        return not (self.steps is not None and self.steps.from_peer)

    # ------------------------------------------------------------------ hooks
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.steps is not None:
            self.steps.train_start()
        else:
            self.local = False

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.steps is not None:
            self.steps.step_begin(batch, batch_idx)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        if self.steps is not None:
            self.steps.record_loss(out)
        return out

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.steps is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        return self.steps.optimizer_step(
            lambda wrapped: super(UnbrokenDDPStrategy, self).optimizer_step(
                optimizer, wrapped, model, **kwargs), closure)

    def on_train_end(self) -> None:
        super().on_train_end()
        if self.steps is not None:
            self.steps.train_end()

    # ------------------------------------------------------------------ collectives
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self.local:
            self._outside_step(lambda: super(UnbrokenDDPStrategy, self).barrier(*args, **kwargs),
                               None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.local:
            return obj
        return self._outside_step(lambda: super(UnbrokenDDPStrategy, self).broadcast(obj, src), obj)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if self.local:
            return tensor
        return self._outside_step(
            lambda: super(UnbrokenDDPStrategy, self).reduce(tensor, group, reduce_op), tensor)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> Any:
        if self.local:
            return torch.stack([tensor] * self.world_size)
        return self._outside_step(
            lambda: super(UnbrokenDDPStrategy, self).all_gather(tensor, group, sync_grads),
            torch.stack([tensor] * self.world_size))

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self.local:
            return decision
        return self._outside_step(
            lambda: super(UnbrokenDDPStrategy, self).reduce_boolean_decision(decision, all),
            decision)

    def _outside_step(self, collective: Any, local: Any) -> Any:
        """A strategy collective; one that fails for a peer's fault, outside a step, gives
        `local` and leaves the recovery to the next step (`FitSteps.pending`)."""
        steps = self.steps
        if steps is None or steps.in_step:
            return collective()
        try:
            return collective()
        except Exception as exc:
            if not is_peer_error(exc):
                raise
            if steps.pending is None:
                print("unbroken: a peer's fault met in a Lightning collective outside a step: "
                      "it gives the local value, and the next step recovers in place",
                      file=sys.stderr, flush=True)
            steps.pending = exc
            return local


def _unprotected(trainer: Any) -> str | None:
    """Why this fit cannot be recovered in place, or None."""
    if not supported():
        return (f"lightning {lightning.__version__} is not one the integration is tested with "
                f"({', '.join(TESTED)})")
    if not trainer.lightning_module.automatic_optimization:
        return "manual optimization is not recovered in place"
    return None


def _rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    """The RNG state the engine seeds (`enter`): the default generator's, the device's."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.default_generator.get_state(), torch.cuda.get_rng_state() if cuda else None


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.default_generator.set_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


_OWN_KEYS = ("hyper_parameters", "hparams_name", "hparams_type",
             "datamodule_hyper_parameters", "datamodule_hparams_name")
"""Checkpoint entries a joiner's script makes itself: they may hold any Python object, and
state from a peer travels as tensors and plain data only (never unpickled)."""

_REDONE = "unbroken_batches_redone"
"""The peer's batches of the update in flight already run: the joiner runs them again, its
strategy collectives local (the peer is past them)."""

_SAVED = "unbroken_checkpoint_saved"
"""Each `ModelCheckpoint`'s last save (its `_last_global_step_saved`, which its state dict
lacks): a joiner in the middle of an update must not save again at a step its peer saved
at (a save's collectives would meet the peer's all-reduce)."""
_SAVED_ATTRS = ("_last_global_step_saved", "_last_checkpoint_saved")


class _LightningState:
    """What Lightning's checkpoint carries besides the model and optimizers (tracked
    themselves): loops, callbacks, LR schedulers, precision, datamodule, as one tracked
    object, in plain data and tensors (the state step packs it; nothing is pickled).
    `state_dict` dumps it fresh (the committed step's, taken inside the next step
    or between steps); `load_state_dict` hands it to Lightning's own restore."""

    def __init__(self, steps: FitSteps) -> None:
        self.steps = steps

    def state_dict(self) -> dict[str, Any]:
        trainer = self.steps.trainer
        ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        for key in ("state_dict", "optimizer_states"):  # tracked: sent as tensors
            ckpt.pop(key, None)
        # The update in flight is not committed: the joiner runs its batches again.
        redone = len(self.steps.earlier)
        progress = ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]
        for counts in (progress["total"], progress["current"]):
            done = counts["completed"] - redone
            counts.update(ready=done, started=done, processed=done, completed=done)
        ckpt[_REDONE] = redone
        ckpt[_SAVED] = {cb.state_key: {a: getattr(cb, a) for a in _SAVED_ATTRS}
                        for cb in trainer.checkpoint_callbacks}
        for key in _OWN_KEYS:  # the joiner's script builds its own
            ckpt.pop(key, None)
        return ckpt

    def load_state_dict(self, state: dict[str, Any]) -> None:
        steps = self.steps
        if not steps.engine.joining:  # its loops ran on: they cannot be set back in place
            raise RuntimeError("unbroken: a worker already in fit() was sent a peer's "
                               "Lightning state; it cannot take it in place")
        ckpt = dict(state)
        steps.local_batches = int(ckpt.pop(_REDONE, 0))
        saved = ckpt.pop(_SAVED, {})
        connector = steps.trainer._checkpoint_connector
        connector._loaded_checkpoint = ckpt  # loops, schedulers, precision: at fit's restore
        connector.restore_datamodule()
        connector.restore_callbacks()
        for callback in steps.trainer.checkpoint_callbacks:
            for attr, value in saved.get(callback.state_key, {}).items():
                setattr(callback, attr, value)
        fit_loop = ckpt["loops"]["fit_loop"]
        steps.batches_that_stepped = fit_loop["epoch_loop.state_dict"]["_batches_that_stepped"]
        steps.from_peer = True


class FitSteps:
    """One `fit()`'s optimizer steps on the engine's step transaction."""

    def __init__(self, trainer: Any, strategy: UnbrokenDDPStrategy, run: Run) -> None:
        self.trainer, self.strategy, self.run = trainer, strategy, run
        self.engine: Engine = run.engine
        self.in_step = False
        self.pending: Exception | None = None  # a peer's fault met outside a step
        self.from_peer = False  # a joiner's state came from a peer
        self.batches_that_stepped: int | None = None  # a joiner's logger step, from the peer
        self._reuse_view = not run.joining  # generation 0's DDP is Lightning's own
        self.started = False  # engine.start was called
        # The update's batches before the one in flight, and that one (None: between
        # updates), each with the RNG state it started with.
        self.earlier: list[tuple[Any, int, Any]] = []
        self.current: tuple[Any, int, Any] | None = None
        self.losses: list[torch.Tensor] = []  # the update's batches' losses, on the device
        self.local_batches = 0  # a joiner's batches run again with local collectives
        # Rank 0's per-batch raw broadcast of a SIGTERM flag would pair with a joiner's
        # first collective: off (a drain is the agent's, not Lightning's).
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
        run.track(trainer.lightning_module, *trainer.optimizers, lightning=_LightningState(self))
        if run.joining:
            self._start()

    def _start(self) -> None:
        trainer = self.trainer
        if trainer.max_steps > 0 or self.run.spare:
            # A spare's data is set up once it has a rank, after this; without max_steps
            # Lightning's own epochs end its fit.
            last = trainer.max_steps if trainer.max_steps > 0 else sys.maxsize
        else:
            last = trainer.estimated_stepping_batches
            last = int(last) if last != float("inf") else sys.maxsize
        self.started = True
        self.engine.start(last, self.build, self.shadow_step, resumed_at=trainer.global_step)

    def train_start(self) -> None:
        """Enter the job (collective; a joiner entered in `setup`); a joiner skips the
        batches its peers trained this epoch."""
        if not self.from_peer:
            if not self.started:
                self._start()
            return
        fit_loop = self.trainer.fit_loop
        for loader in fit_loop._combined_loader.flattened:  # the iterator predates set_epoch
            _set_sampler_epoch(loader, fit_loop.epoch_progress.current.processed)
        for _ in range(fit_loop.epoch_loop.batch_progress.current.completed):
            next(fit_loop._data_fetcher.iterator)

    def step_begin(self, batch: Any, batch_idx: int) -> None:
        """A batch starts: the first of an update begins and enters the engine's step (its
        RNG seeded). Each is recorded with its RNG state, to be run again on the same inputs
        and draws if the update is redone."""
        if self.batches_that_stepped is not None:  # the peer's logger step, exactly
            self.trainer.fit_loop.epoch_loop._batches_that_stepped = self.batches_that_stepped
            self.batches_that_stepped = None
        if self.local_batches:  # a joiner's batch its peer is past
            self.local_batches -= 1
        else:
            self.strategy.local = False
        if self.current is not None:  # a later batch of the update (accumulation)
            self.earlier.append(self.current)
            self.current = (batch, batch_idx, _rng_state())
            return
        if self.pending is not None:  # a peer's fault met between steps: recover it now
            exc, self.pending = self.pending, None
            self.engine.fail(self.engine.position.step, exc)
        if self.engine.begin() is None:  # the engine's last step is committed
            self.trainer.should_stop = True
            return
        self.engine.enter(self.engine.position.step)
        self.current, self.losses = (batch, batch_idx, _rng_state()), []

    def record_loss(self, out: Any) -> None:
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if isinstance(loss, torch.Tensor):
            self.losses.append(loss.detach())  # on the device: one host sync, at the commit

    def optimizer_step(self, step_fn: Any, closure: Any) -> Any:
        """The strategy's optimizer step (the update's last batch's closure, then the
        update), recovered in place: see the module's docstring."""
        engine = self.engine
        step = engine.position.step
        self.in_step = True
        try:
            if self.pending is not None:  # met between this update's batches
                exc, self.pending = self.pending, None
                self._fail(step, exc)
            while True:
                try:
                    out = self._attempt(step_fn, closure)
                    break
                except Exception as exc:  # a peer's fault is recovered; anything else re-raised
                    self._fail(step, exc)
            loss = float(torch.stack(self.losses).float().mean()) if self.losses else None
            self.earlier, self.current, self.losses = [], None, []
            engine.commit(step, {"loss": loss} if loss is not None else {})
            return out
        finally:
            self.in_step = False

    def _fail(self, step: int, exc: Exception) -> None:
        """Leave for the next generation (`engine.fail`), then start the update over in it,
        as it ran in the old one: the gradients zeroed, the earlier batches run again on the
        same inputs and RNG states, their reduction deferred (`no_sync`). The batch in
        flight is then redone by the caller, from its own RNG state (hooks between the
        batches, a validation say, may have drawn from the RNG: they are not run again)."""
        engine, trainer = self.engine, self.trainer
        engine.fail(step, exc)
        if engine.position.step > step:
            raise RuntimeError("unbroken: the peers committed a step this worker was still "
                               "running") from exc
        for optimizer in trainer.optimizers:
            optimizer.zero_grad()
        self.losses = []
        loop = trainer.fit_loop.epoch_loop
        for batch, batch_idx, rng in self.earlier:
            _set_rng_state(rng)
            kwargs = loop._build_kwargs(OrderedDict(), batch, batch_idx)
            closure = loop.automatic_optimization._make_closure(kwargs, trainer.optimizers[0],
                                                                batch_idx)
            with self.strategy.block_backward_sync():
                closure()
            closure.consume_result()
        if self.current is not None:
            _set_rng_state(self.current[2])
        if self.earlier:
            self.run.events.emit(ev.MicroBatchesReplayed(step=step, gen=engine.position.gen,
                                                         micro_batches=len(self.earlier)))

    def _attempt(self, step_fn: Any, closure: Any) -> Any:
        """One try of the update's last batch: its closure, then the update (torn if it
        raises)."""
        engine = self.engine
        with ExitStack() as update:
            def closure_then_update() -> Any:
                result = closure()
                update.enter_context(engine.updating())
                return result

            return step_fn(closure_then_update)

    def train_end(self) -> None:
        self.engine.finish()

    # ------------------------------------------------------------------ the engine's
    def build(self) -> Any:
        """The model a generation trains: Lightning's own DDP in generation 0, then a fresh
        one on each new group, built by every member at the same point of the switch (its
        constructor's collectives line up). The old one's gradient hooks are removed first.
        Moving the old one onto the new group (`_update_process_group`) is not enough: a
        survivor's reducer keeps the bucket order it rebuilt after its first step, and a
        joiner's has the initial one, so their first all-reduce would sum misaligned
        gradients."""
        strategy = self.strategy
        old = strategy.model
        if self._reuse_view or not isinstance(old, DistributedDataParallel):
            self._reuse_view = False
            return old
        old._remove_autograd_hooks()
        strategy.model = strategy._setup_model(strategy.lightning_module)
        strategy._register_ddp_hooks()
        return strategy.model

    def shadow_step(self, step: int, view: Any) -> None:
        """A spare's warm-up step, in its sandbox: a forward and backward on a first batch."""
        trainer = self.trainer
        loader = trainer.fit_loop._data_source.dataloader()  # the script's, unsharded
        batch = next(iter(loader))
        out = trainer.lightning_module.training_step(batch, 0)
        loss = out["loss"] if isinstance(out, dict) else out
        loss.backward()


UnbrokenDDPStrategy.register_strategies(StrategyRegistry)
