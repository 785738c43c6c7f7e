"""What a service holds of one DHT: the AS part (routing buckets and their
storage references) and the SS part (one repository per stored bucket)."""

from __future__ import annotations

import ctypes
import functools
import shutil
import time
from collections.abc import Generator
from typing import Any

from twisted.logger import Logger

from domus.placement import layout, replicas
from domus.placement.bucketmap import BucketMap
from domus.routing import FEWEST_HOPS, RoutingGraph, make_graph
from domus.routing.base import contains
from domus.service import holdings
from domus.storage import (
    PLATFORMS,
    FailedRepository,
    Repository,
    StorageFault,
    StorageFullFault,
    Store,
    snapshot,
)
from domus.storage.base import TrackedRepository
from domus.wire import protocol as wire
from domus.wire.keys import HASH_FUNCTIONS, bucket_shift

FREEZE_LEASE = wire.FREEZE_LEASE    # see domus.wire.protocol
REGROUP_PAGE = 2048     # records copied per reactor turn while regrouping
REGROUP_ROUNDS = 20     # catch-up rounds at most before the last one
REGROUP_SETTLED = 256   # changed keys a round may bring for the last to follow
MAX_NUMBERING = 33      # a request's bucket numbering at most: 2^32 buckets

log = Logger(namespace="domus.service")


dht_home = holdings.dht_home      # (where a DHT's files are: its id checked)


class HostedDht:
    """One DHT on one service, created inactive; ``apply`` (with the
    supervisor's descriptor) makes it what the supervisor says: active (its
    store open, its buckets served) or inactive (nothing open, nothing in
    memory; requests get INACTIVE).

    Deactivation keeps every record: a disk DHT's are in its files already;
    a RAM DHT's are first saved to a snapshot in its directory under the data
    dir (domus.storage.snapshot), and only once the snapshot is complete on
    disk is the memory let go.  Activation opens the store again and loads
    the snapshot, if there is one, before a request is served; the snapshot
    is deleted once its records are back.  So a snapshot on disk always
    holds exactly the records of a DHT that has served nothing since; a
    service that finds one at start loads it."""

    def __init__(self, descriptor: dict[str, Any], service_name: str,
                 data_dir: str | None = None) -> None:
        self.id: int = descriptor["id"]
        self.name: str = descriptor["name"]
        self.label = f"DHT {self.name!r}"
        self.service_name = service_name
        self.platform: str = descriptor["platform"]
        self.medium: str = descriptor.get("storage", "ram")
        platform = PLATFORMS[self.platform]
        if self.medium not in platform.media:
            raise ValueError(f"DHT {self.name!r}: platform {self.platform} cannot store on "
                             f"{self.medium}")
        if self.medium == "disk" and data_dir is None:
            raise ValueError(f"DHT {self.name!r} stores on disk, and this service has no "
                             f"data dir")
        self._platform = platform
        self.home = dht_home(data_dir, self.id) if data_dir is not None else None
        self.durability: str = descriptor.get("durability") or "async"
        self.store: Store | None = None
        self.active = False
        self.repos: dict[int, Repository] = {}
        # Replication (domus.placement.replicas): the buckets this service
        # keeps a backup copy of (written only by their primary's REPLICATE
        # messages, never served to clients); for each bucket, the services
        # holding its backups, which a write here must reach first; and the
        # buckets whose every copy was lost, which answer DATA_LOST until
        # the loss is accepted.
        self.backups: dict[int, Repository] = {}
        self.copies: list[BucketMap[str]] = replicas.backups(descriptor)
        self.lost: dict[int, str] = {}
        self.replicated = (descriptor.get("replicas") or 1) > 1
        # Numbering (see "Resizing" below): the bucket count, the request
        # header byte that says it, the layout version's reply tag, and the
        # part (count, bucket) of the medium that holds each stored bucket.
        self._hash = HASH_FUNCTIONS[descriptor.get("hash") or "xxh3"]
        self.base_count: int = descriptor.get("initial_buckets") or descriptor["buckets"]
        self._set_count(descriptor["buckets"])
        self.layout_tag = wire.layout_tag(descriptor.get("version", 0))
        self.part_of: dict[int, tuple[int, int]] = {}
        self._regrouping: Generator[None, None, Any] | None = None
        # AS: the buckets routed here, and for each the name of the service
        # storing it (a floor map over ranges; see domus.placement.bucketmap).
        # Buckets being moved (see "Moving a bucket" below): frozen here as
        # the source, with the keys to export; staged here as the target.
        self.frozen: dict[int, tuple[Repository, list[bytes]]] = {}
        self.staged: dict[int, Repository] = {}
        # bucket -> its keys when its move began (what export pages through)
        self.snapshots: dict[int, list[bytes]] = {}
        # bucket -> when it was frozen here (source) or last staged (target)
        self.frozen_at: dict[int, float] = {}
        self.staged_at: dict[int, float] = {}
        self.routed: list[tuple[int, int]] = []       # bucket ranges routed here
        self.storage_refs: BucketMap[str] = BucketMap(max(descriptor["buckets"], 1))
        self.storage_layout: BucketMap[str] = self.storage_refs     # every bucket -> SS
        self.routing_layout: BucketMap[str] = self.storage_refs     # every bucket -> AS
        self.addresses: dict[str, str] = {}                         # service -> address
        self.graph: RoutingGraph = routing_graph(descriptor)
        self.algorithm: str = descriptor.get("routing_algorithm") or FEWEST_HOPS
        # LOOKUPs answered here: found (the target is routed here) and
        # forwarded (told the next hop): the AS's routing load.
        self.lookups = {"found": 0, "forwarded": 0}
        # Moves through here (the metrics report them): buckets frozen here
        # as a move's source, the seconds they stayed frozen, and how each
        # freeze ended (sent: the move was done; thawed: undone, abandoned
        # or its lease ran out); buckets staged here as a target, the
        # records staged, and the staged copies taken on (as primary or
        # backup); regroups done after a resize and the records they copied.
        self.moves: dict[str, float] = {
            "frozen": 0, "frozen_seconds": 0.0, "sent": 0, "thawed": 0, "staged": 0,
            "records_staged": 0, "received": 0, "regroups": 0, "records_regrouped": 0}
        # Why the last activation failed, while the supervisor still wants
        # the DHT active: requests are told this rather than "inactive",
        # and the service tries again (``retry``, with backoff: the
        # handler's retry_storage) with the descriptor it was given.
        self.problem: str | None = None
        self.pending: dict[str, Any] | None = None
        self.some_failed = False        # a bucket here is a FailedRepository
        self.retries = 0
        self.retry_at = 0.0
        self.last_retry_problem: str | None = None
        # The service's free space against its reserve (None: not watched);
        # a bucket is not staged here while the disk is at the reserve.
        self.headroom: Any = None
        self.descriptor = descriptor     # routes and buckets come with apply()

    def apply(self, descriptor: dict[str, Any]) -> int:
        """Take a (new) descriptor from the supervisor: activate or
        deactivate as its state says, create repositories for buckets now
        stored here, drop the ones no longer stored here.  Returns the
        records saved or loaded by a change of state (0 if none).  A change
        of state that fails raises StorageFault and leaves the DHT as it
        was."""
        moved = 0
        if descriptor["buckets"] != self.bucket_count:
            self._renumber(descriptor["buckets"])
            self.graph = routing_graph(descriptor)
        storage = layout.owners(descriptor, "storage")
        self.copies = replicas.backups(descriptor)
        self.lost = {int(bucket): service
                     for bucket, service in (descriptor.get("storage_lost") or {}).items()}
        # (A lost bucket is stored nowhere until its loss is accepted.)
        placed = storage.copy_without(self.lost) if self.lost else storage
        wanted = descriptor.get("state", "active") == "active"
        if wanted and not self.active:
            try:
                moved = self._activate(descriptor, placed)
            except StorageFault as exc:
                self.problem = str(exc)
                self.pending = descriptor
                raise
        elif wanted:
            self._place(placed)
        elif self.active:
            moved = self._deactivate()
        self.problem = None
        self.pending = None
        self.descriptor = descriptor
        self.layout_tag = wire.layout_tag(descriptor.get("version", 0))
        self._route(descriptor, storage)
        return moved

    # ------------------------------------------------------------ storage faults
    # A store that will not open (no room to recover, permissions, a
    # damaged file) is reported as what it is: requests on the DHT's
    # buckets get STORAGE_ERROR naming the DHT, the bucket, the path and
    # the cause (never INACTIVE: the supervisor wants it active), and the
    # service opens it again with backoff, serving as soon as it opens.  A
    # single bucket whose database will not open is served by a
    # FailedRepository meanwhile, and retried the same way.
    def needs_retry(self) -> bool:
        """Cheap (asked ten times a second): a failed bucket sets a flag."""
        return self.pending is not None or self.some_failed

    def retry(self) -> None:
        """Try again what failed to open: the whole store (the descriptor
        of the activation that failed), or each failed bucket.
        StorageFault with the first reason it still fails for."""
        if self.pending is not None and not self.active:
            self.apply(self.pending)
            return
        self.pending = None
        failed = self.failed_buckets()
        if not failed or self.store is None:
            return
        on_medium = self.store.parts()
        still: list[str] = []
        for bucket in sorted(failed):
            try:
                self._open_bucket(bucket, on_medium)
            except StorageFault as exc:
                self.repos[bucket] = FailedRepository(str(exc))
                still.append(str(exc))
            else:
                log.info("service {service}: {dht} bucket {bucket} opened; serving it",
                         service=self.service_name, dht=self.label, bucket=bucket)
        if still:
            raise StorageFault(still[0])

    def failed_buckets(self) -> dict[int, str]:
        """bucket -> why its repository failed to open, for the buckets
        stored here that are served by a FailedRepository."""
        if not self.some_failed:
            return {}
        failed = {bucket: repo.reason for bucket, repo in self.repos.items()
                  if isinstance(repo, FailedRepository)}
        self.some_failed = bool(failed)
        return failed

    def problem_message(self, bucket: int | None) -> str:
        """What a request on ``bucket`` is told while the DHT's store will
        not open here."""
        which = f"bucket {bucket} of {self.label}" if bucket is not None else self.label
        return (f"{which} is not served on service {self.service_name}: {self.problem}; "
                f"the service tries again by itself (with backoff) and serves it as soon as "
                f"it opens")

    def _place(self, storage: BucketMap[str]) -> None:
        """Open the buckets ``storage`` (bucket -> service) puts here, drop
        the others."""
        assert self.store is not None
        stored = set(layout.buckets_in(layout.ranges_of(storage, self.service_name)))
        # A frozen bucket still stored here keeps its repository in
        # ``frozen`` until the supervisor thaws it: opening it afresh would
        # serve an empty (or a second) copy of it.
        adopted = False
        now = time.monotonic()
        for bucket in sorted(stored & self.staged.keys()):
            waited = now - self.staged_at.get(bucket, 0.0)
            if waited > FREEZE_LEASE / 2:   # (checked before anything changes)
                raise StorageFault(f"{self.label}: service {self.service_name} will not "
                                   f"serve bucket {bucket}: its copy was staged "
                                   f"{waited:.0f}s ago, and its source may serve it "
                                   f"again by now; move it again")
        backed = {bucket for copy in self.copies
                  for bucket in layout.buckets_in(layout.ranges_of(copy, self.service_name))}
        for bucket in sorted(stored & self.backups.keys()):      # promoted to primary
            self.repos[bucket] = self.backups.pop(bucket)
        for bucket in sorted((self.repos.keys() & backed) - stored):   # now a backup
            self.backups[bucket] = self.repos.pop(bucket)
        opening = sorted(stored - self.repos.keys() - self.frozen.keys())
        new_backups = sorted(backed - self.backups.keys())
        on_medium = self.store.parts() if opening or new_backups else set()
        for bucket in opening:
            staged = self.staged.get(bucket)
            if staged is not None:          # moved here: its records came first
                self.staged.pop(bucket)
                self.staged_at.pop(bucket, None)
                self.repos[bucket] = staged
                self.part_of[bucket] = (self.bucket_count, bucket)
                self.moves["received"] += 1
                adopted = True
                continue
            try:
                self._open_bucket(bucket, on_medium)
            except StorageFault as exc:
                # This bucket answers STORAGE_ERROR; the others serve on.
                log.error("service {service}: {problem}", service=self.service_name,
                          problem=str(exc))
                self.repos[bucket] = FailedRepository(str(exc))
                self.some_failed = True
        for bucket in new_backups:
            staged = self.staged.pop(bucket, None)
            if staged is not None:          # copied here from its primary
                self.staged_at.pop(bucket, None)
                self.backups[bucket] = staged
                self.moves["received"] += 1
                adopted = True
                continue
            # (At creation: an empty bucket.  The supervisor names a service
            # as a backup of a bucket with records only once it has a copy.)
            self._open_bucket(bucket, on_medium)
            self.backups[bucket] = self.repos.pop(bucket)
            self.part_of.pop(bucket, None)
        for bucket in sorted(self.backups.keys() - backed):
            dropped = self.backups.pop(bucket)
            if not isinstance(dropped, FailedRepository):
                self.store.remove(bucket, self.bucket_count)
        if adopted and self.medium == "disk":
            # A moved bucket is as durable here as the DHT promises before
            # this service acknowledges the layout that makes it the owner:
            # only then does the source delete its copy.
            self.store.flush()
        for bucket in sorted(self.repos.keys() - stored):
            dropped = self.repos.pop(bucket)
            self.snapshots.pop(bucket, None)
            part = self.part_of.pop(bucket, (self.bucket_count, bucket))
            if any(other is dropped for other in self.repos.values()):
                continue        # (a part shared with buckets still stored here)
            log.warn("service {service}: DHT {dht!r} bucket {bucket} is no longer "
                     "stored here; dropping its {records} records",
                     service=self.service_name, dht=self.name, bucket=bucket,
                     records=len(dropped))
            if isinstance(dropped, FailedRepository):
                continue
            self.store.remove(part[1], part[0])
        for bucket in sorted(self.frozen.keys() - stored):   # moved away: done
            self.frozen.pop(bucket)
            self._end_freeze(bucket)
            self.moves["sent"] += 1
            self.snapshots.pop(bucket, None)
            part = self.part_of.pop(bucket, (self.bucket_count, bucket))
            self.store.remove(part[1], part[0])

    def _route(self, descriptor: dict[str, Any], storage: BucketMap[str]) -> None:
        routing = layout.owners(descriptor, "routing")
        self.routing_layout = routing
        self.routed = layout.ranges_of(routing, self.service_name)
        self.addresses = {**layout.addresses(descriptor, "routing"),
                          **layout.addresses(descriptor, "storage")}
        refs: BucketMap[str] = BucketMap(descriptor["buckets"])
        for routed_first, routed_end in self.routed:
            for first, end, name in storage.ranges(routed_first, routed_end):
                refs.assign(first, end, name)
        self.storage_refs = refs
        self.storage_layout = storage

    @property
    def routing_bucket_count(self) -> int:
        return sum(end - first for first, end in self.routed)

    def lookup(self, target: int, current: int | None) -> tuple[int, int, str]:
        """AS: one hop of a distributed lookup for bucket ``target``, asked
        of this service as the router of bucket ``current`` (None: of no
        bucket in particular).  Returns (LOOKUP_FOUND, target, the service
        storing it) if ``target`` is routed here, else (LOOKUP_NEXT, the
        next bucket, the service routing it), by aggregated routing over
        every bucket routed here.  ValueError for a bucket out of range or
        when nothing is routed here."""
        if not 0 <= target < self.graph.bucket_count:
            raise ValueError(f"bucket {target} is not a bucket of {self.label} "
                             f"(0 to {self.graph.bucket_count - 1})")
        if not self.routed:
            raise ValueError(f"service {self.service_name} routes no bucket of {self.label}")
        if contains(self.routed, target):
            self.lookups["found"] += 1
            return wire.LOOKUP_FOUND, target, self.storage_refs.owner(target)
        algorithm = self.algorithm
        if current is not None and not (0 <= current < self.graph.bucket_count
                                        and contains(self.routed, current)):
            current = None      # a client with an old layout: route from here
        if current is None:
            algorithm = FEWEST_HOPS   # needs no current bucket, gets at least as close
        following = self.graph.next_bucket(self.routed, target, algorithm, current)
        self.lookups["forwarded"] += 1
        return wire.LOOKUP_NEXT, following, self.routing_layout.owner(following)

    def storage_owner(self, bucket: int) -> str | None:
        """The service storing ``bucket`` as this service's descriptor says
        (for redirects); None for a bucket out of range."""
        return self.storage_layout.get(bucket)

    def _activate(self, descriptor: dict[str, Any], storage: BucketMap[str]) -> int:
        """Open the store and the buckets stored here, and load the RAM
        snapshot if there is one.  All or nothing: on failure everything
        opened is closed again and the snapshot stays."""
        self.store = self._platform.open_store(self.medium, self.home, self.label,
                                               self.durability, base_count=self.base_count)
        loaded = 0
        # What this service saved when the DHT was deactivated (the
        # supervisor remembers it): a snapshot missing or short of it is an
        # error, never an empty or partial DHT.
        expected = (descriptor.get("saved") or {}).get(self.service_name)
        try:
            self._place(storage)
            if self.medium == "ram" and snapshot.exists(self.home):
                assert self.home is not None
                loaded = snapshot.load(self.home, self.id, {**self.repos, **self.backups},
                                       self.label)
            if expected is not None and loaded != expected and self.medium == "ram":
                where = snapshot.snapshot_path(self.home) if self.home else "no data dir"
                raise StorageFault(f"{self.label}: service {self.service_name} saved "
                                   f"{expected} records when the DHT was deactivated, but "
                                   f"{loaded} are in {where}; the DHT stays inactive")
        except BaseException:
            self._release()
            raise
        if loaded:
            snapshot.remove(self.home)  # type: ignore[arg-type]
            log.info("service {service}: DHT {dht!r}: loaded {records} saved records",
                     service=self.service_name, dht=self.name, records=loaded)
        self.active = True
        return loaded

    def _deactivate(self) -> int:
        """Save a RAM DHT's records (all or nothing), flush a disk DHT, then
        close everything and give the memory back."""
        saved = 0
        if self.shared_buckets():
            raise StorageFault(f"{self.label}: service {self.service_name} is regrouping its "
                               f"buckets after a resize; deactivate it once that is done")
        if self.medium == "ram":
            if self.home is None:
                raise StorageFault(f"{self.label}: service {self.service_name} has no data "
                                   f"dir to save the records of a RAM DHT in; it stays active")
            # (The backups held here too: a failover after the DHT is active
            # again promotes them.  A bucket is a primary or a backup here,
            # never both.)
            saved = snapshot.save(self.home, self.id, {**self.repos, **self.backups},
                                  self.label)
        else:
            assert self.store is not None
            self.store.flush()
            saved = self.records()
        self._release()
        self.active = False
        release_memory()
        log.info("service {service}: DHT {dht!r} deactivated; {records} records kept on "
                 "disk", service=self.service_name, dht=self.name, records=saved)
        return saved

    def _release(self) -> None:
        self.abandon_moves()
        self.repos.clear()
        self.backups.clear()
        self.part_of.clear()
        store, self.store = self.store, None
        if store is not None:
            try:
                store.close()
            except StorageFault as exc:   # (what was flushed or logged is kept)
                log.error("service {service}: {problem}", service=self.service_name,
                          problem=str(exc))

    # ------------------------------------------------------------ moving a bucket
    # A bucket's storage moves from a source service to a target in these
    # steps, driven by the supervisor, so that no acknowledged write is lost
    # and none is applied twice, while the bucket is served all along but
    # for a short final pause:
    #   1. the source tracks the bucket: it keeps serving it, and every key a
    #      change touches is noted (``TrackedRepository``; the C hot path
    #      leaves the bucket to Python meanwhile);
    #   2. the supervisor pages the records out of the source (export, from
    #      a snapshot of the keys taken when tracking began) and into a
    #      staged repository on the target (stage); then, round after round,
    #      the keys changed meanwhile, with their values now (catch up);
    #   3. once a round brings few changes, the source freezes the bucket:
    #      from then on every request on it is answered MOVING (clients
    #      retry), so its records stop changing; the last changes are
    #      staged, and the supervisor checks that both copies hold as many
    #      records;
    #   4. the supervisor publishes the new layout; the target adopts the
    #      staged repository (flushed to disk first, for a disk DHT) and
    #      serves it, the source deletes its copy;
    #   5. on any failure before 4, the source thaws and stops tracking the
    #      bucket and the target discards what it staged: nothing changed.
    # A key written during step 2 is staged by its page or by a catch-up
    # round after it (it is noted when written, and sent with its value at
    # the time of sending), and nothing changes during the final round, so
    # the staged copy equals the source's when the layout is published.
    # A move is driven over one link to the supervisor.  A service that
    # registers again (a new link, or a restarted supervisor) is in no move
    # any more: it thaws and discards what it was left with
    # (``abandon_moves``), then takes the layout it is sent, so a bucket can
    # never stay frozen for want of a supervisor to thaw it.
    def track(self, bucket: int) -> int:
        """Step 1 (source): note every change to ``bucket`` from now on, and
        take the snapshot of its keys that export pages through; returns its
        records."""
        repo = self.repos.get(bucket)
        if repo is None or not self.active:
            raise StorageFault(f"{self.label}: service {self.service_name} does not store "
                               f"bucket {bucket}, so it cannot move it")
        if self.part_of.get(bucket, (self.bucket_count,))[0] != self.bucket_count:
            raise StorageFault(f"{self.label}: bucket {bucket} is not regrouped after the "
                               f"resize yet on service {self.service_name}; move it later")
        if not isinstance(repo, TrackedRepository):
            repo = self.repos[bucket] = TrackedRepository(repo)
        keys = repo.key_snapshot()
        self.snapshots[bucket] = keys
        return len(keys)

    def catch_up(self, bucket: int) -> list[bytes | None]:
        """Step 2 (source): the keys of ``bucket`` changed since the last
        call, each with its value now (None: deleted)."""
        repo = self.repos.get(bucket)
        if repo is None and bucket in self.frozen:
            repo = self.frozen[bucket][0]
        if not isinstance(repo, TrackedRepository):
            raise StorageFault(f"{self.label}: service {self.service_name} is not moving "
                               f"bucket {bucket} (the move was abandoned); start it again")
        return repo.take_changes()

    def freeze(self, bucket: int) -> int:
        """Step 3 (source): stop serving ``bucket``; returns its records."""
        if bucket in self.frozen:
            return len(self.frozen[bucket][0])
        repo = self.repos.get(bucket)
        if repo is None or not self.active:
            raise StorageFault(f"{self.label}: service {self.service_name} does not store "
                               f"bucket {bucket}, so it cannot move it")
        keys = self.snapshots.get(bucket)
        if keys is None:               # frozen without tracking: export pages from here
            keys = self.snapshots[bucket] = repo.key_snapshot()
        self.frozen[bucket] = (self.repos.pop(bucket), keys)
        self.frozen_at[bucket] = time.monotonic()
        self.moves["frozen"] += 1
        return len(self.frozen[bucket][0])

    def _end_freeze(self, bucket: int) -> None:
        since = self.frozen_at.pop(bucket, None)
        if since is not None:
            self.moves["frozen_seconds"] += time.monotonic() - since

    def thaw_expired(self) -> list[int]:
        """Thaw the buckets frozen here for longer than FREEZE_LEASE (their
        move was abandoned); returns them."""
        now = time.monotonic()
        expired = [bucket for bucket, since in self.frozen_at.items()
                   if now - since > FREEZE_LEASE]
        for bucket in expired:
            self.thaw(bucket)
        return expired

    def export(self, bucket: int, offset: int, max_bytes: int) -> tuple[list[bytes], int | None]:
        """Step 2 (source): records of a tracked (or frozen) bucket from key
        ``offset`` of its snapshot, as a flat [key, value, ...] list of at
        most ``max_bytes`` (or one record, if that is larger), and the
        offset to ask for next (None: no more).  A key deleted since the
        snapshot is skipped."""
        keys = self.snapshots.get(bucket)
        repo = self.repos.get(bucket) if bucket not in self.frozen else self.frozen[bucket][0]
        if keys is None or repo is None:
            raise StorageFault(f"{self.label}: bucket {bucket} is not being moved from "
                               f"service {self.service_name}")
        page: list[bytes] = []
        size = 0
        position = offset
        while position < len(keys):
            value = repo.get(keys[position])
            if value is not None:
                record_size = len(keys[position]) + len(value)
                if page and size + record_size > max_bytes:
                    break               # a page holds one record at least
                page += (keys[position], value)
                size += record_size
            position += 1
        return page, (position if position < len(keys) else None)

    def thaw(self, bucket: int) -> None:
        """Step 5 (source): serve a frozen bucket again, unchanged, and stop
        tracking it."""
        frozen = self.frozen.pop(bucket, None)
        if frozen is not None:
            self.repos[bucket] = frozen[0]
            self.moves["thawed"] += 1
        self._end_freeze(bucket)
        self.snapshots.pop(bucket, None)
        repo = self.repos.get(bucket)
        if isinstance(repo, TrackedRepository):
            self.repos[bucket] = repo.inner

    def stage(self, bucket: int, records: list[bytes], first: bool) -> int:
        """Step 2 (target): store records of a bucket moving here, not yet
        served; ``first`` starts it afresh.  Returns the records staged."""
        if self.store is None or bucket in self.repos:
            raise StorageFault(f"{self.label}: service {self.service_name} cannot take "
                               f"bucket {bucket} (it stores it already, or the DHT is "
                               f"inactive)")
        if self.medium == "disk" and self.headroom is not None:
            why = self.headroom.refusal(f"bucket {bucket} of {self.label}")
            if why is not None:
                raise StorageFullFault(why)
        if first:
            self.discard(bucket)
            fresh = self.staged[bucket] = self.store.open(bucket, self.bucket_count)
            self.moves["staged"] += 1
            # A disk bucket's file can outlive a move cut short by a crash,
            # or a bucket moved away while this service was down: a staged
            # copy starts empty, whatever the medium holds.
            for key in fresh.key_snapshot():
                fresh.delete(key)
        repo = self.staged.get(bucket)
        if repo is None:
            raise StorageFault(f"{self.label}: service {self.service_name} has no staged "
                               f"bucket {bucket} to add records to (the move was abandoned); "
                               f"start it again")
        self.staged_at[bucket] = time.monotonic()
        # (a value None: deleted since it was sent; durable once adopted)
        repo.apply([(records[index], records[index + 1])
                    for index in range(0, len(records), 2)], durable=False)
        self.moves["records_staged"] += len(records) // 2
        return len(repo)

    def discard(self, bucket: int) -> None:
        """Step 4 (target): drop what was staged for a bucket."""
        self.staged_at.pop(bucket, None)
        if self.staged.pop(bucket, None) is not None and self.store is not None:
            self.store.remove(bucket, self.bucket_count)

    def abandon_moves(self) -> None:
        """Step 5 for every move under way here, as source or target; and a
        regrouping under way is stopped (see "Resizing")."""
        if self._regrouping is not None:
            self._regrouping.close()
        for bucket in {*self.frozen, *self.snapshots}:
            self.thaw(bucket)
        for bucket in list(self.staged):
            self.discard(bucket)

    # ------------------------------------------------------------ resizing
    # A DHT's bucket count doubles or halves (supervisor: resize_dht) while
    # clients read and write.  Bucket b of 2^k buckets is buckets 2b and
    # 2b + 1 of 2^(k+1) (a bucket is the top bits of a key's hash), so a
    # service can serve a finer bucket from a coarser repository: the
    # repository of bucket b holds the records of 2b and 2b + 1.  Hence:
    #   - ``repos`` is keyed by buckets of the DHT's count now, but one
    #     repository (a *part* of the medium, ``part_of``: its (count,
    #     bucket)) may stand for several of them while a resize is under
    #     way: after doubling, each repository stands for its two halves
    #     until ``regroup`` splits it; before halving, ``regroup`` merges
    #     the two halves of each new bucket into one repository that
    #     stands for both, and then the new count is taken.  Single-key
    #     requests (the C hot path too) find the right records either way;
    #     what works on a whole bucket (scans, counts, moves, snapshots)
    #     sees each repository once and filters keys by hash.
    #   - a request says in its header how many buckets its client
    #     numbered them out of (wire.numbering); ``local_bucket`` turns its
    #     bucket into one of this count: a finer one by a shift, a coarser
    #     one (a client that has not heard of a doubling) by the key's hash.
    #   - on the medium a part is named by its count, so a restart in the
    #     middle of a resize finds each record in exactly one complete part:
    #     a split deletes the coarser part only once the finer ones are
    #     complete (and synced, on disk); a merge fills a temporary part and
    #     renames it into place before deleting the halves.  At activation
    #     the coarsest part on the medium covering a bucket holds its
    #     records, and finer ones under it are leftovers (``_open_bucket``).
    def _set_count(self, count: int) -> None:
        self.bucket_count = count
        self.numbering = wire.numbering(count)
        self._shift = bucket_shift(count)

    def bucket_of(self, key: bytes) -> int:
        """A key's bucket among the DHT's buckets now."""
        return self._hash(key) >> self._shift

    def local_bucket(self, numbered: int, bucket: int, key: bytes | None) -> int:
        """The bucket, among this DHT's buckets now, of a request that
        numbers its buckets by ``numbered`` (its header byte 3; 0: the
        DHT's own).  ValueError if it cannot be told: a numbering out of
        range, or a coarser one with no key, or a key not in ``bucket``."""
        if numbered == 0 or numbered == self.numbering:
            return bucket
        if not 1 <= numbered <= MAX_NUMBERING:
            raise ValueError(f"bucket numbering {numbered} is not 1 + log2 of a bucket count")
        if numbered > self.numbering:           # finer: the bucket it is part of
            if key is not None and self._hash(key) >> (65 - numbered) != bucket:
                raise ValueError(f"bucket {bucket} of {wire.numbered_count(numbered)} is not "
                                 f"the bucket of its key")
            return bucket >> (numbered - self.numbering)
        if key is None:
            raise ValueError("a coarser numbering needs the key")
        mine = self.bucket_of(key)
        if mine >> (self.numbering - numbered) != bucket:
            raise ValueError(f"bucket {bucket} of {wire.numbered_count(numbered)} is not the "
                             f"bucket of its key")
        return mine

    def _renumber(self, count: int) -> None:
        """Take a new bucket count (a power of two times the old one):
        each repository stands for the buckets of the new count that it
        holds records of.  Halving needs every group of buckets that
        becomes one to be stored by one repository here (``regroup``
        first), or none of it; StorageFault otherwise, and nothing
        changes."""
        old = self.bucket_count
        if count == old:
            return
        self.abandon_moves()
        repos: dict[int, Repository] = {}
        parts: dict[int, tuple[int, int]] = {}
        if count > old:
            factor = count // old
            for bucket, repo in self.repos.items():
                part = self.part_of.get(bucket, (old, bucket))
                for finer in range(bucket * factor, (bucket + 1) * factor):
                    repos[finer] = repo
                    parts[finer] = part
        else:
            factor = old // count
            for bucket, repo in self.repos.items():
                group = range(bucket - bucket % factor, bucket - bucket % factor + factor)
                if any(self.repos.get(member) is not repo for member in group):
                    raise StorageFault(f"{self.label}: service {self.service_name} cannot take "
                                       f"{count} buckets: buckets {group.start} to "
                                       f"{group.stop - 1} are not merged here")
                repos[bucket // factor] = repo
                parts[bucket // factor] = self.part_of.get(bucket, (old, bucket))
        self.repos.clear()
        self.repos.update(repos)            # (the same dict: the C path holds it)
        self.part_of = parts
        self._set_count(count)
        log.info("service {service}: DHT {dht!r} has {count} buckets now (was {old})",
                 service=self.service_name, dht=self.name, count=count, old=old)

    def _open_bucket(self, bucket: int, on_medium: set[tuple[int, int]]) -> None:
        """Open a bucket stored here: from the coarsest part on the medium
        that covers it (shared with the other buckets it covers), deleting
        finer leftovers under it; else from the finer parts it is made of
        (merged into one); else afresh."""
        assert self.store is not None
        count = self.bucket_count
        for coarse in sorted({c for c, _ in on_medium if c <= count}):
            part = (coarse, bucket // (count // coarse))
            if part not in on_medium:
                continue
            for other, repo in self.repos.items():     # opened for a sibling already
                if self.part_of.get(other) == part:
                    self.repos[bucket] = repo
                    self.part_of[bucket] = part
                    return
            factor = count // coarse
            for finer_count, finer_bucket in sorted(on_medium):
                if finer_count > coarse and finer_bucket // (finer_count // coarse) == part[1]:
                    self.store.discard(finer_bucket, finer_count)   # a split cut short
                    on_medium.discard((finer_count, finer_bucket))
            self.repos[bucket] = self.store.open(part[1], coarse)
            self.part_of[bucket] = part
            if factor > 1:
                log.info("service {service}: DHT {dht!r} bucket {bucket} is in part {part} "
                         "of {coarse} buckets until it is regrouped", service=self.service_name,
                         dht=self.name, bucket=bucket, part=part[1], coarse=coarse)
            return
        finer = sorted((c, b) for c, b in on_medium
                       if c > count and b // (c // count) == bucket)
        repo = self.store.open(bucket, count, temporary=bool(finer))
        if finer:       # halved while this service was away: merge what it has
            for finer_count, finer_bucket in finer:
                source = self.store.open(finer_bucket, finer_count)
                for key, value in list(source.records()):
                    repo.put(key, value)
            repo = self.store.commit(bucket, count)
            for finer_count, finer_bucket in finer:
                self.store.remove(finer_bucket, finer_count)
                on_medium.discard((finer_count, finer_bucket))
        self.repos[bucket] = repo
        self.part_of[bucket] = (count, bucket)

    def shared_buckets(self) -> int:
        """Buckets stored here whose repository is a part of another count
        (a resize not regrouped here yet)."""
        return sum(1 for bucket in self.repos
                   if self.part_of.get(bucket, (self.bucket_count,))[0] != self.bucket_count)

    def bucket_keys(self, bucket: int) -> list[bytes]:
        """The keys of one bucket stored here now (of its part, filtered by
        hash when the part stands for several buckets)."""
        keys = self.repos[bucket].key_snapshot()
        if self.part_of.get(bucket, (self.bucket_count,))[0] == self.bucket_count:
            return keys
        return [key for key in keys if self.bucket_of(key) == bucket]

    def regroup(self, count: int) -> Generator[None, None, dict[str, int]]:
        """Make every repository here a part of ``count`` buckets (the DHT's
        count, to split what a doubling left shared; half of it, to merge
        before halving), while requests are served: a generator to run a
        step per reactor turn (twisted.internet.task.cooperate), which
        returns {"parts", "records"}.  Each group of buckets is regrouped
        live, as a bucket moves: its records are copied page by page while
        its buckets keep serving and their changes are noted, the changes
        caught up round after round, and the last round, the switch to the
        new parts and (disk) their sync happen in one step.  Closing the
        generator (a re-registration, a deactivation) leaves each group as
        it was before its switch.  StorageFault if a group is not wholly
        stored here."""
        # (Inside the try: a regroup refused here is no longer under way.)
        try:
            if count > self.bucket_count or self.bucket_count % count:
                raise StorageFault(f"{self.label}: cannot regroup {self.bucket_count} buckets "
                                   f"into parts of {count}")
            factor = self.bucket_count // count
            groups: dict[tuple[int, int], list[int]] = {}
            for bucket in sorted(self.repos):
                if bucket in self.frozen:
                    continue
                if count < self.bucket_count:
                    groups.setdefault((count, bucket // factor), []).append(bucket)
                elif self.part_of.get(bucket, (count, bucket)) != (count, bucket):
                    groups.setdefault(self.part_of[bucket], []).append(bucket)
            if count < self.bucket_count:
                for (_count, new), members in list(groups.items()):
                    if len(members) != factor:
                        raise StorageFault(f"{self.label}: service {self.service_name} stores "
                                           f"{len(members)} of the {factor} buckets that become "
                                           f"bucket {new} of {count}; they must all be here")
                    if self.part_of.get(members[0]) == (count, new):
                        del groups[(_count, new)]       # merged already
            done = {"parts": 0, "records": 0}
            for part, members in groups.items():
                done["records"] += yield from self._regroup_group(part, members, count)
                done["parts"] += 1
            self.moves["regroups"] += 1
            self.moves["records_regrouped"] += done["records"]
        finally:
            self._regrouping = None
        return done

    def start_regroup(self, count: int) -> Generator[None, None, dict[str, int]]:
        """``regroup(count)``, remembered as the one under way here (so
        that ``abandon_moves`` can stop it)."""
        if self._regrouping is not None:
            raise StorageFault(f"{self.label}: service {self.service_name} is regrouping "
                               f"already")
        if self.store is None:
            raise StorageFault(f"{self.label} is inactive on service {self.service_name}; "
                               f"activate it to regroup its buckets")
        steps = self._regrouping = self.regroup(count)
        return steps

    def _regroup_group(self, part: tuple[int, int], members: list[int],
                       count: int) -> Generator[None, None, int]:
        """One group of ``regroup``: ``members`` (buckets now) into parts of
        ``count``; returns the records copied."""
        assert self.store is not None
        splitting = count == self.bucket_count
        sources = {id(self.repos[bucket]): (self.repos[bucket], self.part_of.get(
            bucket, (self.bucket_count, bucket))) for bucket in members}
        before = {bucket: self.repos[bucket] for bucket in members}
        tracked = {key: TrackedRepository(repo) for key, (repo, _part) in sources.items()}
        if splitting:
            targets = {bucket: self.store.open(bucket, count) for bucket in members}
        else:
            targets = {part[1]: self.store.open(part[1], count, temporary=True)}
        factor = self.bucket_count // count

        def target(key: bytes) -> Repository | None:
            return targets.get(self.bucket_of(key) // factor)

        def copy(records: list[tuple[bytes, bytes | None]]) -> int:
            """Into each target its records (a value None: deleted), one
            transaction per target where the platform has them; durable at
            the switch."""
            by_target: dict[int, list[tuple[bytes, bytes | None]]] = {}
            for key, value in records:
                into = target(key)
                if into is not None:
                    by_target.setdefault(id(into), []).append((key, value))
            for part_records in by_target.values():
                target(part_records[0][0]).apply(part_records, durable=False)  # type: ignore
            return sum(len(part_records) for part_records in by_target.values())

        def apply_changes(changes: list[bytes | None]) -> None:
            copy([(changes[index], changes[index + 1])            # type: ignore[misc]
                  for index in range(0, len(changes), 2)])

        switched = False
        copied = 0
        try:
            for bucket in members:
                self.repos[bucket] = tracked[id(before[bucket])]
            for repo in targets.values():       # leftovers of a regroup cut short
                for key in repo.key_snapshot():
                    repo.delete(key)
            for key_id, wrapper in tracked.items():
                keys = wrapper.key_snapshot()
                source = sources[key_id][0]
                for start in range(0, len(keys), REGROUP_PAGE):
                    page = [(key, source.get(key)) for key in keys[start:start + REGROUP_PAGE]]
                    copied += copy([(key, value) for key, value in page if value is not None])
                    yield None
            for _round in range(REGROUP_ROUNDS):
                changes = [item for wrapper in tracked.values()
                           for item in wrapper.take_changes()]
                apply_changes(changes)
                if len(changes) // 2 <= REGROUP_SETTLED:
                    break
                yield None
            # The switch, in one step: nothing is served meanwhile.
            apply_changes([item for wrapper in tracked.values()
                           for item in wrapper.take_changes()])
            if splitting:
                if self.medium == "disk":       # (the copies, durable before the switch)
                    for repo in targets.values():
                        repo.sync()             # type: ignore[attr-defined]
                new_repos = targets
            else:
                merged = self.store.commit(part[1], count)
                new_repos = {bucket: merged for bucket in members}
            for bucket in members:
                self.repos[bucket] = new_repos[bucket]
                self.part_of[bucket] = (count, bucket) if splitting else (count, part[1])
            switched = True
            for _key, (_repo, (old_count, old_bucket)) in sources.items():
                self.store.remove(old_bucket, old_count)
            return copied
        finally:
            if not switched:
                for bucket, repo in before.items():
                    if self.repos.get(bucket) is not None:
                        self.repos[bucket] = repo
                if splitting:
                    for bucket in targets:
                        self.store.remove(bucket, count)
                else:
                    self.store.remove(part[1], count, temporary=True)

    def storage_service(self, bucket: int) -> str:
        """AS: the service storing a bucket routed here; KeyError if the
        bucket is not routed here."""
        return self.storage_refs.owner(bucket)

    def loss_message(self, bucket: int) -> str:
        return (f"bucket {bucket} of DHT {self.name!r} lost its records with service "
                f"{self.lost.get(bucket, '?')} (every copy was there); `domus dht accept-loss "
                f"{self.name}` (cluster.accept_loss) serves it again, empty")

    def backups_of(self, bucket: int) -> list[str]:
        """The services holding the backups of a bucket (its primary here
        writes to them first), by rank; the missing ones left out."""
        return [holder for copy in self.copies if (holder := copy.get(bucket))]

    def ordered(self) -> bool:
        """Whether every repository here keeps its records in key order, so
        that key ranges can be walked (the platform decides)."""
        return self._platform.ordered and all(repo.ordered for repo in self.repos.values())

    def distinct_repos(self) -> list[Repository]:
        """Each repository stored here once (a part shared by several
        buckets during a resize is one repository)."""
        return list({id(repo): repo for repo in self.repos.values()}.values())

    def records(self) -> int:
        """Records stored here, those of a bucket being moved away included."""
        return (sum(len(repo) for repo in self.distinct_repos())
                + sum(len(repo) for repo, _keys in self.frozen.values()))

    def bucket_records(self, limit: int = 1024) -> dict[int, int]:
        """bucket -> records, for the buckets stored here: every one, or the
        ``limit`` that hold the most (what a heartbeat reports; a part
        shared by several buckets counts for the first of them)."""
        counts: dict[int, int] = {}
        seen: set[int] = set()
        for bucket, repo in sorted(self.repos.items()):
            counts[bucket] = 0 if id(repo) in seen else len(repo)
            seen.add(id(repo))
        if len(counts) > limit:
            counts = dict(sorted(counts.items(), key=lambda item: -item[1])[:limit])
        return counts

    def storage_bytes(self) -> int | None:
        """The bytes the DHT's records occupy here, as its platform counts
        them (Berkeley DB: its databases' pages); None when the platform
        cannot tell, or a bucket's storage fails to; 0 while inactive."""
        if self.store is None:
            return 0
        try:
            return self.store.storage_bytes()
        except StorageFault:
            return None

    def flush(self) -> None:
        """Write buffered records to the medium (disk platforms)."""
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        """Close every repository, keeping what the medium holds (a service
        that stops).  A RAM DHT's records are gone; an inactive one's
        snapshot stays."""
        self._release()

    def destroy(self) -> None:
        """Close every repository and delete its data, snapshot included
        (the DHT is no longer hosted here).  A move or regroup under way
        here stops first."""
        self.abandon_moves()
        store, self.store = self.store, None
        self.repos.clear()
        if store is not None:
            store.destroy()
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)


def routing_graph(descriptor: dict[str, Any]) -> RoutingGraph:
    """The routing graph a DHT's descriptor names (older descriptors have no
    degree: bruijn graphs then have degree 2)."""
    return make_graph(descriptor.get("routing") or "chord", max(descriptor["buckets"], 1),
                      descriptor.get("routing_degree"))


def release_memory() -> None:
    """Hand memory freed by a deactivation back to the operating system:
    glibc keeps freed small blocks in its arenas otherwise, and the point of
    deactivating is a smaller service."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)
