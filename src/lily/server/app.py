"""The HTTP app (`lily serve`): one Starlette app over one `Engine`, with the routes of each API (openai.py,
responses.py, anthropic.py) and the shared ones (GET /v1/models, /health, /metrics); what every route shares
(authentication, the body read within bounds, metrics per endpoint, a chat started as a job — continued from the
engine's saved state where it extends a conversation — and cancelled when its client goes away, an event stream)
is `Server`."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from lily.conversation import Conversation
from lily.model import Model
from lily.parsers import Delta, OutputParser, prompt_opens_thinking
from lily.prefix_cache import PrefixCache, largest_snapshot_bytes, model_fingerprint
from lily.server.anthropic import Anthropic
from lily.server.engine import Engine, Job, Prompt, render_metrics
from lily.server.openai import OpenAI
from lily.server.responses import Responses
from lily.server.protocol import RequestError, Sampling, field, parse_body, render_conversation

log = logging.getLogger(__name__)

# The largest request body read: a full 262,144-token context is about 1 MB of text (a few MB JSON-escaped).
MAX_BODY_BYTES = 16 << 20


async def _cancel_on_disconnect(request, job: Job) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


def openai_error(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class Server:
    """What every route of one app shares: the engine, the served model's id, authentication, bounded bodies,
    jobs started and watched, event streams; and the routes that belong to no one API."""

    def __init__(self, engine: Engine, model_id: str, api_key: str | None):
        self.engine, self.model_id, self.api_key = engine, model_id, api_key
        self.created = int(time.time())

    def endpoint(self, name: str, handler, protected: bool = True,
                 error: Callable[[RequestError], JSONResponse] = openai_error):
        """The route handler running `handler`: authenticated, its refusals (RequestError) and failures (500)
        answered in its API's error shape by `error`, and counted for /metrics under `name`."""
        async def run(request):
            try:
                if protected and not self._authorized(request):
                    raise RequestError("invalid or missing API key (send 'Authorization: Bearer <key>' or "
                                       "'x-api-key: <key>')", status=401, code="invalid_api_key",
                                       kind="authentication_error")
                response = await handler(request)
            except RequestError as e:
                response = error(e)
            except Exception as e:
                log.exception("%s failed", name)
                response = error(RequestError(f"internal error: {e}", status=500, kind="server_error"))
            self.engine.metrics.count(name, response.status_code)
            return response
        return run

    def _authorized(self, request) -> bool:
        """The key as OpenAI clients send it (Authorization: Bearer) or as Anthropic clients do (x-api-key)."""
        if self.api_key is None:
            return True
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            key = request.headers.get("x-api-key", "")
        return hmac.compare_digest(key.strip().encode(), self.api_key.encode())

    async def body(self, request) -> dict:
        too_long = RequestError(f"the request body exceeds {MAX_BODY_BYTES} bytes", status=413)
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise too_long
        data = bytearray()
        async for piece in request.stream():
            data += piece
            if len(data) > MAX_BODY_BYTES:
                raise too_long
        # A large body is parsed off the event loop, so that other streams go on meanwhile.
        body = parse_body(bytes(data)) if len(data) < 1 << 20 else await asyncio.to_thread(parse_body, bytes(data))
        model = field(body, "model", (str,))
        if model is not None and model != self.model_id:
            raise RequestError(f"the model '{model}' does not exist: this server serves '{self.model_id}'",
                               status=404, param="model", code="model_not_found")
        return body

    async def start(self, request, job: Job):
        """Submits a job; returns (its Prompt, the disconnect watcher) once the engine accepted it."""
        self.engine.submit(job)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
        try:
            kind, value = await job.next()
        except BaseException:
            watcher.cancel()
            job.cancel()
            raise
        if kind == "error":
            watcher.cancel()
            raise value
        return value, watcher

    async def start_chat(self, request, messages: list[dict], tools: list[dict] | None, template_kwargs: dict,
                         sampling: Sampling, param: str = "messages",
                         held_history: bool = False) -> tuple[Job, asyncio.Task, OutputParser]:
        """Starts a conversation given in the chat template's terms (protocol.render_conversation): rendered and
        bounded off the event loop, tokenised and served by the engine. Returns (the job, its disconnect watcher,
        the OutputParser that splits its text into reasoning, content and tool calls) once the engine accepted it;
        the job's events are then ("token", GenerationResponse)..., ("done", Usage) or ("error", RequestError).
        held_history: the history is the server's own (Responses' previous_response_id), not the request's, so its
        state continues as it holds the replies, thinking included, as OpenAI's API keeps a response's reasoning."""
        model = self.engine.model

        def render() -> Callable[[Model], Prompt]:
            """The prompt: the state of a conversation these messages extend, continued (Conversation) where the
            template renders its reply as the state holds it, or else the whole conversation rendered."""
            conv = self.engine.conversations.find(messages, tools, template_kwargs)
            found = conv and (held_history or conv.keeps_thinking(model.tokenizer, messages)) and \
                conv.continuation(model.tokenizer, messages)
            if found:
                self.engine.check_prompt_length(len(found[0]), param)
                return lambda m: Prompt(*found)
            text = render_conversation(model, messages, tools, template_kwargs, param)
            ids = self.engine.tokenize(text, param)
            return lambda m: Prompt(ids, text)

        prompt_fn = await asyncio.to_thread(render)  # renders and tokenises off the event loop and the worker
        job = Job(prompt_fn, sampling, param)
        job.chat = (messages, tools, template_kwargs)
        prompt, watcher = await self.start(request, job)
        return job, watcher, OutputParser(reasoning=prompt_opens_thinking(prompt.text), tools=tools)

    def finish_chat(self, job: Job, out: Delta) -> None:
        """Records a chat job's finished reply (`out`, as its OutputParser split it): a next request whose messages
        extend the conversation with this reply continues the state the engine held after it (Conversations)."""
        if job.held is None:
            return
        messages, tools, template_kwargs = job.chat
        reply = {"role": "assistant", "content": out.content}
        if out.reasoning:
            reply["reasoning_content"] = out.reasoning
        if out.tool_calls:
            reply["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                   for c in out.tool_calls]
        h = job.held
        self.engine.conversations.record(Conversation(tuple(messages) + (reply,), tools, dict(template_kwargs),
                                                      h.tokens, h.pending, h.closed_turn))

    # -- endpoints -------------------------------------------------------------------------------------------

    async def health(self, request):
        return JSONResponse({"status": "ok"})

    async def metrics(self, request):
        return PlainTextResponse(render_metrics(self.engine), media_type="text/plain; version=0.0.4")

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "lily",
                "max_model_len": self.engine.max_context}

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        if request.path_params["model"] != self.model_id:
            raise RequestError(f"the model '{request.path_params['model']}' does not exist", status=404,
                               param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    def stream(self, chunks, job: Job, watcher) -> StreamingResponse:
        async def body():
            try:
                async for piece in chunks:
                    yield piece
            finally:  # also when the client went away and the response task is cancelled
                watcher.cancel()
                job.cancel()

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self.endpoint("/v1/models", self.models), methods=["GET"]),
                Route("/v1/models/{model:path}", self.endpoint("/v1/models", self.model), methods=["GET"]),
                Route("/health", self.endpoint("/health", self.health, protected=False), methods=["GET"]),
                Route("/metrics", self.endpoint("/metrics", self.metrics), methods=["GET"])]


def create_app(engine: Engine, *, model_id: str, api_key: str | None = None):
    """The Starlette app of an engine. Its lifespan starts the engine's worker and closes the engine."""
    srv = Server(engine, model_id, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.close)

    async def http_error(request, exc: HTTPException):
        err = RequestError(exc.detail, status=exc.status_code, code="not_found" if exc.status_code == 404 else None)
        engine.metrics.count(request.url.path if exc.status_code != 404 else "other", exc.status_code)
        return openai_error(err)

    routes = OpenAI(srv).routes() + Responses(srv).routes() + Anthropic(srv).routes() + srv.routes()
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=128)


class BackgroundServer:
    """The app of `engine` served by uvicorn in a daemon thread of this process, for programs that keep the model
    in-process and talk to it over HTTP (tests, benchmarks, notebooks): `url` (no /v1), `port`, `close()`. The socket
    listens before the thread starts, so requests sent at once wait in its backlog."""

    def __init__(self, engine: Engine, *, model_id: str, api_key: str | None = None, host: str = "127.0.0.1",
                 port: int = 0):
        self.engine = engine
        sock = listen(host, port)
        self.port = sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(create_app(engine, model_id=model_id, api_key=api_key), log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stops the server and waits for it (and the engine, which its lifespan closes); raises if it does not
        stop within a minute."""
        self.server.should_exit = True
        self.thread.join(timeout=60)
        if self.thread.is_alive():
            raise RuntimeError("the background server did not shut down within 60 s")


def serve(model: Model, *, model_id: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_context: int | None = None, cache_bytes: int = 4 << 30, cache_dir: str | None = None,
          cache_disk_bytes: int | None = None, log_level: str = "info") -> None:
    """Serves `model` over HTTP until interrupted (SIGINT / SIGTERM)."""
    cache = None
    if cache_bytes > 0 or cache_dir is not None:
        cache = PrefixCache(cache_bytes, fingerprint=model_fingerprint(model), cache_dir=cache_dir,
                            max_disk_bytes=cache_disk_bytes, max_snapshot_bytes=largest_snapshot_bytes(
                                model.config, max_context or model.config["max_position_embeddings"]))
    engine = Engine(model, max_context=max_context, cache=cache)
    app = create_app(engine, model_id=model_id, api_key=api_key)
    sock = listen(host, port)
    bound = sock.getsockname()[1]
    if api_key is None and not _is_loopback(host):
        print(f"lily: warning: serving on {host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    print(f"lily: serving {model_id} at http://{host}:{bound}/v1 (context {engine.max_context} tokens)",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])


def _is_loopback(host: str) -> bool:
    try:
        return all(info[4][0].startswith("127.") or info[4][0] == "::1"
                   for info in socket.getaddrinfo(host, None))
    except OSError:
        return False
