"""The app's own routes and plumbing: /v1/models, /health, the API key, /metrics."""
import re

import openai
import pytest

from lily.server import Engine
from live_server import MAX_CONTEXT, LiveServer, chat_body, client_for


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").model_extra["max_model_len"] == MAX_CONTEXT
    assert server.request("GET", "/health") == (200, {"status": "ok"})


def test_api_key(tiny_model):
    live = LiveServer(Engine(tiny_model, max_context=MAX_CONTEXT), api_key="sekrit")
    try:
        with pytest.raises(openai.AuthenticationError):
            client_for(live.url, "wrong").models.list()
        for path in ("/v1/models", "/metrics"):  # no key at all
            status, err = live.request("GET", path)
            assert status == 401 and err["error"]["code"] == "invalid_api_key"
        status, err = live.request("POST", "/v1/chat/completions", chat_body())
        assert status == 401 and err["error"]["code"] == "invalid_api_key"
        assert live.request("GET", "/health")[0] == 200
        assert [m.id for m in client_for(live.url, "sekrit").models.list().data] == ["tiny"]
    finally:
        live.close()


def test_metrics_exposition(server):
    assert server.request("POST", "/v1/chat/completions", chat_body(max_tokens=2))[0] == 200
    status, text = server.request("GET", "/metrics")
    assert status == 200
    names = ["lily_requests_total", "lily_requests_cancelled_total", "lily_prompt_tokens_total",
             "lily_prompt_cached_tokens_total", "lily_prefill_tokens_total", "lily_prefill_tokens_per_second",
             "lily_generation_tokens_total", "lily_decode_tokens_per_second", "lily_prefix_cache_hits_total",
             "lily_prefix_cache_misses_total", "lily_prefix_cache_bytes", "lily_engine_tokens_processed_total"]
    for name in names:
        assert f"# TYPE {name} " in text, name
    for line in text.splitlines():
        if not line.startswith("#"):
            assert re.fullmatch(r'lily_\w+(\{[^}]*\})? -?[\d.e+-]+', line), line
    assert re.search(r'^lily_requests_total\{endpoint="/v1/chat/completions",status="200"\} [1-9]', text, re.M)
