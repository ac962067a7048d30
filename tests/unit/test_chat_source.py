"""Which chat template the broker hands out for a model: a local instance's first, else a remote pool's only if it is
the server's own (``mpserve.server.chat``), driven through the broker's READY handling (no processes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from mpserve.server.broker import Broker
from mpserve.server.chat import Held, Verdict, judge, rolled
from mpserve.wire import protocol as wire
from mpserve.wire.protocol import ChatTemplate

pytestmark = pytest.mark.timeout(10)

OWN = ChatTemplate("{{ messages[0]['content'] }}", "<s>", "</s>")


def test_a_local_instance_sets_the_template_once_and_a_pool_only_matches_it() -> None:
    nothing = Held()
    assert judge(nothing, OWN.template, ChatTemplate(), local=False) is Verdict.SAME  # not loaded: says nothing
    assert judge(nothing, OWN.template, OWN, local=False) is Verdict.TAKE  # the server's own, none known yet
    assert judge(nothing, OWN.template, ChatTemplate("evil"), local=False) is Verdict.DIFFERS
    assert judge(nothing, None, ChatTemplate("evil"), local=False) is Verdict.DIFFERS  # the server has none
    from_pool = Held(OWN)
    other_eos = ChatTemplate(OWN.template, "<s>", "</s> more")
    assert judge(from_pool, OWN.template, other_eos, local=False) is Verdict.DIFFERS
    local = ChatTemplate(OWN.template, "<s>", "<eos>")
    assert judge(from_pool, OWN.template, local, local=True) is Verdict.TAKE  # a local load outranks a pool's
    from_local = Held(local, local=True)
    assert judge(from_local, OWN.template, OWN, local=False) is Verdict.DIFFERS
    assert judge(from_local, OWN.template, ChatTemplate("changed"), local=True) is Verdict.DIFFERS  # logged, kept
    assert judge(from_local, OWN.template, local, local=True) is Verdict.SAME


@pytest.fixture
def broker() -> Iterator[Broker]:
    ctx = zmq.Context()
    broker = Broker(ctx, "inproc://front", "inproc://back", {"m": 8}, chat_templates={"m": OWN.template})
    yield broker
    broker.front.close(0)
    broker.back.close(0)
    ctx.term()


def ready(name: str, chat: ChatTemplate, pid: int = 1, **kw: object) -> wire.Ready:
    return wire.Ready(name, "m", -1, 1, pid, chat_template=chat.template, bos_token=chat.bos_token,
                      eos_token=chat.eos_token, **kw)  # type: ignore[arg-type]


@pytest.fixture
def links(broker: Broker) -> Iterator[None]:
    """Connections under the remote workers' names, so that the broker can answer their READY."""
    socks = []
    for name in (b"evil-1-w0", b"pool-1-w0", b"pool-2-w0"):
        sock = broker.back.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, name)
        sock.connect("inproc://back")
        socks.append(sock)
    yield
    for sock in socks:
        sock.close(0)


@pytest.mark.usefixtures("links")
def test_the_broker_hands_out_the_servers_template_whatever_pools_say(broker: Broker) -> None:
    broker.registry.register(b"evil-1-w0", ready("evil-1-w0", ChatTemplate("{{ 'obey' }}"), host="evil"), None)
    assert b"evil-1-w0" not in broker.tables.workers and not broker.snapshot().models["m"].chat_template
    broker.registry.register(b"pool-1-w0", ready("pool-1-w0", OWN, host="pool"), None)
    assert b"pool-1-w0" in broker.tables.workers and broker.snapshot().models["m"].chat_template == OWN.template
    other_eos = ready("pool-2-w0", ChatTemplate(OWN.template, "", "obey"), host="pool")
    broker.registry.register(b"pool-2-w0", other_eos, None)
    assert b"pool-2-w0" not in broker.tables.workers and broker.tables.stats["refused_worker_ready"] == 2
    local = ChatTemplate(OWN.template, "<bos>", "<eos>")
    broker.registry.register(b"w0", ready("w0", local, proof=broker.link_secret), None)
    assert broker.snapshot().models["m"].eos_token == "<eos>"  # the first local load's
    on_demand = ready("pool-1-w0", ChatTemplate("{{ 'obey' }}"), host="pool")
    broker.registry.register(b"pool-1-w0", on_demand, None)
    broker.registry.register(b"w0", ready("w0", ChatTemplate("changed on disk"), proof=broker.link_secret), None)
    held = broker.snapshot().models["m"]
    assert (held.chat_template, held.eos_token) == (OWN.template, "<eos>")
    assert broker.tables.stats["chat_template_differs"] == 2


def test_a_reload_that_changes_the_template_hands_out_the_new_one_at_once_and_keeps_it() -> None:
    """Rolled onto settings whose template is NEW: handed out at once with the BOS and EOS held so far; the first new
    instance's READY gives its own texts, an old instance's template is not taken back once a new one is held."""
    new = ChatTemplate("{{ 'new' }}", "<s>", "<eos2>")
    held = rolled(Held(OWN, local=True), new.template)
    assert held == Held(ChatTemplate(new.template, OWN.bos_token, OWN.eos_token), local=False)
    assert rolled(Held(OWN, local=True), None) == Held(OWN)  # the server cannot tell: the first new READY says
    assert judge(held, new.template, new, local=True) is Verdict.TAKE
    from_new = Held(new, local=True)
    assert judge(from_new, new.template, OWN, local=True) is Verdict.DIFFERS  # an old instance: logged, not taken
    assert judge(Held(OWN, local=True), new.template, new, local=True) is Verdict.TAKE  # the reload's, over the old
