"""Who leads the job, on a control plane that outlives any one host (etcd).

The leader is whoever holds `LEADER`: the first agent to write it at start, by
compare-and-set. Every other agent (standby nodes included) watches the holder's agent lease
at each look; once it has been silent for `--leader-timeout`, each such agent tries to
replace the claim with its own (compare-and-set on the exact old claim, so exactly one
wins) and the winner resumes the job from what the old leader persisted (`LeaderRecord`,
the attempt's planner state). A leader checks at each look that the claim is still its own;
one that finds it taken (it was cut off or paused past the timeout) is deposed: it stops its
workers and exits, because its node has been declared lost.

**Fencing.** The winner fences its channel on its claim (`Channel.fence_on`): with etcd,
every write it makes from then on is a transaction that holds only while `LEADER` still
holds its claim. A leader deposed while it was paused or cut off cannot write even once:
its first write raises `backend.Fenced` and it stands down at once, as `check_held` would
have made it do at its next look.

**Handing over.** A drain of the leader's own node moves the lead first: the leader replaces
its claim with the heir's (`hand_to`, next term), lifts its fence and goes on as a follower
of its own attempt, its workers training; the heir finds its own instance in the claim at its
next look and takes up the lead (`Elected`, `handed`), its predecessor's node not lost.

With the embedded TCPStore there is no election and nothing to fence: the node-0 agent
holds the store and leads, so no other agent can ever lead while it lives; it is the job's
single point of failure.
"""

from __future__ import annotations

import time

from unbroken.control.channel import Channel
from unbroken.control.lease import LeaseWatch
from unbroken.control.messages import LeaderClaim
from unbroken.control.schema import LEADER, agent_lease
from unbroken.errors import ControlPlaneError
from unbroken.polling import PollTimeout, poll_until

FIRST_CLAIM_WAIT = 30.0
"""Seconds the other nodes give node 0 to claim the lead at the job's start (at most the
rendezvous timeout): hosts and pods start seconds apart, and an agent's imports take seconds
on a loaded host, so a node 0 a little late still leads. Not `--leader-timeout`, which is
how long a leader may go silent before another agent replaces it."""

WRONG_SECRET = ("the job's control messages are signed with another secret than this "
                "agent's: give every node the same --secret-file or UNBROKEN_SECRET")


class Elected(Exception):  # noqa: N818 - control flow, not an error
    """This agent won leadership from a silent leader: it takes over the job."""

    def __init__(self, previous: LeaderClaim | None, attempt: int | None,
                 handed: bool = False) -> None:
        super().__init__(f"{'handed the lead by' if handed else 'took over from'} {previous}")
        self.previous = previous  # the leader replaced (None: there was none)
        self.attempt = attempt  # the attempt this agent was in, if any
        self.handed = handed  # the old leader handed the lead over: its node is not lost


class HandedOver(Exception):  # noqa: N818 - control flow, not an error
    """This agent handed its lead over (to drain its own node): it goes on as a follower of
    `attempt`, with its workers; `keep` is what must outlive the leader role (the attempt's
    worker store, which this agent serves)."""

    def __init__(self, attempt: int, keep: object) -> None:
        super().__init__(f"handed the lead over in attempt {attempt}")
        self.attempt = attempt
        self.keep = keep


class Deposed(ControlPlaneError):
    """Another agent took leadership from this one: this node was declared lost."""


class Election:
    def __init__(self, channel: Channel, node: int, instance: str, timeout: float,
                 first_wait: float = FIRST_CLAIM_WAIT) -> None:
        """`timeout`: `--leader-timeout`; `first_wait`: how long a node other than 0 waits
        for node 0's claim at start (`FIRST_CLAIM_WAIT`, at most the rendezvous timeout)."""
        self.channel = channel
        self.mine = LeaderClaim(node=node, instance=instance, term=0)
        self.timeout = timeout
        self.first_wait = first_wait
        self._watch = LeaseWatch(channel.backend, pause_limit=timeout / 2,
                                 confirm_after=timeout / 2)
        self.seen: LeaderClaim | None = None  # the claim a follower's last look found

    def stand(self, first: bool) -> LeaderClaim:
        """At start: claim leadership if nobody holds it; returns the claim that holds.
        Node 0 stands `first`; the others give it up to `first_wait` to do so, so that the
        job's leader is node 0 unless node 0 is that late (or never comes)."""
        if self.channel.signed_elsewhere(LEADER):
            raise ControlPlaneError(WRONG_SECRET)
        if not first:
            try:
                self.seen = poll_until(self._held, self.first_wait, 0.05,
                                       what="node 0's claim")
                return self.seen
            except PollTimeout:
                pass  # node 0 is late: anyone may stand
        won = self.channel.first(LEADER, self.mine)
        if won is not None and won.instance == self.mine.instance:
            self.mine = won
        if won is None or won.instance == self.mine.instance:
            self.channel.fence_on(LEADER, self.mine)
        self.seen = won if won is not None else self.mine
        return self.seen

    def _held(self) -> LeaderClaim | None:
        """The claim that holds, if any (one under another secret: said, and raised)."""
        claim = self.channel.read(LEADER)
        if claim is None and self.channel.signed_elsewhere(LEADER):
            raise ControlPlaneError(WRONG_SECRET)
        return claim

    def check_held(self) -> None:
        """Each look of the leader: raise `Deposed` if the claim is no longer its own."""
        claim = self.channel.read(LEADER)
        if claim is None or claim.instance != self.mine.instance:
            raise Deposed(f"leadership passed to node {getattr(claim, 'node', '?')} while this "
                          "agent could not reach the control plane; this node was declared lost")

    def hand_to(self, node: int, instance: str) -> LeaderClaim:
        """The leader hands its lead to the agent `instance` of `node` (to drain its own
        node): the claim is replaced by that agent's, next term, only if it is still this
        agent's own; the fence is then lifted, and this agent goes on as a follower. The heir
        takes up the lead at its next look (`watch`). Raises `Deposed` if the claim was no
        longer this agent's."""
        heir = LeaderClaim(node=node, instance=instance, term=self.mine.term + 1)
        if not self.channel.replace(LEADER, self.mine, heir):
            self.check_held()  # raises Deposed: another agent holds it
            raise ControlPlaneError(f"the lead could not be handed to node {node}")
        self.channel.unfence()
        self.seen = heir
        return heir

    def watch(self, attempt: int | None) -> None:
        """Each look of a follower: take over if the leader has been silent for the timeout
        (raises `Elected` when this agent won)."""
        claim = self.channel.read(LEADER)
        if claim is None and self.seen is None:
            return  # a standby node, which does not stand, started before anyone led
        previous, self.seen = self.seen, claim
        if claim is None:  # the leader cleared the finished job
            raise ControlPlaneError("the job's keys are gone from the control plane: the job "
                                    "ended without this node (or another job used its --rdzv-id)")
        if claim.instance == self.mine.instance:
            if claim != self.mine:  # the leader handed its lead to this agent (`hand_to`)
                self.mine = claim
                self.channel.fence_on(LEADER, claim)
                raise Elected(previous, attempt, handed=True)
            return
        silent = self._watch.silent_for(agent_lease(claim.node, claim.instance), time.monotonic())
        if silent <= self.timeout:
            return
        mine = LeaderClaim(node=self.mine.node, instance=self.mine.instance, term=claim.term + 1)
        if self.channel.replace(LEADER, claim, mine):
            self.mine = mine
            self.channel.fence_on(LEADER, mine)
            raise Elected(claim, attempt)
