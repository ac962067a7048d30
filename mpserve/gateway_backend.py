"""The gateway's link to one mpserve server: an ``AsyncClient`` for requests and STATS, and, when the server
runs on this host, its slot table.

The gateway may start before its server, outlive it, and see it restart: nothing here fails for good. The
client is made on first use and again after a failed connect, and the address is looked up again each
time (``--connect`` fixes it; otherwise it follows the named local server's ServerInfo, as clients do).
A connected client is kept: ZeroMQ reconnects it by itself when the server comes back at that address.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

from . import protocol as wire
from .client import AsyncClient
from .errors import ConnectionFailed
from .runtime import ServerInfo, default_address
from .slots import SlotRow, SlotTable

CONNECT_TIMEOUT_S = 2.0
STATS_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class LocalSlots:
    server: ServerInfo
    rows: list[SlotRow]


class Backend:
    def __init__(self, address: str | None, server_name: str, request_timeout: float | None) -> None:
        """``address``: a ZeroMQ address, or None for the local server named ``server_name``.
        ``request_timeout``: seconds per request, queueing included (None: no limit)."""
        self._address = address
        self.server_name = server_name
        self._request_timeout = request_timeout
        self._client: AsyncClient | None = None
        self._lock = asyncio.Lock()

    @property
    def address(self) -> str:
        return self._address or default_address(self.server_name)

    async def client(self) -> AsyncClient:
        """A connected client; raises ConnectionFailed while no server answers."""
        async with self._lock:
            address = self.address
            if address.startswith("ipc://") and not os.path.exists(address[len("ipc://"):]):
                # stopped (or not started yet): say so at once rather than after a STATS timeout
                raise ConnectionFailed(f"no server is listening at {address}")
            if self._client is not None and self._client.address != address:
                await self._client.close()  # the named server came back at another address
                self._client = None
            if self._client is None:
                client = AsyncClient(address, timeout=self._request_timeout, connect_timeout=CONNECT_TIMEOUT_S)
                await client.connect()
                self._client = client
            return self._client

    async def stats(self) -> wire.Stats | None:
        """The broker's counters and queues, or None when the server does not answer."""
        try:
            client = await self.client()
            return await client.stats(STATS_TIMEOUT_S)
        except ConnectionFailed:
            return None

    def local_server(self) -> ServerInfo | None:
        """The running server on this host at our address, if it is one; only such a server has a slot
        table (and processes) the gateway can read."""
        info = ServerInfo.read(self.server_name)
        if info is None or not info.alive() or info.front != self.address:
            return None
        return info

    def read_slots(self) -> LocalSlots | None:
        """The slot table of the local server, read now; None for a remote or stopped server."""
        info = self.local_server()
        if info is None:
            return None
        try:
            table = SlotTable.attach(Path(info.slots), writable=False)
        except (OSError, ValueError):  # removed between the two reads: the server has just stopped
            return None
        try:
            return LocalSlots(info, table.read_all())
        finally:
            table.close()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
