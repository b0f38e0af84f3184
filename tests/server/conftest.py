"""The shared in-process server of the server tests (tiny model, prefix cache), its openai client, and `script`,
which makes its model say what a test sets."""
import openai
import pytest

from lily.generate import stream_generate
from lily.prefix_cache import PrefixCache, model_fingerprint
from lily.server import Engine
from live_server import MAX_CONTEXT, LiveServer, Script, client_for


@pytest.fixture(scope="module")
def server(tiny_model):
    cache = PrefixCache(256 << 20, fingerprint=model_fingerprint(tiny_model))
    live = LiveServer(Engine(tiny_model, max_context=MAX_CONTEXT, cache=cache))
    yield live
    live.close()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return client_for(server.url)


@pytest.fixture
def script(server):
    """Makes the shared server's model say what the test sets in `script.reply`."""
    s = Script(lambda prompt: "")
    server.engine.generate_fn = s
    yield s
    server.engine.generate_fn = stream_generate
