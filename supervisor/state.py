"""What the supervisor knows, and how it survives a restart.

The state (services registered, DHTs with their attributes and bucket
assignments, the next DHT id) lives in one JSON file in the data dir.  Every
change is written to a temporary file, flushed to disk, and renamed over the
old one, so the file on disk is always either the old state or the new one,
never a mix.  DHT ids are never reused, so a message for a destroyed DHT can
never reach a new DHT that took its place.

The deployment's id is made at the first start and kept; each DHT carries
its ``deployment`` and ``stamp`` (domus.wire.identities), given to DHTs of
an older state file when it is loaded.  The stamps of destroyed DHTs are
kept (``destroyed``, the newest MAX_DESTROYED), so that a service that
comes back still holding one is told to drop it by name.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from domus.wire import identities

STATE_FILE = "supervisor.json"
FORMAT = 1
MAX_DESTROYED = 10_000


class SupervisorState:
    def __init__(self, data_dir: str) -> None:
        self.data_dir = data_dir
        self.path = os.path.join(data_dir, STATE_FILE)
        self.services: dict[str, dict[str, Any]] = {}
        self.dhts: dict[str, dict[str, Any]] = {}
        self.next_dht_id = 1
        self.created = time.time()
        # How to start this supervisor again (domus.ops.launch); services'
        # launch records are in their entries of ``services``.
        self.launch: dict[str, Any] = {}
        self.deployment = identities.new()
        # stamp -> {"name", "id", "destroyed"}: DHTs destroyed, newest last
        self.destroyed: dict[str, dict[str, Any]] = {}
        os.makedirs(data_dir, exist_ok=True)
        if os.path.exists(self.path):
            self._load()

    def _load(self) -> None:
        with open(self.path, encoding="utf-8") as source:
            saved = json.load(source)
        if saved.get("format") != FORMAT:
            raise RuntimeError(f"{self.path} has format {saved.get('format')!r}; this "
                               f"supervisor reads format {FORMAT}")
        self.services = saved["services"]
        self.dhts = saved["dhts"]
        self.next_dht_id = saved["next_dht_id"]
        self.created = saved.get("created", self.created)
        self.launch = saved.get("launch", {})
        self.deployment = saved.get("deployment") or self.deployment
        self.destroyed = saved.get("destroyed", {})

    def stamp_all(self) -> bool:
        """Give each DHT without them (a state file of an older Domus) this
        deployment's id and a stamp; whether any changed."""
        changed = False
        for descriptor in self.dhts.values():
            if not descriptor.get("stamp"):
                descriptor.update(deployment=self.deployment, stamp=identities.new())
                changed = True
        return changed

    def forget(self, descriptor: dict[str, Any]) -> None:
        """Keep the stamp of a DHT that is destroyed (or never was)."""
        stamp = descriptor.get("stamp")
        if stamp:
            self.destroyed[stamp] = {"name": descriptor["name"], "id": descriptor["id"],
                                     "destroyed": time.time()}
            while len(self.destroyed) > MAX_DESTROYED:
                del self.destroyed[next(iter(self.destroyed))]

    def save(self) -> None:
        snapshot = {"format": FORMAT, "created": self.created, "next_dht_id": self.next_dht_id,
                    "services": self.services, "dhts": self.dhts, "launch": self.launch,
                    "deployment": self.deployment, "destroyed": self.destroyed}
        temporary = self.path + ".tmp"
        with open(temporary, "w", encoding="utf-8") as target:
            json.dump(snapshot, target, indent=1, sort_keys=True)
            target.flush()
            os.fsync(target.fileno())
        os.replace(temporary, self.path)
        directory = os.open(self.data_dir, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def allocate_dht_id(self) -> int:
        dht_id = self.next_dht_id
        self.next_dht_id += 1
        return dht_id
