"""Failover of the summation service: a lost dedicated server costs no step (docs/protocol.md, "Failover").

With failover on, the engine hands every collective's partitions to a `Router` instead of the client. It sends
them through the clients of the job's epochs (epoch 0: the job's own client; each failover adds one, under a fresh
job id, of the servers that remain) and follows each key to where it lives now. A part whose server is lost is
held, not failed; the workers agree through the job's store (`lost/`, `counts/`, `up/` under failover/<epoch>/,
the rules in agreement.py) on the servers lost, who finishes each open round and where each moved key goes, then
finish those rounds on the keys' new owners and send the held parts there. A MODEL key's total (asynchronous
training) moves with each rank's sum of its own acknowledged updates (`ModelTotals`). `Router.rebalance`
(torch_bps.rebalance) places every key anew at a step boundary over the servers answering then; a failover another
rank started first is joined before the rebalance's decision, so that no two agreements interleave. A rank that did
not see a loss joins the failover another rank started (a watcher thread looks in the store every WATCH_S).

May import: the standard library, torch, torch_bps.agreement, client, errors, futures, wire, engine.placement.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from torch_bps.agreement import (
    CARRIED,
    Agreement,
    ModelTotals,
    connect,
    owner,
    plan,
    poll_keys,
    recovery_part,
    wait_all,
    wait_one,
    weights,
)
from torch_bps.client import OUTCOME_OK, OUTCOME_SERVER_LOST
from torch_bps.engine.placement import Placement, Server
from torch_bps.errors import BpsTimeoutError
from torch_bps.futures import Done
from torch_bps.wire import Mode, Partition

log = logging.getLogger("torch_bps")

# -- the router
Ordered = tuple[tuple[int, int], Partition]  # (the collective's sequence number, the part's index), a part
WATCH_S = 1.0  # how often a rank looks in the store for a failover another rank started


@dataclass(eq=False)
class _Call:
    """One collective: `pending` counts its batches in flight, plus one while parts of it are held (`holding`: a
    collective whose parts went through several epochs' clients may have several batches fail, but it is held
    once and released once)."""

    done: Done
    priority: int
    seq: int
    pending: int = 0
    error: BaseException | None = None
    holding: bool = False


@dataclass
class _Epoch:
    client: object
    servers: list[Server]
    lost: frozenset[str] = frozenset()  # a failover: the addresses whose keys this epoch took over
    placement: Placement | None = None  # a rebalance: every key placed anew, by the paper's rule


class Router:
    """Sends a collective's partitions to where their keys live now; holds those of lost servers until the
    workers agreed on a failover (see the module's doc).

    In the Client's shape: the engine hands it each collective's partitions as it would the client
    (`push_pull_batch`), and the router makes and owns every epoch's client, the first one included, through
    `agreement.make_client`, so that each client's link-down handler reaches the router from the start.

    Args:
        servers: the job's servers, in placement order (epoch 0).
        agreement: what a failover needs from the runtime (agreement.py).
        name: the group's name, for logs and the failover thread's name.
        job_id: the job's id on epoch 0's servers.

    Example: `router = Router(weights, agreement, "default", job_id=job_id); router.push_pull_batch(parts,
    on_done=done)`.
    """

    def __init__(self, servers: list[Server], agreement: Agreement, name: str = "default", *, job_id: int):
        self._name = name
        self._agree = agreement
        self._lock = threading.Lock()
        self._epochs: list[_Epoch] = []
        self._routes: dict[int, tuple[int, int]] = {}  # keys that moved: key -> (epoch, server index)
        self._held: list[tuple[tuple[int, int], Partition, _Call]] = []  # (order, part, call)
        self._calls = 0
        self._seen: set[str] = set()  # lost servers some part or link reported
        self._lost: set[str] = set()  # failed over
        self._recover: dict[int, tuple] = {}  # key -> recovery_part's arguments, until this rank sent it
        self._totals = ModelTotals()  # asynchronous training's keys: what their first part carries where they move
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._active = 0  # collectives in flight
        self._idle = threading.Condition(self._lock)
        self._rebalances = 0
        self._rebalancing = False  # past a rebalance's `ready`: a server noticed lost meanwhile waits for its end
        self._spare: list[str] = []  # rank 0: standbys claimed by a failover agreed again, not used yet
        self.failovers: list[dict] = []  # what each failover did (also logged)
        client = agreement.make_client(list(servers), job_id, self._link_down_handler(list(servers)))
        self._epochs.append(_Epoch(client, list(servers)))
        self._closed = threading.Event()
        self._watch = threading.Thread(target=self._watch_store, name=f"bps-failover-watch-{name}", daemon=True)
        self._watch.start()

    @property
    def client(self):
        """Epoch 0's client: the job's own, whose server indices every partition is given in."""
        return self._epochs[0].client

    def _link_down_handler(self, servers: list[Server]):
        """A client's link-down handler: a dedicated server that goes down is failed over even if no part of
        this rank waits on it, so that this rank reports too. It holds the client's servers, not its epoch's index:
        a failover's client reports from its HELLO on, before its epoch exists (and maybe for an agreement redone)."""

        def on_link_down(server: int, why: str) -> None:
            with self._lock:
                if servers[server].dedicated:
                    self._notice(servers[server].address)

        return on_link_down

    def failing_over(self) -> bool:
        """A failover is under way: its own waits bound it (BPS_FAILOVER_TIMEOUT) while it holds collectives."""
        with self._lock:
            return self._thread is not None

    def clients(self) -> list:
        """Every epoch's client: the ones parts may be under way on."""
        with self._lock:
            return [e.client for e in self._epochs]

    def push_pull_batch(self, parts: list[Partition], *, priority: int = 0, on_done: Done) -> None:
        """Run a collective's parts (servers indexed as at epoch 0); call `on_done` once, when all are back,
        wherever they went."""
        with self._lock:
            if self._failure is not None:
                raise self._failure
            self._calls += 1
            self._active += 1
            call = _Call(on_done, priority, self._calls)
            finished = self._send(call, [((call.seq, i), part) for i, part in enumerate(parts)])
        for c in finished:
            c.done(c.error)

    # -- sending and holding; under self._lock, returning the calls that finished (to complete unlocked)
    def _route(self, key: int, server: int, nbytes: int) -> tuple[int, int]:
        where = self._routes.get(key, (0, server))
        for e in range(where[0] + 1, len(self._epochs)):
            epoch = self._epochs[e]
            if epoch.placement is not None:
                where = self._routes[key] = (e, epoch.placement.assign(key, nbytes))
            elif self._epochs[where[0]].servers[where[1]].address in epoch.lost:
                where = self._routes[key] = (e, owner(key, epoch.servers))
        return where

    def _send(self, call: _Call, items: list[Ordered], epoch: int | None = None) -> list[_Call]:
        """Send items ((order, part)) to their keys' servers; with `epoch`, parts are already routed there."""
        # A batch per epoch; MODEL parts one per server too: ranks may be rounds apart, and a lost server's parts
        # must come back to be held and resent without waiting for another server's round, which may wait for a
        # rank that waits for them.
        groups: dict[tuple[int, int], list] = {}
        for order, part in items:
            e = epoch or 0
            if epoch is None and len(self._epochs) > 1:
                e, server = self._route(part.key, part.server, part.key_numel * part.tensor.element_size())
                part = part._replace(server=server)
            groups.setdefault((e, part.server if part.mode == Mode.MODEL else -1), []).append((order, part))
        call.pending += len(groups)
        finished = []
        for (e, _), group in groups.items():
            group = self._totals.carry(e, group)
            outcomes = torch.zeros(len(group), dtype=torch.uint8)
            on_done = lambda error, e=e, g=group, o=outcomes: self._batch_done(call, e, g, o, error)  # noqa: E731
            try:
                self._epochs[e].client.push_pull_batch([p for _, p in group], priority=call.priority, on_done=on_done,
                                                       outcomes=outcomes)  # fmt: skip
            except BaseException as error:  # noqa: BLE001 - the collective fails, as a failed part would
                call.error = call.error or error
                finished += self._end(call)
        return finished

    def _batch_done(self, call: _Call, epoch: int, group: list, outcomes: torch.Tensor, error) -> None:
        with self._lock:
            finished = []
            self._totals.acknowledged(group, [o == OUTCOME_OK for o in outcomes.tolist()])
            if error is not None:
                lost = []
                for (order, part), outcome in zip(group, outcomes.tolist(), strict=True):
                    server = self._epochs[epoch].servers[part.server]
                    if outcome == OUTCOME_SERVER_LOST and server.dedicated and self._failure is None:
                        lost.append((order, part, server.address))
                    elif outcome != OUTCOME_OK:
                        call.error = call.error or error
                if call.error is None and lost:
                    finished += self._hold(call, lost)
            finished += self._end(call)
        for c in finished:
            c.done(c.error)

    def _hold(self, call: _Call, lost: list[tuple[tuple[int, int], Partition, str]]) -> list[_Call]:
        """Parts whose server is lost: held until the failover, or sent on if it happened already."""
        late = [(order, part) for order, part, address in lost if address in self._lost]
        held = [(order, part, address) for order, part, address in lost if address not in self._lost]
        if held:
            if not call.holding:
                call.holding = True
                call.pending += 1
            self._held += [(order, part, call) for order, part, _ in held]
            for _, _, address in held:
                self._notice(address)
        return self._resend(call, late) if late else []

    def _resend(self, call: _Call, items: list[Ordered]) -> list[_Call]:
        """Send held parts to their keys' new owners; a key's part of an unfinished round becomes its recovery."""
        finished, plain = [], []
        for order, part in items:
            if order == CARRIED:  # made again from the sums when its key's next part is sent
                continue
            if part.key in self._recover:
                finished += self._send_recovery(call, part.key, part)
            else:
                plain.append((order, part))
        return finished + (self._send(call, plain) if plain else [])

    def _send_recovery(self, call: _Call, key: int, held: Partition | None) -> list[_Call]:
        epoch, server = self._routes[key]  # a moved key: routed when the failover was applied
        action, completed, kept, spec, push_offset = self._recover.pop(key)
        part = recovery_part(key, action, self._agree.rank, completed, kept, held, spec, push_offset)
        return self._send(call, [((0, 0), part._replace(server=server))], epoch=epoch)

    def _end(self, call: _Call) -> list[_Call]:
        call.pending -= 1
        if call.pending or call.seq == 0:  # seq 0: the recovery's own call, not a collective
            return [call] if call.pending == 0 else []
        self._active -= 1
        self._idle.notify_all()
        return [call]

    # -- failover
    def _notice(self, address: str) -> None:
        if address in self._lost or address in self._seen:
            return
        self._seen.add(address)
        if not self._rebalancing:  # a rebalance past its `ready` only joins other ranks' failovers (_join_failover)
            self._start_failover()

    def _start_failover(self) -> threading.Thread:
        if self._thread is None:  # one agreement at a time in the store
            self._thread = threading.Thread(target=self._fail_over, name=f"bps-failover-{self._name}", daemon=True)
            self._thread.start()
        return self._thread

    def _watch_store(self) -> None:
        """Join a failover another rank started: a rank that did not see the loss (a server stalled for less than
        its heartbeat timeout here, longer there; a server holding none of its waiting parts) would otherwise leave
        the others waiting for its report until the job failed (found by benchmarks/chaos.py)."""
        while not self._closed.wait(WATCH_S):
            with self._lock:
                if self._failure is not None:
                    return
                if self._thread is not None or self._rebalancing:  # a rebalance joins by itself (_join_failover)
                    continue
                e = len(self._epochs)
            try:
                lost = self._started_by_others(e)
            except Exception:  # noqa: BLE001 - the store is gone (the job ends); a failover's own waits name it
                continue
            with self._lock:
                if lost and len(self._epochs) == e and self._thread is None and not self._rebalancing:
                    self._join(lost)

    def _join(self, lost: set[str]) -> threading.Thread:
        """Under the lock: take part in the failover of `lost` another rank started."""
        self._seen |= lost - self._lost
        return self._start_failover()

    def _started_by_others(self, e: int) -> set[str]:
        """The servers the ranks that started failover `e` reported lost (none if none started it)."""
        a = self._agree
        if not a.store.check([f"failover/{e}/started"]):
            return set()
        reports = [f"failover/{e}/lost/{r}" for r in range(a.world_size)]
        return {s for key in reports if a.store.check([key]) for s in json.loads(a.store.get(key))}

    def _fail_over(self) -> None:
        try:
            self._agree.colocated_ahead()  # a job that lost a server may lose them all: its fallback, ready
            attempt = 0
            while True:
                with self._lock:
                    seen = sorted(self._seen - self._lost)
                    if not seen:
                        self._thread = None  # under the lock: a later notice starts a new thread
                        self._idle.notify_all()  # a rebalance waits for it
                        return
                attempt = 0 if self._one_failover(seen, attempt) else attempt + 1
        except BaseException as e:  # noqa: BLE001 - every held collective fails with it, and every later one
            log.error("torch_bps[%s]: failover failed: %s", self._name, e)
            with self._lock:
                self._failure = e
                self._idle.notify_all()  # a rebalance waiting for this failover fails now, not at its timeout
                held, self._held = self._held, []
                finished = []
                for c in {id(c): c for _, _, c in held}.values():
                    c.error = c.error or e
                    c.holding = False
                    finished += self._end(c)  # the hold ends
            for c in finished:
                self._epochs[0].client.post(lambda c=c: c.done(c.error))

    def _one_failover(self, seen: list[str], attempt: int = 0) -> bool:
        """Agree on a failover of the servers `seen` lost and apply it; False if the ranks must agree again (some
        rank's new client could not reach a server of the decision; the lost servers include it now)."""
        a, e = self._agree, len(self._epochs)
        ns, started = f"failover/{e}/" + (f"again{attempt}/" if attempt else ""), time.monotonic()
        # 1. The lost servers: the union of what the ranks saw, so that all abandon the same ones.
        a.store.set(f"{ns}lost/{a.rank}", json.dumps(seen))
        a.store.add(f"failover/{e}/started", 1)  # what the other ranks look for (_watch_store, _join_failover)
        if a.rank == 0:
            union = sorted({s for r in wait_all(a, ns + "lost", "the servers it lost") for s in json.loads(r)})
            a.store.set(ns + "lost", json.dumps(union))
        lost = set(json.loads(wait_one(a, ns + "lost", "the union of lost servers from rank 0")))
        for epoch in self._epochs:
            for i, server in enumerate(epoch.servers):
                if server.address in lost:
                    epoch.client.abandon(i, f"failover {e} of the job")
        # 2. Per key on them, the rounds this rank completed; rank 0 decides who finishes each open round.
        # MODEL keys: their totals move with their next parts (ModelTotals); only their rounds are counted.
        own = a.own_keys()
        with self._lock:
            mine, model = {}, {}
            for key, (server, nbytes) in own.items():
                epoch, index = self._route(key, server, nbytes)
                if self._epochs[epoch].servers[index].address in lost:
                    (model if key in self._totals else mine)[key] = epoch
        kept = {key: self._epochs[epoch].client.kept(key) for key, epoch in mine.items()}
        counts = {k: [*v[:2], own[k][1]] for k, v in kept.items()}  # completed, whole, bytes
        rounds = {key: self._epochs[epoch].client.kept(key)[0] for key, epoch in model.items()}
        a.store.set(f"{ns}counts/{a.rank}", json.dumps({"sum": counts, "model": rounds}))
        if a.rank == 0:
            reports = [json.loads(r) for r in wait_all(a, ns + "counts", "its rounds")]
            decision = self._decide(lost, [r["sum"] for r in reports])
            decision["model_base"] = {}  # per MODEL key: the fewest rounds any rank completed
            for r in reports:
                for k, done in r["model"].items():
                    decision["model_base"][k] = min(decision["model_base"].get(k, done), done)
            a.store.set(ns + "decision", json.dumps(decision))
        decision = json.loads(wait_one(a, ns + "decision", "the failover decision from rank 0"))
        colocated = decision["colocated"]
        if not decision["dedicated"] and not colocated:  # nothing left: every machine starts a server of its own
            colocated = a.start_colocated(ns + "colocated")
        servers = weights(colocated, decision["dedicated"], a.placement)
        client, unreachable = connect(a, ns, servers, decision["job_id"], self._link_down_handler(servers),
                                      f"torch_bps[{self._name}]: failover {e}", attempt)  # fmt: skip
        if client is None:
            with self._lock:
                self._seen.update(unreachable)
            return False
        actions = {int(k): tuple(v) for k, v in decision["actions"].items()}
        # 3. Finish the open rounds on the new owners, send the held parts there, go on.
        with self._lock:
            self._routes.update({int(k): (e, i) for k, i in decision["owners"].items()})
            for key, (lo, source) in actions.items():
                if key in mine:
                    old = self._epochs[mine[key]].client
                    done, _, push_offset = kept[key]
                    numel, dtype, _, mode, _ = old._keys[key]  # the codec rides on the held part
                    data = old.kept_bytes(key) if done > lo else None
                    self._recover[key] = ((lo, source), done, data, (numel, dtype, Mode(mode)), push_offset)
            for key, done in rounds.items():
                self._totals.fill[key] = done - decision["model_base"][str(key)]
            self._epochs.append(_Epoch(client, servers, frozenset(lost)))
            self._lost |= lost
            self._spare = []
            for key in mine:
                self._route(key, *own[key])
            held, self._held = sorted(self._held, key=lambda h: h[0]), []
            # Ranks at lo + 1 hold no part of round lo: their share of its recovery goes now, on a call of its own.
            own = _Call(self._recovery_done, 1 << 30, 0, pending=1)
            finished = []
            for key in [k for k, r in self._recover.items() if r[1] > r[0][0]]:
                finished += self._send_recovery(own, key, None)
            calls: dict[int, tuple[_Call, list]] = {}
            for order, part, call in held:
                calls.setdefault(id(call), (call, []))[1].append((order, part))
            for call, items in calls.values():
                call.holding = False
                finished += self._resend(call, items) + self._end(call)  # the hold ends
            finished += self._end(own)
        for c in finished:
            client.post(lambda c=c: c.done(c.error))
        record = {"epoch": e, "lost": sorted(lost), "servers": [s.address for s in servers],
                  "standby": decision["standby"], "keys_moved": len(mine),
                  "broadcast": sum(1 for k in actions if k in mine and actions[k][1] >= 0),
                  "summed_again": sum(1 for k in actions if k in mine and actions[k][1] < 0),
                  "held_parts": len(held), "shares": decision["shares"], "attempt": attempt,
                  "seconds": round(time.monotonic() - started, 3), "t": time.time()}  # fmt: skip
        self.failovers.append(record)
        # Like the start-up split: each server's share of the bytes now, against the paper's split of what remains.
        # Keys moved to colocated servers started just now are spread by `owner`, with no shares decided.
        shares = decision["shares"]
        split = ", ".join(f"{s.address} {shares[s.address]:.0%} (rule {s.weight:.0%})" for s in servers if shares)
        split = split or f"{len(servers)} new colocated server(s), keys spread by hash"
        log.warning("torch_bps[%s]: failover %d: lost %s; %d key(s) of rank %d moved (standby: %s); bytes now: %s; "
                    "open rounds finished by broadcast %d, by summing again %d; %d held part(s) resent; %.2f s",
                    self._name, e, ", ".join(record["lost"]), len(mine), a.rank,
                    ", ".join(decision["standby"]) or "none", split, record["broadcast"], record["summed_again"],
                    len(held), record["seconds"])  # fmt: skip
        return True

    def _decide(self, lost: set[str], reports: list[dict]) -> dict:
        """Rank 0's failover decision (agreement.plan), given where the keys no rank reported live now."""
        moved = {int(k) for r in reports for k in r}
        loads: dict[str, int] = {}  # per server, the bytes of the keys that stay where they are
        with self._lock:
            for key, (server, nbytes) in self._agree.own_keys(True).items():
                if key not in moved:
                    epoch, index = self._route(key, server, nbytes)
                    address = self._epochs[epoch].servers[index].address
                    loads[address] = loads.get(address, 0) + nbytes
            current: dict[str, Server] = {}  # every server some key may live on now, once each, in joining order
            for s in (s for e in self._epochs for s in e.servers if s.address not in self._lost):
                current.setdefault(s.address, s)
            spare = self._spare
        size = sum(s.dedicated for s in self._epochs[0].servers)
        decision = plan(self._agree, list(current.values()), lost, spare, reports, loads, size)
        self._spare = decision["standby"]
        return decision

    def _recovery_done(self, error: BaseException | None) -> None:
        if error is not None:
            log.error("torch_bps[%s]: a recovery round failed: %s", self._name, error)
            with self._lock:
                self._failure = self._failure or error

    def rebalance(self) -> dict:
        """Re-place every key by the paper's rule over the servers that answer now: those that remain, standbys,
        servers that came back or registered since; under a fresh job id. Collective over the group, at a step
        boundary: every rank calls it once its collectives are done (it waits for them, up to the timeout).
        Returns what it did (also logged)."""
        a = self._agree
        with self._lock:  # this rank's failover, if one runs, ends first: other ranks join it (_join_failover)
            if not self._idle.wait_for(lambda: self._active == 0 and self._thread is None or self._failure, a.timeout):
                raise BpsTimeoutError(f"rebalance: {self._active} collective(s) or a failover still under way after "
                                      f"{a.timeout}s")  # fmt: skip
            if self._failure is not None:
                raise self._failure
            self._rebalances += 1
            self._rebalancing = True
            ns, started = f"rebalance/{self._rebalances}/", time.monotonic()
        try:
            client, servers = self._agree_rebalance(ns)
        except BaseException:
            with self._lock:  # the servers noticed lost meanwhile are failed over now
                self._rebalancing, seen, self._seen = False, self._seen - self._lost, set()
                for address in seen:
                    self._notice(address)
            raise
        keys = a.own_keys(True)  # every slice's keys, in one order: every rank places them alike
        with self._lock:
            # Every key goes to servers every rank reached: one noticed lost meanwhile holds none of them.
            self._rebalancing, old = False, self._epochs[1:]
            self._seen.clear()
            self._epochs.append(_Epoch(client, servers, placement=Placement(servers)))
            for key in sorted(keys):
                self._route(key, *keys[key])
            self._lost -= {s.address for s in servers}  # a server that came back is failed over again if lost again
        for epoch in old:  # nothing routes there any more
            epoch.client.close()
        record = {"rebalance": self._rebalances, "servers": [s.address for s in servers], "keys": len(keys),
                  "seconds": round(time.monotonic() - started, 3), "t": time.time()}  # fmt: skip
        self.failovers.append(record)
        to = ", ".join(f"{s.address} ({s.weight:.0%})" for s in servers)
        log.warning("torch_bps[%s]: rebalance %d: %d key(s) placed over %s; %.2f s", self._name, self._rebalances,
                    len(keys), to, record["seconds"])  # fmt: skip
        return record

    def _agree_rebalance(self, ns: str) -> tuple[object, list[Server]]:
        """Every rank's client of the servers rank 0 finds answering; agreed again if one of them dies before every
        rank said HELLO to it (`connect`)."""
        a, client, attempt, unreachable = self._agree, None, 0, set()
        a.store.set(f"{ns}ready/{a.rank}", "1")
        if a.rank == 0:
            ready = [f"{ns}ready/{r}" for r in range(a.world_size)]
            poll_keys(a, ready, "every rank's collectives and failovers done", self._join_failover)
        while client is None:
            sub = ns + (f"again{attempt}/" if attempt else "")
            if a.rank == 0:  # the servers that answer now (a dead one does not), none a rank could not reach
                job, (colocated, dedicated) = int.from_bytes(os.urandom(8), "little"), a.available()
                dedicated = [address for address in dedicated if address not in unreachable]
                decision = {"job_id": job, "colocated": colocated, "dedicated": dedicated}
                a.store.set(sub + "decision", json.dumps(decision))
            poll_keys(a, [sub + "decision"], "the rebalance decision from rank 0", self._join_failover)
            decision = json.loads(a.store.get(sub + "decision"))
            servers = weights(decision["colocated"], decision["dedicated"], a.placement)
            client, missed = connect(a, sub, servers, decision["job_id"], self._link_down_handler(servers),
                                     f"torch_bps[{self._name}]: rebalance {self._rebalances}", attempt)  # fmt: skip
            unreachable.update(missed)
            attempt += 1
        return client, servers

    def _join_failover(self) -> bool:
        """Inside a rebalance, before its decision: join the failover another rank started before its own rebalance
        (it waits for every rank; this rank's own notices wait for the rebalance's end). True if it joined one."""
        a, e = self._agree, len(self._epochs)
        lost = self._started_by_others(e)
        if not lost:
            return False
        with self._lock:
            thread = self._join(lost)
        thread.join(3 * a.timeout)
        if self._failure is not None:
            raise self._failure
        return True

    def close(self) -> None:
        """Close the clients failovers added (the runtime closes epoch 0's, which it shares)."""
        self._closed.set()
        for epoch in self._epochs[1:]:
            epoch.client.close()


__all__ = ["Router"]
