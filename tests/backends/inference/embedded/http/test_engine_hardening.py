"""One bad request never stalls or kills the embedded engine's server: a real `EngineServer` on
127.0.0.1 over the tiny model, spoken to over HTTP. Tiny temperatures sample greedily, `n` and the KV
budget are bounded, oversized bodies get 413, `/slow_down` is bounded, a dead engine thread turns
`/health` to 503, an unreadable checkpoint answers 400 naming the file, a half-sent request gets 408, a
connection whose request head never completes (slowloris) is closed, and
a weight-group join to a trainer that never answers fails within its timeout while every other route
keeps answering."""

from __future__ import annotations

import select
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from relax.backends.inference.embedded.http.server import EngineServer

MAX_BODY = 16 * 1024 * 1024
KV_BUDGET = 512
SERVER_KW = dict(
    port=0, seed=0, max_running=8, max_total_tokens=KV_BUDGET, dtype="float32", threads=1, device="cpu"
)


READ_TIMEOUT_S = 1.5
JOIN_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = EngineServer(
        str(tiny_model_dir),
        max_body_bytes=MAX_BODY,
        read_timeout_s=READ_TIMEOUT_S,
        header_timeout_s=READ_TIMEOUT_S,
        weight_join_timeout_s=JOIN_TIMEOUT_S,
        **SERVER_KW,
    )
    srv.start()
    yield srv
    srv.stop()


def generate(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=60)


def error_of(resp: httpx.Response) -> str:
    return resp.json()["error"]["message"]


def test_tiny_temperature_samples_greedily_and_spares_other_requests(server):
    prompt = [1, 2, 3, 4]
    greedy = generate(
        server.url,
        {
            "input_ids": prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True},
        },
    )
    assert greedy.status_code == 200
    tiny = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 1e-40, "max_new_tokens": 6, "ignore_eos": True},
    }
    normal = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0.8, "max_new_tokens": 6}}
    with ThreadPoolExecutor(2) as pool:  # in flight together: one batch, one step
        tiny_f, normal_f = pool.submit(generate, server.url, tiny), pool.submit(generate, server.url, normal)
        tiny_r, normal_r = tiny_f.result(), normal_f.result()
    assert tiny_r.status_code == 200, tiny_r.text
    assert normal_r.status_code == 200, normal_r.text
    assert tiny_r.json()["output_ids"] == greedy.json()["output_ids"]


def test_infinite_temperature_is_refused(server):
    resp = httpx.post(
        server.url + "/generate",
        content=b'{"input_ids": [1, 2], "sampling_params": {"temperature": 1e999}}',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 400 and "temperature" in error_of(resp)


def test_n_above_the_limit_gets_400_naming_n_and_the_limit(server):
    resp = generate(server.url, {"input_ids": [1, 2], "sampling_params": {"n": 9, "max_new_tokens": 2}})
    assert resp.status_code == 400
    assert "n=9" in error_of(resp) and "8" in error_of(resp)
    resp = generate(server.url, {"input_ids": [1, 2], "sampling_params": {"n": 10**12}})
    assert resp.status_code == 400 and "n=" in error_of(resp)
    assert generate(server.url, {"input_ids": [1, 2], "sampling_params": {"n": 0}}).status_code == 400
    ok = generate(server.url, {"input_ids": [1, 2], "sampling_params": {"n": 8, "max_new_tokens": 2}})
    assert ok.status_code == 200 and len(ok.json()) == 8


def test_prompt_over_the_kv_budget_or_context_gets_400(server):
    resp = generate(server.url, {"input_ids": [1] * (KV_BUDGET + 10)})
    assert resp.status_code == 400 and "max_total_tokens" in error_of(resp)
    resp = generate(server.url, {"input_ids": [1] * 100, "sampling_params": {"n": 8}})
    assert resp.status_code == 400 and "KV budget" in error_of(resp)
    resp = generate(server.url, {"input_ids": [1] * (server.engine.max_context_len + 1)})
    assert resp.status_code == 400 and "context" in error_of(resp)


def test_oversized_body_gets_413_quickly_and_the_server_stays_up(server):
    big = b'{"input_ids": [' + b"1, " * (20 * 1024 * 1024 // 3) + b"1]}"
    resp = httpx.post(
        server.url + "/generate", content=big, headers={"content-type": "application/json"}, timeout=30
    )
    assert resp.status_code == 413 and str(MAX_BODY) in error_of(resp)
    # refused on its declared length, before the body is read: a body that never comes still gets the 413
    # (a server that waited for it would answer 408 after its read timeout instead)
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        head = f"POST /generate HTTP/1.1\r\nHost: {server.host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(big)}\r\n\r\n".encode() + big[:1000])
        answer = sock.recv(4096).decode(errors="replace")
    assert answer.startswith("HTTP/1.1 413"), answer

    def chunks():  # no Content-Length: counted as it streams
        for _ in range(20):
            yield b" " * (1024 * 1024)

    resp = httpx.post(
        server.url + "/generate", content=chunks(), headers={"content-type": "application/json"}, timeout=30
    )
    assert resp.status_code == 413
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert (
        generate(server.url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}).status_code
        == 200
    )


@pytest.mark.parametrize("raw", [b"1e308", b"1e999", b"61", b"-1"])
def test_slow_down_is_bounded(server, raw):
    resp = httpx.post(
        server.url + "/slow_down",
        content=b'{"forward_sleep_time": ' + raw + b"}",
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert resp.status_code == 400 and "forward_sleep_time" in error_of(resp)
    assert server.engine.step_sleep_s == 0.0


def test_slow_down_within_bounds_still_works(server):
    assert (
        httpx.post(server.url + "/slow_down", json={"forward_sleep_time": 0.5}, timeout=10).status_code == 200
    )
    assert server.engine.step_sleep_s == 0.5
    assert (
        httpx.post(server.url + "/slow_down", json={"forward_sleep_time": None}, timeout=10).status_code
        == 200
    )
    assert server.engine.step_sleep_s == 0.0


def test_unreadable_checkpoint_gets_400_naming_the_file(server, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage, not a safetensors header")
    resp = httpx.post(
        server.url + "/update_weights_from_disk", json={"model_path": str(tmp_path)}, timeout=30
    )
    assert resp.status_code == 400
    assert resp.json()["success"] is False and "model.safetensors" in resp.json()["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_engine_thread_turns_health_to_503(tiny_model_dir):
    srv = EngineServer(str(tiny_model_dir), **SERVER_KW)
    srv.start()
    try:
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200

        def die() -> int:
            raise SystemExit("simulated fatal error in the engine thread")

        srv.engine.scheduler.step = die
        # the request in flight when the thread dies is failed, not left hanging
        resp = generate(srv.url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        assert resp.status_code >= 500
        deadline = time.monotonic() + 10
        while srv.engine.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
        assert generate(srv.url, {"input_ids": [1, 2]}).status_code == 503
    finally:
        srv.stop()


def test_a_half_sent_request_gets_408_and_holds_nothing(server):
    host, port = server.host, server.port
    with socket.create_connection((host, port), timeout=30) as sock:
        head = f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall((head + "Content-Length: 1000\r\n\r\n").encode() + b'{"input_ids": [1')
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # others meanwhile
        answer = sock.recv(4096).decode(errors="replace")
        waited = time.monotonic() - t0
    assert answer.startswith("HTTP/1.1 408"), answer
    assert waited > READ_TIMEOUT_S * 0.5, (
        waited
    )  # the 408 is the read timeout's (the socket's bounds the wait)


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout if it never does)."""
    out = b""
    try:
        while chunk := sock.recv(4096):
            out += chunk
    except ConnectionResetError:  # closed while the client was still sending
        pass
    return out


def _dribble_until_closed(sock: socket.socket, step_s: float = 0.3, max_steps: int = 200) -> bytes:
    """Send one more header byte every `step_s` until the server answers or closes."""
    for _ in range(max_steps):
        if select.select([sock], [], [], step_s)[0]:
            return _read_until_closed(sock)
        try:
            sock.sendall(b"l")
        except OSError:  # closed while a byte was on its way
            return _read_until_closed(sock)
    raise AssertionError("the server never closed a connection whose head never completed")


@pytest.mark.parametrize("dribble", [False, True])
def test_a_half_sent_request_head_is_timed_out_and_closed(server, dribble):
    """A request line and part of the headers, then silence, or a header byte now and then (which must
    not reset the deadline): the server answers 408 and closes; meanwhile every other request is served."""
    host, port = server.host, server.port
    with socket.create_connection((host, port), timeout=60) as sock:  # a hang fails, never stalls
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: app".encode())
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        out = generate(server.url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        assert out.status_code == 200, out.text
        answer = _dribble_until_closed(sock) if dribble else _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer


def test_a_connection_that_sends_nothing_is_closed(server):
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        assert _read_until_closed(sock) == b""


def test_a_join_to_an_unreachable_trainer_fails_fast_and_blocks_no_route(server):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused
    body = {
        "master_address": "127.0.0.1",
        "master_port": dead.getsockname()[1],
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "never",
        "backend": "gloo",
    }
    try:
        with ThreadPoolExecutor(2) as pool:
            join = pool.submit(httpx.post, server.url + "/init_weights_update_group", json=body, timeout=120)
            time.sleep(0.5)
            # while it waits: a second join is refused at once, every other route answers
            again = httpx.post(server.url + "/init_weights_update_group", json=body, timeout=10)
            assert again.status_code == 409, again.text
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
            assert httpx.get(server.url + "/get_model_info", timeout=5).status_code == 200
            assert httpx.post(server.url + "/pause_generation", json={}, timeout=10).status_code == 200
            assert httpx.post(server.url + "/continue_generation", timeout=10).status_code == 200
            out = generate(server.url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
            assert out.status_code == 200, out.text
            answer = join.result(timeout=120)
        assert answer.status_code == 400 and answer.json()["success"] is False, answer.text
    finally:
        dead.close()
