"""Resuming: a job with a checkpoint_dir and nothing in it trains exactly as the same job
without one (in process, one rank, no launcher)."""

from __future__ import annotations

import torch

import unbroken


def _train(checkpoint_dir) -> dict:
    run = unbroken.init(checkpoint_dir=checkpoint_dir, checkpoint_every=1000, seed=0)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    run.track(model, optimizer)

    def step_fn(step: int, net: torch.nn.Module) -> None:
        g = torch.Generator().manual_seed(step)
        net(torch.randn(8, 4, generator=g)).pow(2).mean().backward()

    run.train(step_fn, steps=3, build=lambda: model)
    run.close()
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def test_an_empty_checkpoint_dir_changes_nothing_in_training(tmp_path):
    """Building the state dict to load into initialises a fresh optimizer's state (DCP takes a
    zero-learning-rate step, and AdamW counts it): with nothing to load it must not be built,
    or the first real step's bias correction, and every step after it, would differ."""
    without = _train(None)
    with_dir = _train(str(tmp_path / "ckpt"))
    assert without["optim"]["state"][0]["step"].item() == 3
    assert with_dir["optim"]["state"][0]["step"].item() == 3
    for key, value in without["model"].items():
        assert torch.equal(value, with_dir["model"][key]), key
