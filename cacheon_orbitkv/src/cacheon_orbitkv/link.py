"""An engine process's connection to its cache manager: made on first use, re-made after it is lost.

Engine adapters (the vLLM connector, the SGLang linker) never fail a request because the manager
is away: while ``get()`` answers None a lookup is a miss and a save is skipped. A call that raises
``ManagerUnavailable`` (the manager died, or a call outlived ``timeout``: a hung manager) drops the
connection; the next ``get()`` at least ``retry_s`` later connects again, so a restarted manager is
found without restarting the engine. A new connection maps the new manager's arena (registered
with CUDA when ``device`` is a CUDA device).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from .client import CacheClient
from .transfer import Arena
from .wire import ManagerUnavailable, OrbitKVError

RETRY_S = 5.0  # at most one connection attempt per this many seconds while the manager is away
CALL_TIMEOUT_S = 30.0  # a hung manager stalls one call this long


class ManagerLink:
    def __init__(
        self,
        endpoint: str,
        name: str,
        device: str = "cpu",
        timeout: float | None = CALL_TIMEOUT_S,
        retry_s: float | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        self.device = device
        self.timeout = timeout
        self.retry_s = RETRY_S if retry_s is None else retry_s
        self.log = log or logging.getLogger("cacheon.orbitkv")
        self._lock = threading.Lock()
        self._client: CacheClient | None = None
        self._arena: Arena | None = None
        self._next_attempt = 0.0
        self.attempts = 0
        self.connects = 0

    def get(self) -> tuple[CacheClient, Arena] | None:
        """The client and its mapped arena, or None while the manager is unreachable."""
        with self._lock:
            if self._client is not None and self._arena is not None:
                return self._client, self._arena
            if time.monotonic() < self._next_attempt:
                return None
            self.attempts += 1
            try:
                client = CacheClient(self.endpoint, name=self.name, timeout=self.timeout)
            except OrbitKVError as exc:
                self._next_attempt = time.monotonic() + self.retry_s
                self.log.warning("orbitkv: cache manager unreachable, serving without it for now: %s", exc)
                return None
            self._client, self._arena = client, Arena(client.arena, device=self.device)
            self.connects += 1
            return self._client, self._arena

    def current(self) -> CacheClient | None:
        """The connected client, without connecting (releasing a lease needs the same connection)."""
        with self._lock:
            return self._client

    def failed(self, exc: OrbitKVError) -> None:
        """Log a failed manager call; a lost connection is dropped and re-made later."""
        if not isinstance(exc, ManagerUnavailable):
            self.log.warning("orbitkv: %s", exc)
            return
        self.log.warning("orbitkv: lost the cache manager (%s); reconnecting later", exc)
        with self._lock:
            self._next_attempt = time.monotonic() + self.retry_s
            self._drop()

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        client, arena = self._client, self._arena
        self._client, self._arena = None, None
        # Leases and reservations die with the manager's session; a copy still holding a view of
        # the old mapping keeps it alive (the close then refuses), so nothing is unmapped under it.
        with contextlib.suppress(BufferError):
            if arena is not None:
                arena.close()
            if client is not None:
                client.close()
