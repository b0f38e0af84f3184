"""The `lily` command: generate, chat and serve (also `python -m lily`)."""
from __future__ import annotations

import argparse
import os
import sys

from lily.generate import stream_generate
from lily.model import load

SAMPLING_FLAGS = (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float),
                  ("repetition_penalty", float), ("presence_penalty", float), ("frequency_penalty", float),
                  ("seed", int))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny",
                   help="checkpoint directory, Hugging Face id, or 'tiny' (built-in random model; default)")
    p.add_argument("--backend", default="cpu", help="cpu (default) or a GPU backend compiled into this build")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-context", type=int, default=None, help="context limit of the session (tokens)")
    for name, kind in SAMPLING_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                       help="default: the model's generation_config.json")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--no-thinking", action="store_true", help="render the chat template with enable_thinking=false")
    p.add_argument("--system", default=None, help="system prompt")


def _sampling(args) -> dict:
    kw = {name: getattr(args, name) for name, _ in SAMPLING_FLAGS if getattr(args, name) is not None}
    kw["max_tokens"] = args.max_tokens
    if args.stop:
        kw["stop"] = args.stop
    return kw


def _run(model, session, prompt, args, stats: bool) -> str:
    last, out = None, []
    for r in stream_generate(model, prompt, session=session, enable_thinking=False if args.no_thinking else None,
                             **_sampling(args)):
        print(r.text, end="", flush=True)
        out.append(r.text)
        last = r
    print()
    if stats and last is not None:
        print(f"[prompt {last.prompt_tokens} tokens ({last.cached_tokens} cached) {last.prompt_tps:.1f} tok/s | "
              f"generated {last.generation_tokens} tokens {last.generation_tps:.1f} tok/s | "
              f"finish {last.finish_reason} | peak {last.peak_memory:.3f} GB]", file=sys.stderr)
    return "".join(out)


def cmd_generate(args) -> int:
    model = load(args.model, backend=args.backend)
    if args.raw:
        prompt = args.prompt
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + \
                 [{"role": "user", "content": args.prompt}]
    _run(model, model.session(args.max_context), prompt, args, stats=True)
    return 0


def cmd_chat(args) -> int:
    model = load(args.model, backend=args.backend)
    session = model.session(args.max_context)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"{model}\nType a message; /reset clears the conversation, /quit (or Ctrl-D) leaves.", file=sys.stderr)
    while True:
        try:
            line = input(">> ")
        except EOFError:
            print()
            return 0
        if line.strip() == "/quit":
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            session.reset()
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = _run(model, session, messages, args, stats=args.stats)
        messages.append({"role": "assistant", "content": reply})


def cmd_serve(args) -> int:
    from lily.server import serve

    model = load(args.model, backend=args.backend)
    gib = 1 << 30
    try:
        serve(model, model_id=args.served_model_name or args.model, host=args.host, port=args.port,
              api_key=args.api_key or os.environ.get("LILY_API_KEY") or None, max_context=args.max_context,
              cache_bytes=int(args.cache_gb * gib), cache_dir=args.cache_dir,
              cache_disk_bytes=int(args.cache_dir_gb * gib),
              log_level=args.log_level)
    except OSError as e:
        print(f"lily: error: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_bench(args) -> int:
    from pathlib import Path

    from lily import bench

    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else \
        (bench.ABLATION_LENGTHS if args.ablate else bench.LENGTHS)
    out = Path(args.out or f"lily-bench-{args.backend}{'-ablation' if args.ablate else ''}.json")
    if args.ablate:
        bench.ablate(args.model, args.backend, lengths, args.decode_tokens, out)
    else:
        bench.run(args.model, args.backend, lengths, args.decode_tokens, args.budget, out, greedy_too=args.greedy)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lily", description="Lily: an inference engine for Qwen3.6-35B-A3B")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a reply to one prompt")
    _common(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive multi-turn chat that keeps its state between turns")
    _common(c)
    c.add_argument("--stats", action="store_true", help="print speeds after each reply")
    c.set_defaults(func=cmd_chat)
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat, completions, models, metrics)")
    s.add_argument("--model", required=True, help="checkpoint directory, Hugging Face id, or 'tiny'")
    s.add_argument("--backend", default="cpu", help="cpu (default) or a GPU backend compiled into this build")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port (0: any free one; default 8000)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $LILY_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    s.add_argument("--max-context", type=int, default=None, help="context limit in tokens (default: the model's)")
    s.add_argument("--cache-gb", type=float, default=4.0, help="memory for prefix snapshots (default 4; 0: off)")
    s.add_argument("--cache-dir", default=None, help="keep prefix snapshots on disk here, across restarts")
    s.add_argument("--cache-dir-gb", type=float, default=32.0, help="disk budget of --cache-dir (default 32)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)
    b = sub.add_parser("bench", help="prefill and decode speed against context length (JSON + PNG plot)",
                       description="Times lily.stream_generate with the model's defaults at each prompt length: "
                       "prefill tok/s (prompt over time to first token) and steady decode tok/s.")
    b.add_argument("--model", default="tiny", help="checkpoint directory, Hugging Face id, 'tiny' (default), or "
                   "'random' (the full Qwen3.6-35B-A3B geometry with random 4-bit weights)")
    b.add_argument("--backend", default="cpu", help="cpu (default) or a GPU backend compiled into this build")
    b.add_argument("--lengths", default=None, help="comma-separated prompt lengths (default 256 … 131072)")
    b.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per length (default 64)")
    b.add_argument("--budget", type=float, default=600.0, help="start no new length after this many seconds")
    b.add_argument("--greedy", action="store_true", help="also time greedy decoding at each length")
    b.add_argument("--ablate", action="store_true", help="repeat 4K/32K/128K with each optimisation off alone")
    b.add_argument("--out", default=None, help="JSON path (the PNG goes beside it)")
    b.set_defaults(func=cmd_bench)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"lily: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
