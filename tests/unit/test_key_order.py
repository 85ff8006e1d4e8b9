"""The mirror's sorted key index (`etcd_watch.KeyOrder`): a prefix read finds exactly the
keys under it, as a scan of every key would, after adds and removes."""

from __future__ import annotations

import random

from unbroken.control.etcd_watch import KeyOrder


def test_under_a_prefix_is_what_a_scan_finds_through_adds_and_removes() -> None:
    rng = random.Random(7)
    keys: set[str] = set()
    order = KeyOrder()
    names = [f"a/{a}/{q}/{i}" for a in range(3) for q in ("death", "left", "lease") for i in range(40)]
    names += ["a/1/left", "a/10/left/0", "lease/5/x", "a/1/lefty/0"]
    for _ in range(2000):
        key = rng.choice(names)
        if rng.random() < 0.3:
            keys.discard(key)
            order.remove(key)
        else:
            keys.add(key)
            order.add(key)
    for prefix in ("a/1/left/", "a/1/", "a/", "lease/", "a/10/", "zzz", ""):
        assert order.under(prefix) == sorted(k for k in keys if k.startswith(prefix)), prefix
    assert KeyOrder(["b", "a", "ab"]).under("a") == ["a", "ab"]
