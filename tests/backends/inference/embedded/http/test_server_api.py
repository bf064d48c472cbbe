"""The rest of the HTTP surface: bad requests answered 4xx with a message naming the problem, health,
model info, flush, metrics, and the client's errors for an engine that does not answer."""

from __future__ import annotations

import httpx
import pytest

from relax.engine_api.client import EngineClient, EngineRequestError, EngineUnavailableError
from tests.engine_helpers import free_port, run


def post(url: str, path: str, body) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=30)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input_ids": [1, 2], "bogus_field": 1}, "bogus_field"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"temprature": 0.5}}, "temprature"),
        ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 1.3}}, "repetition_penalty"),
        ({"input_ids": []}, "empty input"),
        ({"input_ids": [[1, 2], []]}, "empty input"),
        ({"input_ids": [1] * 5000}, "context"),
        ({"input_ids": [1, 100000]}, "vocabulary"),
        ({"input_ids": [1, 2], "lora_path": "adapter"}, "lora_path"),
        ({"input_ids": [1, 2], "sampling_params": {"regex": "[a", "json_schema": "{}"}}, "at most one"),
        ({"input_ids": [1, 2], "logprob_start_len": 2}, "logprob_start_len"),
        ({}, "input_ids or text"),
        ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid"),
    ],
)
def test_bad_generate_requests_get_400_naming_the_problem(engine_server, body, needle):
    resp = post(engine_server.url, "/generate", body)
    assert resp.status_code == 400
    assert needle in resp.json()["error"]["message"]


def test_client_raises_request_error_with_the_servers_message(client):
    with pytest.raises(EngineRequestError, match="max_new_tokens") as info:
        run(client.generate([1, 2], {"max_new_tokens": -3}))
    assert info.value.status == 400


def test_bad_control_requests(engine_server):
    assert post(engine_server.url, "/pause_generation", {"mode": "sideways"}).status_code == 400
    assert post(engine_server.url, "/abort_request", {"rid": "x", "everything": True}).status_code == 400
    resp = post(engine_server.url, "/init_weights_update_group", {"master_address": "127.0.0.1"})
    assert resp.status_code == 400 and "master_port" in resp.json()["error"]["message"]


def test_health_info_flush_and_version(client, engine_server):
    assert run(client.health())
    assert httpx.get(engine_server.url + "/health_generate", timeout=30).status_code == 200
    info = run(client.model_info())
    assert info["model_path"] == str(engine_server.engine.runner.model_path)
    assert info["is_generation"] and info["weight_version"] == engine_server.engine.weight_version
    run(client.flush_cache())
    assert (
        httpx.get(engine_server.url + "/get_weight_version").json()["weight_version"]
        == info["weight_version"]
    )


def test_metrics_are_prometheus_text(client):
    run(client.generate([1, 2, 3], {"max_new_tokens": 4, "ignore_eos": True}))
    text = run(client.metrics_text())
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:gen_throughput",
        "sglang:token_usage",
        "sglang:num_used_tokens",
        "sglang:generation_tokens_total",
        "relax:engine_info",
    ):
        assert f"\n{name}{{" in text, name
    assert 'weight_version="' in text


def test_an_engine_that_does_not_answer_raises_unavailable():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineUnavailableError, match=url.replace(".", r"\.")):
        run(EngineClient(url, timeout_s=2).generate([1, 2], {}))
    with pytest.raises(EngineUnavailableError, match="running"):
        run(EngineClient(url, timeout_s=2).health())
