"""The HTTP server (`lily serve`), in parts that can be read and changed alone: `protocol` (what every API shares in
reading a request: errors, bounded JSON bodies, fields, sampling settings, event streams), one module per API
(`openai`: chat completions and completions; `responses`: OpenAI's Responses API; `anthropic`: Anthropic's Messages
API), `engine` (the worker thread, the session, the prefix cache, the conversations it continues, the metrics) and
`app` (the Starlette app: routes, authentication, `serve`, and `BackgroundServer` for a server in a thread of the
calling process)."""
from lily.server.app import MAX_BODY_BYTES, BackgroundServer, create_app, listen, serve
from lily.server.engine import Engine, Job, Prompt
from lily.server.openai import normalize_messages, parse_chat_request, render_chat
from lily.server.protocol import RequestError, Sampling

__all__ = ["MAX_BODY_BYTES", "BackgroundServer", "Engine", "Job", "Prompt", "RequestError", "Sampling", "create_app", "listen",
           "normalize_messages", "parse_chat_request", "render_chat", "serve"]
