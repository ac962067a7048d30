"""The gateway's link to one mpserve server: an ``AsyncClient`` for requests and STATS, a second one on the
server's admin socket for the operator's calls (/admin/, /slots: CONTROL and SLOT_ACTION, which the clients'
socket refuses; ``mpserve.server.roles``) and for the requests of callers with an API key (each names its key's
tenant, which the broker takes on that socket only), and, when the server runs on this host, its slot table.

The gateway may start before its server, outlive it, and see it restart: nothing here fails for good. The
client connects on first use and tries again on each use until a server answers; the address is looked up
each time (``--connect`` fixes it; otherwise it follows the named local server's ServerInfo, as clients
do; the admin address likewise: ``--admin-connect``, else the local server's). A connected client is kept:
ZeroMQ reconnects it by itself when the server comes back there. The ServerInfo file is read again only when
it was replaced (a server writes a new one: another inode), so a request costs a ``stat``, not a read and a
parse.

A request waits for a server that does not answer as a stream in flight does, up to the ``reattach`` bound (a
server restarting: its supervisor's Restart=always, or the next `mpserve start`), unless the local server was
stopped (``runtime.stopped_here``); so do the broker's answers a request is prepared from (a chat's template, the
ids of its adapters), which are never taken as "none" because the server was away:

    request ──▶ serving() (for_tenant: first) ──▶ _waited(connect) ── ConnectionFailed ──▶ again every RETRY_S
                prepared_stats() ───────────────────┘                     until reattach s, or at once if stopped
    /health, /metrics ──▶ stats(): None at once when no server answers (they report, they do not wait)

A client not connected yet asks first whether anything listens at an ipc address (``runtime.listening``): a server
that died leaves its socket file, and a ping there would wait its whole CONNECT_TIMEOUT_S for nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from mpserve.client import REATTACH_S, AsyncClient
from mpserve.errors import ConnectionFailed
from mpserve.runtime import ServerInfo, default_address, runtime_dir, stopped_here
from mpserve.wire import protocol as wire
from mpserve.wire.protocol import ChatTemplate
from mpserve.wire.slots import SlotRow, SlotTable

log = logging.getLogger("mpserve.gateway")
T = TypeVar("T")

CONNECT_TIMEOUT_S = 2.0
STATS_TIMEOUT_S = 2.0
TEMPLATE_TTL_S = 30.0  # how long a model's chat template is used before the broker is asked again ...
NO_TEMPLATE_TTL_S = 2.0  # ... and how long "none yet" is (an instance may be loading the model)
NO_ADMIN_RETRY_S = 30.0  # how long keyed callers' requests go to the clients' socket once the admin one failed
RETRY_S = 0.1  # how often a request that found no server asks again, within the reattach bound


@dataclass(frozen=True)
class LocalSlots:
    server: ServerInfo
    rows: list[SlotRow]


class Backend:
    def __init__(self, address: str | None, server_name: str, request_timeout: float | None,
                 curve_server_key: str | None = None, curve_secret: str | None = None,
                 admin_address: str | None = None, reattach: float = REATTACH_S) -> None:
        """``address``: a ZeroMQ address, or None for the local server named ``server_name``.
        ``request_timeout``: seconds per request, queueing included (None: no limit). ``curve_*``: key files
        for a server bound to the network, as for ``AsyncClient`` (read now: bad keys stop the start); on the admin
        socket they are used for a tcp address only (an ipc one takes no keys). ``admin_address``: the server's
        admin socket (None: the local server's, from its ServerInfo). ``reattach``: how long the streams in flight
        wait for a server that went silent to come back (``AsyncClient``)."""
        self._address = address
        self._admin_address = admin_address
        self._named: tuple[tuple[int, int] | None, str] | None = None  # (the info file's inode and mtime, address)
        self._info_file = runtime_dir(create=False) / f"{server_name}.json"  # looked at on every request
        self.server_name = server_name
        self._options: dict[str, Any] = {"timeout": request_timeout, "connect_timeout": CONNECT_TIMEOUT_S,
                                         "curve_server_key": curve_server_key, "curve_secret": curve_secret,
                                         "reattach": reattach}
        self._client = AsyncClient(self.address, **self._options)
        self._admin: AsyncClient | None = None
        self._lock = asyncio.Lock()
        self._templates: dict[str, tuple[ChatTemplate, float]] = {}  # model -> its template, when asked
        self._said_no_admin = False  # that keyed callers' requests cannot go to the admin socket
        self._no_admin_until = 0.0  # monotonic: until then they go to the clients' socket without trying it
        self._adapters: dict[str, tuple[dict[str, int], float]] = {}  # model -> its LoRA adapters' ids, when asked
        self.waiting = 0  # requests waiting now for a server to answer (``_waited``)

    @property
    def address(self) -> str:
        return self._address or self._named_address()

    def _named_address(self) -> str:
        """``default_address(server_name)``, looked up again when the server's info file has changed."""
        try:
            st = os.stat(self._info_file)
            seen: tuple[int, int] | None = (st.st_ino, st.st_mtime_ns)
        except OSError:
            seen = None
        if self._named is None or self._named[0] != seen:
            self._named = (seen, default_address(self.server_name))
        return self._named[1]

    async def client(self) -> AsyncClient:
        """A connected client; raises ConnectionFailed while no server answers."""
        async with self._lock:  # one connect at a time: AsyncClient.connect is not re-entrant
            self._client = await self._connected(self._client, self.address)
            return self._client

    async def serving(self) -> AsyncClient:
        """``client()`` for a request: a server that does not answer is waited for, up to the reattach bound."""
        return await self._waited(self.client)

    async def _waited(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, made again every RETRY_S while it raises ConnectionFailed, for up to the reattach bound; at
        once when the local server at our address was stopped (not killed: it is not coming back)."""
        deadline, waiting = time.monotonic() + self._options["reattach"], False
        try:
            while True:
                try:
                    return await call()
                except ConnectionFailed as exc:
                    if time.monotonic() + RETRY_S > deadline or stopped_here(self.address):
                        raise
                    if not waiting:
                        waiting, self.waiting = True, self.waiting + 1
                        if self.waiting == 1:
                            log.info("requests wait up to %g s for a server to answer: %s",
                                     self._options["reattach"], exc)
                await asyncio.sleep(RETRY_S)
        finally:
            self.waiting -= waiting

    async def for_tenant(self, tenant: str) -> tuple[AsyncClient, str]:
        """The client a caller's generate requests go by, and the tenant they name: the default tenant's ("")
        on the clients' socket; a keyed caller's on the admin socket, the one where the broker takes the
        ``tenant`` a request names (it counts, queues and limits per tenant). A server whose admin socket the
        gateway cannot reach (a remote one without ``--admin-connect``) gets them on the clients' socket, as the
        gateway's own, for NO_ADMIN_RETRY_S before it is tried again; said once in the log."""
        if tenant and time.monotonic() >= self._no_admin_until:
            await self.serving()  # a server answers (waited for), so an admin socket that does not is out of reach
            try:
                return await self.admin(), tenant
            except ConnectionFailed as exc:
                self._no_admin_until = time.monotonic() + NO_ADMIN_RETRY_S
                if not self._said_no_admin:
                    self._said_no_admin = True
                    log.warning("requests of API keys go to the server as the gateway's own, one tenant (give the "
                                "gateway --admin-connect to have them counted per key): %s", exc)
        return await self.serving(), ""

    async def admin(self) -> AsyncClient:
        """A connected client on the server's admin socket; raises ConnectionFailed while none answers."""
        async with self._lock:
            address = self._admin_address or self._local_admin()
            self._admin = await self._connected(self._admin, address)
            return self._admin

    def _local_admin(self) -> str:
        info = self.local_server()
        if info is None or not info.admin:
            raise ConnectionFailed(f"operator's calls go to the server's admin socket; no server on this host runs "
                                   f"at {self.address}: give the gateway --admin-connect ADDRESS")
        return info.admin

    async def _connected(self, client: AsyncClient | None, address: str) -> AsyncClient:
        if client is None or client.address != address:  # the named server came back at another address
            if client is not None:
                await client.close()
            options = self._options if address.startswith("tcp://") or client is self._client else {
                **self._options, "curve_server_key": None, "curve_secret": None}
            client = AsyncClient(address, **options)
        if address.startswith("ipc://") and not os.path.exists(address[len("ipc://"):]):
            # stopped (or not started yet): say so at once rather than after a STATS timeout
            raise ConnectionFailed(f"no server is listening at {address}")
        await client.connect()  # at once when connected; ZeroMQ reconnects by itself
        return client

    async def stats(self) -> wire.Stats | None:
        """The broker's counters and queues, or None when the server does not answer."""
        try:
            return await self._stats()
        except ConnectionFailed:
            return None

    async def prepared_stats(self) -> wire.Stats:
        """The broker's STATS a request is prepared from, waited for as the request itself is (``_waited``)."""
        return await self._waited(self._stats)

    async def _stats(self) -> wire.Stats:
        client = await self.client()
        return await client.stats(STATS_TIMEOUT_S)

    async def chat_template(self, model: str) -> ChatTemplate:
        """``model``'s chat template as the broker knows it (empty: none, or the server could not read it before an
        instance loaded the model), asked again once it is TEMPLATE_TTL_S old (a restarted server may serve another
        file), or NO_TEMPLATE_TTL_S when it was empty. Raises ConnectionFailed when no server answers
        (``prepared_stats``): a server away does not mean a model without a template."""
        known = self._templates.get(model)
        if known is not None and time.monotonic() - known[1] < (TEMPLATE_TTL_S if known[0] else NO_TEMPLATE_TTL_S):
            return known[0]
        stats = await self.prepared_stats()
        found = stats.models.get(model)
        chat = ChatTemplate(found.chat_template, found.bos_token, found.eos_token) if found else ChatTemplate()
        self._templates[model] = (chat, time.monotonic())
        return chat

    def forget_templates(self) -> None:
        """Ask the broker for each model's chat template again at its next chat (a reload may have changed one)."""
        self._templates.clear()

    async def adapters(self, model: str, ids: Iterable[object] = ()) -> dict[str, int]:
        """``model``'s LoRA adapters and their ids (a request's ``lora`` ids), asked again once NO_TEMPLATE_TTL_S
        old, or at once for one of ``ids`` not among them: an operator may load or unload one at any time. Raises
        ConnectionFailed when no server answers (``prepared_stats``)."""
        known = self._adapters.get(model)
        if known is not None and time.monotonic() - known[1] < NO_TEMPLATE_TTL_S \
                and all(i in known[0].values() for i in ids):
            return known[0]
        stats = await self.prepared_stats()
        found = stats.models.get(model)
        served = found.served_adapters() if found is not None else {}
        self._adapters[model] = (served, time.monotonic())
        return served

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
            return LocalSlots(info, SlotTable.read_rows(Path(info.slots)))
        except (OSError, ValueError):  # removed between the two reads: the server has just stopped
            return None

    async def close(self) -> None:
        await self._client.close()
        if self._admin is not None:
            await self._admin.close()
