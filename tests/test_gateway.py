"""The HTTP gateway end to end: the official ``openai`` client and httpx against the gateway (uvicorn in a
thread of the test process, on a free port), in front of real servers running the tiny model."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import ServerProcess
from gateway_thread import GatewayThread
from helpers import caught_mid_request, mpserve, ppid, server_idle, wait_for

from mpserve import Client
from mpserve.gateway.api.openai import CHAT_STOP, COMPLETION_MAX_TOKENS, OPENAI_DEFAULTS, Message, chat_prompt, parse
from mpserve.models.maker import write_model
from mpserve.wire.protocol import GenerateParams
from mpserve.wire.slots import SlotState

PROMPTS = ["Hello world", "The quick brown fox"]


@pytest.fixture(scope="module")
def single_server() -> Iterator[ServerProcess]:
    """One instance, a queue of one, and room for very long requests (the tiny model slows down as its
    context fills: 8000 tokens take seconds, so such a request is still running when a test cancels it)."""
    server = ServerProcess("--instances", "1", "--max-queue", "1", "--n-ctx", "8192").wait_ready()
    yield server
    server.stop()


@pytest.fixture
def single_gateway(single_server: ServerProcess) -> Iterator[GatewayThread]:
    gw = GatewayThread(server_name=single_server.name)
    yield gw
    gw.stop()


def _after_first_event(response: httpx.Response) -> Iterator[str]:
    """Read up to the first server-sent event; return the line iterator, which the caller must keep: a
    discarded one is closed, and closing it closes the connection."""
    lines = response.iter_lines()
    next(line for line in lines if line.startswith("data:"))
    return lines


@pytest.mark.timeout(60)
def test_openai_client_completions_equal_the_zeromq_client(tiny_server, gateway) -> None:
    oc = gateway.openai()
    with Client(tiny_server.address) as zc:
        for prompt in PROMPTS:
            expected = zc.generate(prompt, max_tokens=24, temperature=0, seed=1)
            whole = oc.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, seed=1)
            assert whole.object == "text_completion" and whole.model == "tiny"
            assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == "length"
            assert whole.usage is not None
            assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
                expected.usage.prompt_tokens, 24, expected.usage.prompt_tokens + 24)

            chunks = list(oc.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
            assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
            assert chunks[-2].choices[0].finish_reason == "length"
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
            timings = chunks[-1].model_extra["timings"]  # mpserve's, beside the usage
            assert timings["attempts"] == 1 and timings["generate_ms"] > 0

        stop = expected.text[6:8]
        stopped = oc.completions.create(model="tiny", prompt=PROMPTS[-1], max_tokens=24, temperature=0, stop=stop)
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].text == zc.generate(PROMPTS[-1], max_tokens=24, temperature=0, stop=[stop]).text


@pytest.mark.timeout(60)
def test_openai_client_chat_equals_the_zeromq_client_with_the_default_template(tiny_server, gateway) -> None:
    oc = gateway.openai()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    prompt = chat_prompt(tuple(Message(**m) for m in messages))
    assert prompt == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay hello.<|im_end|>\n"
                      "<|im_start|>assistant\n")
    with Client(tiny_server.address) as zc:
        expected = zc.generate(prompt, max_tokens=20, temperature=0, stop=[CHAT_STOP])
    whole = oc.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == expected.text
    assert whole.usage.prompt_tokens == expected.usage.prompt_tokens and whole.usage.completion_tokens == 20

    chunks = list(oc.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=20,
                                             temperature=0, stream=True))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_http_requests_default_to_openai_sampling_and_zeromq_ones_to_llama_cpp_s() -> None:
    http = parse("completion", {"prompt": "Hi", "seed": 7}).params
    assert http == GenerateParams(max_tokens=COMPLETION_MAX_TOKENS, temperature=1.0, top_p=1.0, top_k=0, seed=7,
                                  repeat_penalty=1.0)
    assert parse("chat", {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0.5, "top_k": 9,
                          "repeat_penalty": 1.1}).params == GenerateParams(temperature=0.5, top_p=1.0, top_k=9,
                                                                          repeat_penalty=1.1)
    zeromq = GenerateParams.from_wire({})
    assert (zeromq.temperature, zeromq.top_p, zeromq.top_k, zeromq.repeat_penalty) == (0.8, 0.95, 40, 1.0)


@pytest.mark.timeout(60)
def test_a_request_without_sampling_parameters_samples_as_openai_defaults_say(tiny_server, gateway) -> None:
    oc = gateway.openai()
    with Client(tiny_server.address) as zc:
        as_openai = zc.generate(PROMPTS[0], max_tokens=24, seed=3, **OPENAI_DEFAULTS)
        llama_cpp_defaults = zc.generate(PROMPTS[0], max_tokens=24, seed=3)
    http = oc.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, seed=3)
    assert http.choices[0].text == as_openai.text != llama_cpp_defaults.text


TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}\n{% endfor %}"
            "{% if messages[0].role == 'developer' %}{{ raise_exception('no developer messages') }}{% endif %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.mark.timeout(90)
def test_chat_is_formatted_with_the_model_s_own_template(start_server, tmp_path) -> None:
    model = write_model(tmp_path / "templated.gguf", "tiny", chat_template=TEMPLATE)
    server = start_server("--model", str(model)).wait_ready()
    gw = GatewayThread(server_name=server.name)
    try:
        with Client(server.address) as zc:
            (stats,) = zc.stats().models.values()
            assert stats.chat_template == TEMPLATE and (stats.bos_token, stats.eos_token) == ("<s>", "</s>")
            # BOS is the engine's to add (it always does), so the template's bos_token renders empty
            prompt = "[system] Be terse.</s>\n[user] Say hello.</s>\n[assistant] "
            expected = zc.generate(prompt, max_tokens=12, temperature=0)
        messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say hello."}]
        whole = gw.openai().chat.completions.create(model="templated", messages=messages, max_tokens=12,
                                                    temperature=0)
        assert whole.choices[0].message.content == expected.text
        assert whole.usage.prompt_tokens == expected.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError, match="refused the messages: no developer messages"):
            gw.openai().chat.completions.create(model="templated", messages=[{"role": "developer", "content": "x"}])
    finally:
        gw.stop()


@pytest.mark.timeout(90)
def test_a_model_not_loaded_yet_is_chatted_with_its_own_template_read_from_its_gguf(start_server, tmp_path) -> None:
    """Before any instance has loaded the model (on demand here; a server starting, or started again, alike) the
    broker hands out the template it serves it with and the EOS text the template uses, read from the GGUF: the
    first chat is rendered as the later ones are, not from the ChatML default."""
    model = write_model(tmp_path / "templated.gguf", "tiny", chat_template=TEMPLATE)
    server = start_server("--model", str(model), "--single-active-backend").wait_ready()
    messages = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Say more."}]  # an assistant turn: the template writes its EOS

    def chat() -> tuple[str | None, int]:
        gw = GatewayThread(server_name=server.name)  # one of its own: no template kept from before
        try:
            answer = gw.openai().chat.completions.create(model="templated", messages=messages, max_tokens=8,
                                                         temperature=0)
        finally:
            gw.stop()
        assert answer.usage is not None
        return answer.choices[0].message.content, answer.usage.prompt_tokens

    with Client(server.address) as zc:
        before = zc.stats().models["templated"]
        assert (before.chat_template, before.bos_token, before.eos_token) == (TEMPLATE, "", "</s>")  # no load yet
        first = chat()  # loads the model
        after = zc.stats().models["templated"]
        assert (after.chat_template, after.bos_token, after.eos_token) == (TEMPLATE, "<s>", "</s>")  # the instance's
    assert chat() == first


@pytest.mark.timeout(60)
def test_refusals_come_in_openai_error_shape_with_fitting_statuses(gateway) -> None:
    oc = gateway.openai()
    with pytest.raises(openai.BadRequestError, match="'best_of' must be an integer from n") as err:
        oc.completions.create(model="tiny", prompt="hi", n=3, best_of=2)
    assert err.value.code == "bad_request" and err.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="insertion"):
        oc.completions.create(model="tiny", prompt="hi", suffix="!")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        oc.completions.create(model="tiny", prompt="hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError, match="served models: tiny") as missing:
        oc.completions.create(model="nope", prompt="hi", stream=True)
    assert missing.value.code == "unknown_model"
    assert [m.id for m in oc.models.list()] == ["tiny"]
    bad_json = httpx.post(f"{gateway.url}/v1/completions", content=b"{not json",
                          headers={"Content-Type": "application/json"}, timeout=10)
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    untyped = httpx.post(f"{gateway.url}/v1/completions", content=b'{"prompt": "hi"}', timeout=10)
    assert untyped.status_code == 415 and untyped.json()["error"]["code"] == "unsupported_media_type"
    unknown = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "hi", "mirostatt": 2}, timeout=10)
    assert unknown.status_code == 400 and "mirostatt" in unknown.json()["error"]["message"]
    nowhere = gateway.get("/v1/images/generations")
    assert nowhere.status_code == 404 and nowhere.json()["error"]["code"] == "not_found"


@pytest.mark.timeout(60)
def test_metrics_count_the_requests_sent(gateway) -> None:
    oc = gateway.openai()
    before = gateway.metrics()
    for stream in (False, False, True):
        list(oc.completions.create(model="tiny", prompt="hi", max_tokens=5, temperature=0, stream=True)) if stream \
            else oc.completions.create(model="tiny", prompt="hi", max_tokens=5, temperature=0)
    with pytest.raises(openai.NotFoundError):
        oc.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        oc.completions.create(model="tiny", prompt="hi", best_of=3)
    after = gateway.metrics()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    endpoint = "/v1/completions"
    assert delta("mpserve_http_requests_total", endpoint=endpoint, code="ok") == 3
    assert delta("mpserve_http_requests_total", endpoint=endpoint, code="unknown_model") == 1
    assert delta("mpserve_http_requests_total", endpoint=endpoint, code="bad_request") == 1
    assert delta("mpserve_broker_events_total", event="accepted") == 3
    assert delta("mpserve_broker_events_total", event="done") == 3
    assert delta("mpserve_broker_events_total", event="rejected_unknown_model") == 1
    assert delta("mpserve_generated_tokens_total", model="tiny") == 15
    assert delta("mpserve_time_to_first_token_seconds_count", model="tiny") == 3
    assert delta("mpserve_request_latency_seconds_count", model="tiny") == 3
    assert delta("mpserve_request_latency_seconds_bucket", model="tiny", le="+Inf") == 3
    assert after["mpserve_up", ()] == 1 and after["mpserve_accepting", ()] == 1
    assert after["mpserve_queue_depth", (("model", "tiny"),)] == 0
    assert after["mpserve_requests_in_flight", (("model", "tiny"),)] == 0
    assert after["mpserve_instances", (("model", "tiny"), ("state", "idle"))] == 2
    assert after["mpserve_worker_restarts_total", (("model", "tiny"),)] == 0
    cells = {labels: value for (name, labels), value in after.items() if name == "mpserve_kv_cells_used"}
    ratios = {labels: value for (name, labels), value in after.items() if name == "mpserve_kv_usage_ratio"}
    assert len(cells) == 2 and cells.keys() == ratios.keys() and sum(cells.values()) > 0
    assert all(0 <= ratios[labels] < 1 and (ratios[labels] > 0) == (cells[labels] > 0) for labels in cells)
    # the host store as each instance sees it: on by default, no disk tier, these short prompts neither hit nor
    # miss; under its names and, for one release, its former ones (docs/operations.md)
    for labels, store in itertools.product(cells, ("mpserve_host_store_", "mpserve_prompt_cache_")):
        assert after[f"{store}capacity_bytes", labels] == 256 << 20
        assert 0 <= after[f"{store}bytes", labels] <= 256 << 20  # the host's (other tests' entries)
        assert after[f"{store}disk_capacity_bytes", labels] == 0
        assert after[f"{store}disk_bytes", labels] == 0
        for counter in ("hits", "misses", "evictions", "skipped"):
            assert after[f"{store}{counter}_total", labels] == 0


@pytest.mark.timeout(60)
def test_health_follows_the_server_from_start_to_shutdown(start_server) -> None:
    name = "gw-health"
    gw = GatewayThread(server_name=name)  # before the server exists
    try:
        early = gw.get("/health")
        assert early.status_code == 503 and early.json()["status"] == "unavailable"
        assert gw.get("/metrics").text.count("mpserve_up 0.0") == 1

        server = start_server("--instances", "1", "--n-ctx", "8192", name=name).wait_ready()
        running = wait_for(lambda: (r := gw.get("/health")).status_code == 200 and r, 10, "a healthy server")
        assert running.json()["models"]["tiny"] | {"failed": None} == {
            "ready": 1, "busy": 0, "unloaded": 0, "loading": 0, "down": 0, "ready_slots": 1, "busy_slots": 0,
            "queued": 0, "running": 0, "failed": None, "on_demand": False}

        with httpx.Client(timeout=30) as http, http.stream("POST", f"{gw.url}/v1/completions", json={
                "model": "tiny", "prompt": "x", "max_tokens": 8000, "temperature": 0, "stream": True}) as stream:
            lines = _after_first_event(stream)
            assert gw.get("/health").json()["models"]["tiny"]["busy"] == 1
            server.proc.send_signal(signal.SIGTERM)  # drains: the stream keeps the server up
            draining = wait_for(lambda: (r := gw.get("/health")).status_code == 503 and r, 5, "a draining server")
            assert draining.json()["accepting"] is False and "shutting down" in draining.json()["reason"]
            assert next(line for line in lines if line.startswith("data:"))  # still streaming while draining
            refused = httpx.post(f"{gw.url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            assert int(refused.headers["Retry-After"]) >= 1
        # leaving the stream cancelled the last request: the server ends its grace period at once
        assert server.proc.wait(10) == 0
        gone = gw.get("/health")
        assert gone.status_code == 503 and "no mpserve server answers" in gone.json()["reason"]
    finally:
        gw.stop()


@pytest.mark.timeout(60)
def test_monitor_reports_each_instance_and_a_killed_worker_shows_everywhere(start_server) -> None:
    server = start_server("--instances", "2").wait_ready()
    gw = GatewayThread(server_name=server.name)
    try:
        oc = gw.openai()
        oc.completions.create(model="tiny", prompt="hi", max_tokens=3)
        body = gw.get("/backend/monitor", params={"model": "tiny"}).json()
        rows = server.slots()
        assert [i["pid"] for i in body["instances"]] == [r.pid for r in rows]
        for inst in body["instances"]:
            assert inst["state"] == "idle" and inst["device"] == "cpu" and inst["model"] == "tiny"
            assert 0 < inst["pss_bytes"] <= inst["rss_bytes"] and inst["uptime_s"] > 0
            assert inst["kv_capacity"] == 2048 and inst["prompt_cache_capacity"] == 256 << 20
            assert 0 <= inst["prompt_cache_bytes"] <= 256 << 20 and inst["prompt_cache_disk_capacity"] == 0
            assert inst["prompt_cache_hits"] == inst["prompt_cache_skipped"] == 0
        assert sum(i["requests_served"] for i in body["instances"]) == 1
        assert sorted(i["kv_cells"] > 0 for i in body["instances"]) == [False, True]
        assert body["pss_bytes"] == sum(i["pss_bytes"] for i in body["instances"])
        assert gw.get("/backend/monitor", params={"model": "nope"}).status_code == 404

        # the worker serving a stream dies: the stream continues on the other instance, /health and metrics
        # see the death. Its replacement would be forked and loaded within tens of milliseconds: the zygote it
        # is forked from is stopped meanwhile, so that /health is read while the instance is down.
        streams = 0  # the completions sent
        with Client(server.address) as observer:
            for _ in range(5):  # again where the stream ended before its instance was caught running it
                stream = iter(oc.completions.create(model="tiny", prompt="x", max_tokens=1500, temperature=0,
                                                    stream=True))
                streams += 1
                next(stream)
                if (busy := caught_mid_request(server.slots, None, lambda: server_idle(observer))) is not None:
                    break  # its instance stopped: the stream cannot end before the kill
                list(stream)
            else:
                pytest.fail("in each of 5 runs the stream ended before its instance was caught running it")
        zygote = ppid(busy.pid)
        os.kill(zygote, signal.SIGSTOP)
        try:
            os.kill(busy.pid, signal.SIGKILL)
            hurt = wait_for(lambda: (h := gw.get("/health")).json()["models"]["tiny"]["ready"] == 1 and h, 10,
                            "/health to show the death")
            assert hurt.status_code == 200 and hurt.json()["status"] == "ok"  # one instance serves
            tiny = hurt.json()["models"]["tiny"]
            assert (tiny["ready"], tiny["down"], tiny["loading"]) in {(1, 1, 0), (1, 0, 1)}, tiny
            assert list(stream)[-1].choices[0].finish_reason == "length"
        finally:
            os.kill(zygote, signal.SIGCONT)
        wait_for(lambda: gw.get("/health").json()["models"]["tiny"]["ready"] == 2, 20, "the restarted worker")
        after = gw.get("/backend/monitor").json()["instances"]
        assert after[busy.index]["pid"] not in (0, busy.pid) and after[busy.index]["state"] == "idle"
        wait_for(lambda: gw.metrics()["mpserve_worker_restarts_total", (("model", "tiny"),)] == 1, 2,
                  "the restart to be counted")
        assert gw.metrics()["mpserve_http_requests_total", (("code", "ok"), ("endpoint", "/v1/completions"))] == \
            1 + streams
    finally:
        gw.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_disconnects_has_its_request_cancelled_and_the_instance_freed(single_server, single_gateway,
                                                                                    stream: bool) -> None:
    """The gateway sends the broker a CANCEL for the request of a client that went away (counted there), and the
    instance is free again long before the request's end; no time is asserted."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 8000, "temperature": 0, "stream": stream}
    with Client(single_server.address) as observer:
        cancelled = observer.stats().counters.get("cancelled", 0)
    with httpx.Client(timeout=30) as http:
        if stream:
            with http.stream("POST", f"{single_gateway.url}/v1/completions", json=body) as response:
                lines = _after_first_event(response)
                assert next(line for line in lines if line.startswith("data:"))
                assert single_server.slots()[0].state is SlotState.BUSY
        else:  # not streamed: the client gives up waiting (the slot is watched meanwhile: once the client
            # is gone the gateway may cancel before this thread could look)
            busy = threading.Event()
            watcher = threading.Thread(target=lambda: wait_for(
                lambda: single_server.slots()[0].state is SlotState.BUSY, 5, "a busy instance") and busy.set())
            watcher.start()
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{single_gateway.url}/v1/completions", json=body, timeout=1.0)
            watcher.join()
            assert busy.is_set()
    row = wait_for(lambda: (r := single_server.slots()[0]).state is SlotState.IDLE and r, 30, "an idle instance")
    assert row.tokens < 8000
    with Client(single_server.address) as observer:
        assert observer.stats().counters.get("cancelled", 0) == cancelled + 1, "the gateway sent no CANCEL"
    codes = single_gateway.metrics()
    assert codes["mpserve_http_requests_total", (("code", "cancelled"), ("endpoint", "/v1/completions"))] == 1


@pytest.mark.timeout(60)
def test_a_full_queue_answers_429_with_retry_after(single_gateway) -> None:
    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as http:
            return await asyncio.gather(*(http.post(f"{single_gateway.url}/v1/completions", json={
                "model": "tiny", "prompt": "a", "max_tokens": 200, "temperature": 0}) for _ in range(4)))

    responses = asyncio.run(main())
    assert sorted(r.status_code for r in responses) == [200, 200, 429, 429]
    for busy in (r for r in responses if r.status_code == 429):
        assert busy.json()["error"]["code"] == "busy" and busy.json()["error"]["type"] == "rate_limit_error"
        assert int(busy.headers["Retry-After"]) >= 1


@pytest.mark.timeout(60)
def test_an_api_key_is_required_when_set(tiny_server) -> None:
    gw = GatewayThread(server_name=tiny_server.name, api_key="sekret")
    try:
        with pytest.raises(openai.AuthenticationError) as err:
            gw.openai(api_key="wrong").completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
        assert gw.get("/metrics").status_code == 401 and gw.get("/v1/models").status_code == 401
        ok = gw.openai(api_key="sekret").completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert ok.usage.completion_tokens == 2
        assert gw.get("/health").status_code == 200  # probes need no key
    finally:
        gw.stop()


@pytest.mark.timeout(60)
def test_a_request_past_its_timeout_is_a_504(single_server) -> None:
    gw = GatewayThread(server_name=single_server.name, request_timeout=0.5)
    try:
        late = httpx.post(f"{gw.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 8000},
                          timeout=10)
        assert late.status_code == 504 and late.json()["error"]["code"] == "timeout"
        wait_for(lambda: single_server.slots()[0].state is SlotState.IDLE, 5, "an idle instance")
    finally:
        gw.stop()


@pytest.mark.timeout(60)
def test_slots_save_restore_and_erase_over_http_take_the_admin_key_only(start_server, tmp_path) -> None:
    """A slot holds any tenant's cells: an inference key may not save, restore or erase it (a tenant could
    read or wipe another's), the admin key may, and a saved file is its user's alone."""
    server = start_server("--slot-save-path", str(tmp_path)).wait_ready()
    gw = GatewayThread(server_name=server.name, api_key="sesame", admin_key="operator")
    try:
        gw.openai("sesame").completions.create(model="tiny", prompt="Hello there", max_tokens=4)

        def post(action: str, body: Any = None, slot: str = "0", key: str = "operator") -> httpx.Response:
            return httpx.post(f"{gw.url}/slots/{slot}", params={"action": action}, json=body, timeout=30,
                              headers={"Authorization": f"Bearer {key}"})

        for key in ("wrong", "sesame"):
            for action, call in (("save", {"filename": "a.bin"}), ("erase", None)):
                refused = post(action, call, key=key)
                assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_admin_key"
        assert not (tmp_path / "a.bin").exists() and server.slots()[0].kv_cells > 0
        saved = post("save", {"filename": "a.bin"})
        assert saved.status_code == 200, saved.text
        body = saved.json()
        assert body["id_slot"] == 0 and body["n_saved"] == server.slots()[0].kv_cells > 0
        assert body["n_written"] == (tmp_path / "a.bin").stat().st_size and "save_ms" in body["timings"]
        assert stat.S_IMODE((tmp_path / "a.bin").stat().st_mode) == 0o600
        assert post("erase").json() == {"id_slot": 0, "n_erased": body["n_saved"]}
        restored = post("restore", {"filename": "a.bin"}).json()
        assert restored["n_restored"] == body["n_saved"] == server.slots()[0].kv_cells
        for action, call, problem in (("restore", {"filename": "none.bin"}, "no slot file 'none.bin'"),
                                      ("load", None, "'action' must be one of save, restore, erase"),
                                      ("save", {}, "the body must be"), ("erase", None, "no slot 5")):
            refused = post(action, call, slot="5" if problem == "no slot 5" else "0")
            assert refused.status_code == 400 and problem in refused.json()["error"]["message"], refused.text
    finally:
        gw.stop()


@pytest.mark.timeout(180)
def test_instances_count_processes_and_slots_count_slots_everywhere(start_server) -> None:
    """2 instances × parallel 2: 2 processes and 4 slots in /health, /metrics, /backend/monitor, the console and
    `mpserve status`, idle and with every slot busy; a fixed count waits for its slots without a scaling warning."""
    server = start_server("--instances", "2", "--parallel", "2", "--n-ctx", "4096", "--scale-up-after",
                          "0.2").wait_ready()
    gw = GatewayThread(server_name=server.name)

    def counts(state: str) -> tuple[float, float]:
        m = gw.metrics()
        return (m.get(("mpserve_instances", (("model", "tiny"), ("state", state))), -1.0),
                m.get(("mpserve_slots", (("model", "tiny"), ("state", state))), -1.0))

    try:
        tiny = gw.get("/health").json()["models"]["tiny"]
        assert (tiny["ready"], tiny["busy"], tiny["ready_slots"], tiny["busy_slots"]) == (2, 0, 4, 0)
        assert counts("idle") == (2, 4) and counts("busy") == (0, 0)
        assert gw.metrics()["mpserve_registered_instances", (("model", "tiny"),)] == 2
        body = gw.get("/backend/monitor").json()
        instances = body["instances"]
        assert len(instances) == 2 and len({i["pid"] for i in instances}) == 2 and body["slots"] == 4
        assert all(len(i["slots"]) == 2 and i["kv_capacity"] == 2 * 4096 for i in instances)
        assert body["rss_bytes"] == sum(i["rss_bytes"] for i in instances)  # each process once, not once a slot
        assert body["pss_bytes"] == sum(i["pss_bytes"] for i in instances)
        console = gw.get("/console/state").json()
        assert [(m["instances"], m["free_slots"]) for m in console["models"]] == [(2, 4)]
        assert len(console["slots"]) == 4
        status = mpserve("status", "--server-name", server.name, timeout=30)
        assert "2 instances (processes), 4 slots" in status.stdout.splitlines()[0], status.stdout

        done: list[object] = []

        def generate() -> None:
            with Client(server.address, timeout=150) as client:
                # long enough for the checks below to see every slot busy (the tiny model writes 600 tokens in
                # a fraction of a second)
                done.append(client.generate("x", max_tokens=2000, temperature=0, ignore_eos=True))

        threads = [threading.Thread(target=generate) for _ in range(5)]  # 4 slots: one waits
        for thread in threads:
            thread.start()
        try:
            full = wait_for(lambda: (h := gw.get("/health").json()["models"]["tiny"])["busy_slots"] == 4 and h, 30,
                            "every slot busy")
            assert (full["ready"], full["busy"], full["ready_slots"]) == (2, 2, 4)
            assert counts("busy") == (2, 4) and counts("idle") == (0, 0)
            # each slot with its request (a slot whose request just ended shows none until the waiting one takes
            # it: a snapshot without that gap)
            wait_for(lambda: (m := gw.get("/backend/monitor").json()["instances"]) and
                     [i["state"] for i in m] == ["busy", "busy"] and
                     sum(s["request"] is not None for i in m for s in i["slots"]) == 4, 30,
                     "the monitor to show 2 busy instances with a request in each of their 4 slots")
            time.sleep(0.5)  # not a wait: the fifth request waits past scale_up_after
        finally:
            for thread in threads:
                thread.join(150)
        assert len(done) == 5
    finally:
        gw.stop()
    assert not [line for line in server.log if "skipped" in line], "\n".join(server.log)
    assert not [k for k in scale_events(server) if k.startswith("skip")]


def scale_events(server: ServerProcess) -> list[str]:
    """The scale events the broker counted for the tiny model."""
    with Client(server.address) as client:
        return list(client.stats().models["tiny"].scaling.events)
