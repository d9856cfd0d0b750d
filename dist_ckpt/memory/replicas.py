"""Ring replication of the memory tier over the peer channel, in the background.

Each node leader sends its files of its newest committed in-memory generation to its ring
successor, which keeps them as a replica (``<memory root>.replica/``). Transfers run on the
leaders' ring groups (``ring_group_index``): the pair "leader i sends to leader i+1" always
uses one group, and a leader's sends and receives use different groups, so a transfer never
runs beside another operation of its own group in that process; never the training group.

A push is agreed in the c10d store first, so that neither side blocks in the transport
waiting for a partner that is not coming:

1. the sender writes an offer (``ring/offer/<sender>/<n>``: generation, directory, files and
   sizes, the manifest last);
2. the successor's receiver thread, which watches for offer ``n`` of its predecessor, takes it
   with a compare-and-set of ``ring/accept/<sender>/<n>`` to ``accepted``; a sender that waited
   ``OFFER_WAIT_S`` in vain sets it to ``withdrawn`` the same way (one of the two wins);
3. once accepted, the files cross in the offer's order (``PeerChannel``), manifest last: a
   replica's commit point. The receiver records it as the sender's newest replica
   (``REPLICA_OF_KEY``) and answers in ``ring/done/<sender>/<n>``, which the sender waits for.
   The offer's keys are deleted once read (a withdrawn offer's stay: the receiver steps
   past ``n`` only after it saw offer ``n``).

A replica's bytes are not checked on arrival (as any copy in memory: restore checks them
against the manifest before use). Call order: ``Receiver.start`` on each leader at
construction and ``Receiver.close`` at close; ``push`` from one thread at a time (the ring's
push lock).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from .. import logs
from ..errors import DistCkptError
from ..format.manifest import MANIFEST_NAME, check_relative_path, pending_update
from ..protocol.comm import Comm
from .peer import PeerChannel, PeerError

log = logs.get(__name__)
REPLICA_OF_KEY = "ring/replica-of/"  # + sender's rank: the generation of its newest replica
RING_FLOOR_KEY = "ring/floor"  # the two lowest records ({sender: generation}, JSON), by the first leader
OFFER_WAIT_S = 10.0  # how long a sender waits for its successor to take an offer
# a receiver looks at the store for the next offer when the job's bell rings (the sender
# rings it, ``protocol/node.py``) and, in case a ring was missed, once per IDLE_CHECK_S
IDLE_CHECK_S = 30.0
# after it took an offer, a receiver (one per node: the leader) asks the store itself for the
# next one for this long: a job that saves every few updates pushes every save, and waiting
# for the bell (its watcher's reads up to a second apart) made replicas lag generations behind
ACTIVE_S = 10.0
ACTIVE_POLL_S = 0.5
RETRY_S = 2.0  # a receiver's pause after the store failed it, before it looks again


class ReplicaRecords:
    """The receivers' records (``REPLICA_OF_KEY``), read by the first leader for the ring's
    floor (``NodeRing.protected``). A record, once written, is only ever replaced, never
    deleted: a sender's key is checked until it first exists, then all are read together in
    one ``multi_get`` (which would block on a missing key)."""

    def __init__(self, store: Any, senders: list[int]) -> None:
        self.store = store
        self.missing = list(senders)
        self.present: list[int] = []

    def read(self) -> dict[int, str]:
        """Sender leader -> the generation of its newest replica, for every record written."""
        for sender in list(self.missing):  # each a request only until the record first exists
            if self.store.check([f"{REPLICA_OF_KEY}{sender}"]):
                self.missing.remove(sender)
                self.present.append(sender)
        if not self.present:
            return {}
        values = self.store.multi_get([f"{REPLICA_OF_KEY}{sender}" for sender in self.present])
        return {sender: raw.decode() for sender, raw in zip(self.present, values, strict=True)}


def ring_group_index(position: int, nodes: int) -> int:
    """The ring group of the pair "leader at ``position`` sends to the next": alternating
    0 and 1, and 2 for the last pair of an odd ring (its successor sends on 0)."""
    return 2 if nodes % 2 and position == nodes - 1 else position % 2


def ring_groups_needed(nodes: int) -> int:
    return 0 if nodes < 2 else 2 + nodes % 2


def _key(kind: str, sender: int, number: int) -> str:
    return f"ring/{kind}/{sender}/{number}"


class Sender:
    """A leader's pushes to its successor, on the group of its pair."""

    def __init__(self, comm: Comm, channel: PeerChannel, successor: int, done_wait_s: float) -> None:
        self.comm = comm
        self.channel = channel
        self.successor = successor
        self.done_wait_s = done_wait_s  # the transfer's deadline, plus the receiver's install
        self.number = 0

    def push(self, generation: str, directory: str, target: str, paths: list[str]) -> None:
        """Send ``paths`` of ``directory`` and its manifest as the replica ``target``; raises
        ``PeerError`` when the successor did not take them or did not keep them."""
        number, self.number = self.number, self.number + 1
        files = [(path, os.path.getsize(os.path.join(directory, path))) for path in [*paths, MANIFEST_NAME]]
        store = self.comm.store
        store.set(_key("offer", self.comm.rank, number),
                  json.dumps({"generation": generation, "target": target, "files": files}).encode())
        self.comm.node.ring()
        if self.comm.store_wait([_key("accept", self.comm.rank, number)], OFFER_WAIT_S):
            taken = store.compare_set(_key("accept", self.comm.rank, number), "", "withdrawn")
            if taken != b"accepted":
                raise PeerError(f"the node of rank {self.successor} did not take the replica of {generation}")
        elif store.get(_key("accept", self.comm.rank, number)) != b"accepted":
            raise PeerError(f"the replica of {generation} was withdrawn")
        for path, size in files:
            try:
                self.channel.send_file(self.successor, os.path.join(directory, path), None, size)
            except PeerError as exc:  # the receiver was told, and answers with its failure
                log.warning("%s", exc)
        done = _key("done", self.comm.rank, number)
        if self.comm.store_wait([done], self.done_wait_s):
            raise PeerError(f"the node of rank {self.successor} did not confirm the replica of {generation}")
        answer = store.get(done).decode()
        for kind in ("accept", "done"):  # a long run leaves no key per push in the store
            store.delete_key(_key(kind, self.comm.rank, number))
        if answer != "ok":
            raise PeerError(answer)


class Receiver:
    """A leader's thread receiving its predecessor's pushes into ``replica_root``."""

    def __init__(self, comm: Comm, channel: PeerChannel, predecessor: int, replica_root: str,
                 on_replica: Callable[[], None] | None = None) -> None:
        self.comm = comm
        self.channel = channel
        self.predecessor = predecessor
        self.replica_root = replica_root
        self.on_replica = on_replica  # tests: a replica arrived
        self.received = 0  # replicas kept
        self._closed = threading.Event()
        self._active_until = 0.0  # monotonic: the store is asked directly until then
        self._thread = threading.Thread(target=self._run, daemon=True, name="dist-ckpt-ring-receiver")

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        """Offers in number order. A store that fails a read is tried again (a replica missed
        costs the lost node its memory restore); a transport that fails mid-file ends the
        thread, as the pair's groups are out of step (the sender stops as well)."""
        number, failing = 0, False
        while not self._closed.is_set():
            try:
                offer = self._take(number)
            except Exception:  # noqa: BLE001 - the store failed this read: look again
                if self._closed.is_set():
                    return
                if not failing:  # once per spell of failures, not every RETRY_S
                    log.warning("the ring's receiver could not read offer %d; retrying every %g s",
                                number, RETRY_S, exc_info=True)
                failing = True
                self._closed.wait(RETRY_S)
                continue
            failing = False
            if offer is None:  # none yet
                continue
            if offer:  # taken by this receiver, not withdrawn by its sender
                try:
                    answer = self._receive(offer)
                except Exception as exc:  # noqa: BLE001 - the transport failed mid-file
                    self._answer(number, f"the node of rank {self.comm.rank} kept no replica: {exc}")
                    if not self._closed.is_set():
                        log.warning("the ring's receiver stopped", exc_info=True)
                    return
                self._answer(number, answer)
            number += 1

    def _take(self, number: int) -> dict | None:
        """Offer ``number`` of the predecessor: None while there is none, ``{}`` when its
        sender withdrew it first, else the offer, taken (compare-and-set) and deleted."""
        store = self.comm.store
        offer_key = _key("offer", self.predecessor, number)
        if time.monotonic() < self._active_until:
            if self.comm.store_wait([offer_key], ACTIVE_POLL_S):
                return None
        else:
            bell = self.comm.node.bell
            rang = bell.value()  # before the check: a ring after it is a change from this value
            if not store.check([offer_key]):
                bell.wait(rang, IDLE_CHECK_S, stop=self._closed)
                return None
        self._active_until = time.monotonic() + ACTIVE_S
        if store.compare_set(_key("accept", self.predecessor, number), "", "accepted") != b"accepted":
            return {}
        offer = json.loads(store.get(offer_key))
        try:
            store.delete_key(offer_key)
        except Exception:  # noqa: BLE001 - taken either way: a retry would wait for a deleted key
            log.warning("could not delete offer %d of rank %d", number, self.predecessor, exc_info=True)
        return offer

    def _answer(self, number: int, answer: str) -> None:
        try:
            self.comm.store.set(_key("done", self.predecessor, number), answer.encode())
        except Exception:  # noqa: BLE001 - the sender's wait for it ends at its deadline
            log.warning("could not answer offer %d of rank %d", number, self.predecessor, exc_info=True)

    def _receive(self, offer: dict) -> str:
        """The offered files, in order, into the offer's pending directory; "ok" or why not.
        Every file is received (or refused) so that both ends stay in step: after a failure
        the rest goes to a scratch directory, then away."""
        generation, target = str(offer["generation"]), str(offer["target"])
        failures = [] if pending_update(target) is not None else [f"bad replica directory {target!r}"]
        directory = os.path.join(self.replica_root, target if not failures else "")
        scratch = os.path.join(self.replica_root, f".discard-{uuid.uuid4().hex[:8]}")
        for index, (path, size) in enumerate(offer["files"]):
            try:
                name = check_relative_path(str(path))
            except DistCkptError as exc:
                failures.append(str(exc))
                name = f"file-{index}"
            into = scratch if failures else directory
            try:
                self.channel.receive_file(self.predecessor, os.path.join(into, name), generation,
                                          name, None, int(size))
            except PeerError as exc:
                failures.append(str(exc))
        shutil.rmtree(scratch, ignore_errors=True)
        if failures:
            if pending_update(target) is not None:
                shutil.rmtree(directory, ignore_errors=True)
            return f"the node of rank {self.comm.rank} kept no replica of {generation}: {failures[0]}"
        self.received += 1
        try:
            self.comm.store.set(f"{REPLICA_OF_KEY}{self.predecessor}", generation.encode())
        except Exception:  # noqa: BLE001 - the peers keep what the previous record needs
            log.warning("could not record the replica of %s", generation, exc_info=True)
        if self.on_replica is not None:
            self.on_replica()
        return "ok"

    def close(self, timeout_s: float) -> bool:
        """Stop watching for offers; False when a transfer still runs after ``timeout_s``."""
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()
