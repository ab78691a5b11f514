"""The server against a hostile client (issue 17): strict types and one error shape, unreadable bodies, bodies
past --max-body refused unread while other requests keep their latency, prompts far past the context refused
early, /tokenize behind the key, a port in use, SIGTERM draining; and a schema fuzzer (schemathesis over the
server's own OpenAPI schema) that never gets a 5xx."""
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, settings
from serve_util import ProcessServer, qwen3_container, rss_bytes, sse_events

KEY = "sk-hardening"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 << 10


@pytest.fixture(scope="module")
def container(releases, tmp_path_factory):
    return qwen3_container(releases, tmp_path_factory.mktemp("hardening"))


@pytest.fixture(scope="module")
def server(container):
    s = ProcessServer(container, "--api-key", KEY, "--max-body", "64K", "--context", "128")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as c:
        yield c


def error_of(r, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"], err     # one shape, a code always
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("raw, param", [
    ('"stream": "yes"', "stream"),
    ('"max_tokens": true', "max_tokens"),
    ('"max_tokens": 2.5', "max_tokens"),
    ('"temperature": Infinity', "temperature"),
    ('"temperature": NaN', "temperature"),
    ('"top_p": -Infinity', "top_p"),
    ('"seed": "7"', "seed"),
    ('"stop": [1]', "stop"),
    ('"max_tokens": -5', "max_tokens"),
    ('"top_p": 2', "top_p"),
])
def test_strict_types_and_ranges(http, raw, param):
    for path, lead in (("/v1/completions", '"prompt": "def f(x):"'),
                       ("/v1/chat/completions", '"messages": [{"role": "user", "content": "Hi"}]')):
        r = http.post(path, content=("{" + lead + ", " + raw + "}").encode(), headers={"Content-Type": "application/json"})
        error_of(r, 400, param)


@pytest.mark.parametrize("body", [b'{"prompt": "\xff\xfe"}', b"[" * 30_000 + b"]" * 30_000, b"[1, 2]", b"{not json",
                                  b""], ids=["not-utf8", "30k-deep", "array", "not-json", "empty"])
def test_unreadable_bodies_get_400_with_a_code(http, body):
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    error_of(r, 400)


def test_tokenize_and_detokenize_need_the_key(server):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert error_of(httpx.post(server.url + path, json=body), 401)["code"] == "invalid_api_key"
        assert httpx.post(server.url + path, json=body, headers=AUTH).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200 and httpx.get(server.url + "/metrics").status_code == 200


def test_a_prompt_far_past_the_context_is_refused_by_its_start(http):
    r = http.post("/v1/completions", json={"prompt": "word " * 12000, "max_tokens": 4})     # 60 KB, context 128
    err = error_of(r, 400, "prompt")
    assert err["code"] == "context_length_exceeded" and "more than" in err["message"]
    r = http.post("/v1/completions", json={"prompt": "word " * 200, "max_tokens": 4})       # exact count: near it
    assert error_of(r, 400, "prompt")["code"] == "context_length_exceeded"
    r = http.post("/tokenize", json={"prompt": "word " * 12000})                            # /tokenize too
    assert error_of(r, 400, "prompt")["code"] == "context_length_exceeded"
    assert http.post("/tokenize", json={"prompt": "word " * 100}).json()["count"] > 0


def _raw_post(url: str, headers: list[str], chunks, timeout: float = 20.0) -> tuple[int, float]:
    """Send a request by hand (headers, then body pieces until the server answers or hangs up): the status line's
    code and the seconds it took."""
    host, port = url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   + "".join(h + "\r\n" for h in headers) + "\r\n").encode())
        try:
            for piece in chunks:
                s.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass                      # the server answered and closed while the body was still coming
        head = b""
        while b"\r\n" not in head:
            got = s.recv(4096)
            if not got:
                break
            head += got
    return int(head.split(b" ")[1]), time.monotonic() - t0


def test_oversize_bodies_are_refused_unread_and_others_keep_their_latency(server):
    """A body past --max-body is answered 413 at once, declared (Content-Length: 200 MB, never sent) or streamed
    (chunked, 20 MB offered); meanwhile /health answers as fast as it did, and the server's memory does not grow
    with what was offered. Bounds: 5 s per refusal (they take milliseconds), /health under 1 s at worst, RSS within
    32 MiB of where it started (the body kept is at most 64 KiB)."""
    before = rss_bytes(server.pid)
    lat, stop = [], threading.Event()

    def probe():
        while not stop.is_set():
            t = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            lat.append(time.monotonic() - t)
            time.sleep(0.02)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    try:
        for _ in range(5):
            code, dt = _raw_post(server.url, [f"Authorization: Bearer {KEY}", "Content-Length: 200000000"],
                                 [b'{"prompt": "'])
            assert code == 413 and dt < 5
            mb = b"x" * (1 << 20)
            chunked = (b"%x\r\n%s\r\n" % (len(mb), mb) for _ in range(20))
            code, dt = _raw_post(server.url, [f"Authorization: Bearer {KEY}", "Transfer-Encoding: chunked"],
                                 chunked)
            assert code == 413 and dt < 5
        r = httpx.post(server.url + "/v1/completions", headers=AUTH, json={"prompt": "x" * (MAX_BODY + 1)})
        assert error_of(r, 413)["code"] == "request_too_large" and "--max-body" in r.json()["error"]["message"]
    finally:
        stop.set()
        t.join()
    assert lat and max(lat) < 1.0, max(lat)
    assert rss_bytes(server.pid) - before < 32 << 20


def test_port_in_use_is_one_line(container):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "waste", "serve", str(container), "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert f"waste: error: port {port} on 127.0.0.1 is in use" in p.stderr


def test_sigterm_lets_running_streams_finish(container):
    """SIGTERM during a stream: the stream ends as it would have (finish_reason, [DONE]), the port closes, and the
    process ends by itself, without a traceback (uvicorn re-raises the signal once it has shut down: -SIGTERM)."""
    s = ProcessServer(container, "--shutdown-grace", "60")
    try:
        lines, first = [], threading.Event()

        def stream():
            with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                              json={"prompt": "def f(x):", "max_tokens": 120, "stream": True}) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if line.startswith("data: {"):
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        s.proc.send_signal(signal.SIGTERM)
        t.join(60)
        events = sse_events(lines)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("length", "stop"), events[-3:]
        assert s.proc.wait(30) in (0, -signal.SIGTERM)
        assert not any("Traceback" in line for line in s.lines), "".join(s.lines[-20:])
        with pytest.raises(httpx.ConnectError):
            httpx.get(s.url + "/health", timeout=2)
    finally:
        s.stop()


def test_drain_ends_what_outlives_the_grace_with_an_error_event(releases, container, monkeypatch):
    """In this process, with every token slowed to 50 ms so that a 200-token stream outlives a 0.3 s grace: the
    shutdown the SIGTERM handler starts ends it with an error event, then [DONE]; a kept-alive client's new request
    meanwhile gets 503 shutting_down."""
    import uvicorn

    import waste
    from waste.engine import Decoding
    from waste.serve.app import ServerState, _server_class, create_app

    real = Decoding.sample

    def slow(self, logits):
        time.sleep(0.05)
        return real(self, logits)

    monkeypatch.setattr(Decoding, "sample", slow)
    eng = waste.load(container)
    state = ServerState(engine=eng, grace=0.3)
    server = _server_class()(uvicorn.Config(create_app(state), host="127.0.0.1", port=0, log_level="warning"))
    server.state = state
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        while not server.started:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        lines, first = [], threading.Event()

        def stream():
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"prompt": "def f(x):", "max_tokens": 100, "stream": True}) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(30)
        server.should_exit = True          # what uvicorn's SIGTERM handler does
        t.join(30)
        events = sse_events(lines)
        assert events[-1] == "[DONE]", events[-3:]
        err = events[-2]["error"]
        assert err["code"] == "cancelled" and "shutting down" in err["message"]
    finally:
        server.should_exit = True
        th.join(30)
        eng.close()


# -- the schema fuzzer ---------------------------------------------------------------------------------------
def _schema():
    import schemathesis

    from waste.serve.app import ServerState, create_app

    return schemathesis.openapi.from_dict(create_app(ServerState()).openapi())


schema = _schema()


@pytest.fixture(scope="module")
def fuzz_url(server):
    return server.url


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_schema_fuzz_never_gets_a_5xx(case, fuzz_url):
    """Bodies and parameters generated from the server's own OpenAPI schema (valid and not), sent with the key:
    every answer is below 500 and every error has the one shape."""
    resp = case.call(base_url=fuzz_url, headers=AUTH, timeout=60)
    assert resp.status_code < 500, (case.method, case.path, case.body, resp.text[:500])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"} and err["code"], err
