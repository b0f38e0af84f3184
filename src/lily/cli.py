"""The `lily` command: generate, chat, serve and bench (also `python -m lily`)."""
from __future__ import annotations

import argparse
import os
import re
import sys
import threading
import time

from lily.backend import resolve_backend, unusable_gpus
from lily.generate import stream_generate
from lily.model import ContextLimitError, load
from lily.sampling import SamplingParams

SAMPLING_FLAGS = (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float),
                  ("repetition_penalty", float), ("presence_penalty", float), ("frequency_penalty", float),
                  ("seed", int))
BACKEND_HELP = ("cuda, metal, cpu or auto (default: $LILY_BACKEND, else auto: the first of cuda, metal, cpu that "
                "can run here)")
CHAT_HELP = """Commands:
  /help          this list
  /reset         start a new conversation (the --system prompt stays)
  /exit, /quit   leave (so do `exit`, `quit`, Ctrl-D, and Ctrl-C twice at an empty prompt)
Ctrl-C while Lily answers stops the reply: the part shown stays in the conversation. Ctrl-C while Lily reads a
message drops that message. A message that starts with '/' is sent when written with '//' (one '/' is dropped)."""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny",
                   help="checkpoint directory, Hugging Face id, or 'tiny' (built-in random model; default)")
    p.add_argument("--backend", default=None, help=BACKEND_HELP)
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="most tokens to generate per reply (default: max_new_tokens of the model's "
                        "generation_config.json, else 256); a reply also ends at EOS, a stop string or the "
                        "context limit")
    p.add_argument("--max-context", type=int, default=None, metavar="N",
                   help="context limit of the session in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="tokens per prefill step (default: the backend's; smaller bounds memory and makes progress "
                        "reports and Ctrl-C come sooner)")
    for name, kind in SAMPLING_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                       help="random seed (default: a fresh one for each reply; a seed and prompt give the same "
                       "reply each time)" if name == "seed" else "default: the model's generation_config.json")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--no-thinking", action="store_true", help="render the chat template with enable_thinking=false")
    system = p.add_mutually_exclusive_group()
    system.add_argument("--system", default=None, help="system prompt")
    system.add_argument("--system-file", default=None, metavar="PATH", help="system prompt read from a UTF-8 file")


def _read_text(path: str, flag: str) -> str:
    """A prompt from a file ('-': standard input), as UTF-8; an error names the flag and the file."""
    try:
        if path == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None


def _texts(args) -> None:
    """Resolve --prompt-file, --prompt - and --system-file into args.prompt and args.system (prompts of any size:
    an argument on the command line is limited to 128 KiB by the kernel)."""
    if getattr(args, "prompt_file", None) is not None:
        args.prompt = _read_text(args.prompt_file, "--prompt-file")
    elif getattr(args, "prompt", None) == "-":
        args.prompt = _read_text("-", "--prompt")
    if args.system_file is not None:
        args.system = _read_text(args.system_file, "--system-file")


def _sampling(args) -> dict:
    kw = {name: getattr(args, name) for name, _ in SAMPLING_FLAGS if getattr(args, name) is not None}
    if args.max_tokens is not None:
        kw["max_tokens"] = args.max_tokens
    if args.stop:
        kw["stop"] = args.stop
    return kw


def _check_flags(args) -> None:
    """Refuses bad sampling and size flags before the model loads (a large checkpoint takes a while), naming them."""
    try:
        SamplingParams(**_sampling(args))
    except ValueError as e:
        raise ValueError(re.sub(r"SamplingParams\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(e))) \
            from None
    for flag in ("max_context", "prefill_chunk"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {port}")
    return port


def _gb(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more, got {text}")
    return value


def _auto(requested: str | None) -> bool:
    return (requested or os.environ.get("LILY_BACKEND", "").strip() or "auto") == "auto"


def _announce(name: str, backend: str, device: str, requested: str | None) -> None:
    """One line on stderr at start: which backend runs the model, and why a GPU backend was passed over."""
    line = f"lily: {name} on {backend} ({device})"
    if _auto(requested) and backend == "cpu":
        line += "".join(f"; {b.name} is compiled in but cannot run here: {b.reason}" for b in unusable_gpus())
    print(line, file=sys.stderr, flush=True)


def _load(args):
    model = load(args.model, backend=args.backend)
    _announce(args.model, model.backend, model.device, args.backend)
    return model


class PrefillProgress:
    """Shows a long prefill on stderr (the `progress` callback of stream_generate): nothing for its first DELAY
    seconds, then tokens done / total, tok/s and the time left; a bar redrawn in place where stderr is a terminal,
    else a line every INTERVAL seconds. Cleared (terminal) or closed with a last line once the prefill is done."""

    DELAY, INTERVAL, WIDTH = 2.0, 10.0, 24

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self.shown = self.last = 0.0
        self.total = 0
        self.lock = threading.Lock()
        self.timer: threading.Timer | None = None

    def __call__(self, done: int, total: int) -> None:
        if done == 0:  # the start: show something after DELAY even if the first chunk is slower than that
            self.t0, self.total = time.perf_counter(), total
            self.timer = threading.Timer(self.DELAY, self._show, (0, total))
            self.timer.daemon = True
            self.timer.start()
            return
        self._cancel()
        if done >= total:
            self.close(done)
        elif time.perf_counter() - self.t0 >= self.DELAY:
            self._show(done, total)

    def _show(self, done: int, total: int) -> None:
        with self.lock:
            now = time.perf_counter()
            if not self.tty and self.shown and now - self.last < self.INTERVAL:
                return
            elapsed = max(now - self.t0, 1e-9)
            rate = done / elapsed
            text = f"prefill {done:,}/{total:,} tokens, {rate:,.0f} tok/s"
            if done:
                text += f", {_duration((total - done) / max(rate, 1e-9))} left"
            if self.tty:
                filled = self.WIDTH * done // max(total, 1)
                self.stream.write(f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] {text} (Ctrl-C stops)\x1b[K")
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
            self.shown, self.last = self.shown or now, now

    def close(self, done: int | None = None) -> None:
        """Ends the display: the prefill finished (done == total) or was interrupted (done None)."""
        self._cancel()
        with self.lock:
            if not self.shown:
                return
            if self.tty:
                self.stream.write("\r\x1b[K")
            elif done is not None:
                elapsed = max(time.perf_counter() - self.t0, 1e-9)
                self.stream.write(f"prefill {done:,}/{self.total:,} tokens, {done / elapsed:,.0f} tok/s, done\n")
            self.stream.flush()
            self.shown = 0.0

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def _duration(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def _run(model, session, prompt, args, stats: bool) -> tuple[str, str | None]:
    """Streams one reply to stdout. Returns (the text shown, None), or on Ctrl-C (the text shown, "prefill" or
    "reply": where it stopped). The stream is closed either way, so the session records what it holds."""
    last, out = None, []
    progress = PrefillProgress()
    stream = stream_generate(model, prompt, session=session, progress=progress,
                             enable_thinking=False if args.no_thinking else None, **_sampling(args))
    try:
        for r in stream:
            last = r  # first: Ctrl-C during the print is seen as print returns, with the text on the screen
            out.append(r.text)
            print(r.text, end="", flush=True)
    except KeyboardInterrupt:
        progress.close()
        stream.close()
        print(flush=True)
        return "".join(out), "prefill" if last is None else "reply"
    finally:
        progress.close()
    print()
    if stats and last is not None:
        print(f"[{model.backend} | prompt {last.prompt_tokens} tokens ({last.cached_tokens} cached) "
              f"{last.prompt_tps:.1f} tok/s | generated {last.generation_tokens} tokens {last.generation_tps:.1f} "
              f"tok/s | finish {last.finish_reason} | peak {last.peak_memory:.3f} GB]", file=sys.stderr)
    return "".join(out), None


def _session(model, args):
    return model.session(args.max_context, args.prefill_chunk)


def _no_template(model) -> str:
    where = model.path if model.path is not None else "the model"
    return (f"{where}: the checkpoint has no chat template (no chat_template.jinja, no chat_template in "
            "tokenizer_config.json)")


def cmd_generate(args) -> int:
    if args.raw and (args.system is not None or args.system_file is not None):
        raise ValueError("--raw feeds the prompt as is, without the chat template, so it takes no system prompt "
                         "(--system, --system-file)")
    _check_flags(args)
    _texts(args)
    model = _load(args)
    if args.raw:
        prompt = args.prompt
    elif model.tokenizer.chat_template is None:
        raise ValueError(f"{_no_template(model)}: use --raw to feed the prompt as is")
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + \
                 [{"role": "user", "content": args.prompt}]
    session = _session(model, args)
    _, interrupted = _run(model, session, prompt, args, stats=True)
    if interrupted == "prefill":
        print(f"lily: interrupted while reading the prompt ({session.core.position:,} tokens read)", file=sys.stderr)
    elif interrupted:
        print("lily: interrupted", file=sys.stderr)
    return 130 if interrupted else 0


def _read_line(prompt: str) -> str | None:
    """A line of input; None at EOF (Ctrl-D). KeyboardInterrupt passes through."""
    try:
        return input(prompt)
    except EOFError:
        print()
        return None


def _typed_before_interrupt() -> bool:
    """True when the line being edited held text at Ctrl-C (readline only; without it, Ctrl-C counts as empty)."""
    readline = sys.modules.get("readline")
    try:
        return bool(readline and readline.get_line_buffer().strip())
    except Exception:  # a readline replacement without get_line_buffer
        return False


def cmd_chat(args) -> int:
    _check_flags(args)
    _texts(args)
    model = _load(args)
    if model.tokenizer.chat_template is None:
        raise ValueError(f"{_no_template(model)}: lily chat needs one; `lily generate --raw` runs a prompt as is")
    if sys.stdin.isatty():
        import readline  # noqa: F401  line editing and history for input()
    session = _session(model, args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    print("Type a message; /help lists the commands, /exit (or Ctrl-D) leaves.", file=sys.stderr)
    armed = False  # Ctrl-C was pressed at an empty prompt: a second one leaves
    while True:
        try:
            line = _read_line(">> ")
        except KeyboardInterrupt:
            print(flush=True)
            if _typed_before_interrupt():
                armed = False
                continue
            if armed:
                return 0
            armed = True
            print("(to leave, press Ctrl-C again, or Ctrl-D, or type /exit)", file=sys.stderr)
            continue
        armed = False
        if line is None:
            return 0
        text = line.strip()
        if text in ("/exit", "/quit", "exit", "quit"):
            return 0
        if text == "/help":
            print(CHAT_HELP, file=sys.stderr)
            continue
        if text == "/reset":
            messages = list(system)
            session.reset()
            print("[conversation cleared" + (", system prompt kept]" if system else "]"), file=sys.stderr)
            continue
        if text.startswith("//"):
            line = line.lstrip()[1:]
        elif text.startswith("/"):
            print(f"unknown command {text.split()[0]!r}: /help lists the commands (to send a message that starts "
                  "with '/', begin it with '//')", file=sys.stderr)
            continue
        if not text:
            continue
        turn = messages + [{"role": "user", "content": line}]
        try:
            reply, interrupted = _run(model, session, turn, args, stats=args.stats)
        except ContextLimitError as e:  # refused before anything was read: the chat goes on
            print(f"lily: {e}\n[that message is dropped; /reset starts a new conversation]", file=sys.stderr)
            continue
        if interrupted == "prefill":
            print("[interrupted: that message is dropped; the next reply reads the conversation again]",
                  file=sys.stderr)
            continue
        kept = session.messages
        if interrupted and kept is not None and kept[:-1] == turn:  # the reply so far, as the session holds it
            rest = kept[-1]["content"][len(reply):] if kept[-1]["content"].startswith(reply) else ""
            if rest:
                print(rest, flush=True)
            reply = kept[-1]["content"]
        if interrupted:
            print("[interrupted: the reply so far stays in the conversation]", file=sys.stderr)
        messages = turn + [{"role": "assistant", "content": reply}]


def cmd_serve(args) -> int:
    from lily.server import serve

    if args.max_context is not None and args.max_context < 1:
        raise ValueError(f"--max-context must be at least 1, got {args.max_context}")
    model = _load(args)
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

    backend = resolve_backend(args.backend)
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else \
        (bench.ABLATION_LENGTHS if args.ablate else bench.LENGTHS)
    out = Path(args.out or f"lily-bench-{backend}{'-ablation' if args.ablate else ''}.json")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if args.ablate:
        bench.ablate(args.model, backend, lengths, args.decode_tokens, out, repeats=args.repeats)
    else:
        bench.run(args.model, backend, lengths, args.decode_tokens, args.budget, out, greedy_too=args.greedy,
                  repeats=args.repeats)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lily", description="Lily: an inference engine for Qwen3.6-35B-A3B")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a reply to one prompt")
    _common(g)
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt ('-': read it from standard input)")
    prompt.add_argument("--prompt-file", default=None, metavar="PATH", help="the prompt, read from a UTF-8 file")
    g.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive multi-turn chat that keeps its state between turns",
                       epilog=CHAT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(c)
    c.add_argument("--stats", action="store_true", help="print speeds after each reply")
    c.set_defaults(func=cmd_chat)
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat, completions, models, metrics)")
    s.add_argument("--model", required=True, help="checkpoint directory, Hugging Face id, or 'tiny'")
    s.add_argument("--backend", default=None, help=BACKEND_HELP)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    s.add_argument("--port", type=_port, default=8000, help="port (0: any free one; default 8000)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $LILY_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    s.add_argument("--max-context", type=int, default=None, help="context limit in tokens (default: the model's)")
    s.add_argument("--cache-gb", type=_gb, default=4.0, help="memory for prefix snapshots (default 4; 0: off)")
    s.add_argument("--cache-dir", default=None, help="keep prefix snapshots on disk here, across restarts")
    s.add_argument("--cache-dir-gb", type=_gb, default=32.0, help="disk budget of --cache-dir (default 32)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)
    b = sub.add_parser("bench", help="prefill and decode speed against context length (JSON + PNG plot)",
                       description="Times lily.stream_generate with the model's defaults at each prompt length: "
                       "prefill tok/s (prompt over time to first token) and steady decode tok/s.")
    b.add_argument("--model", default="tiny", help="checkpoint directory, Hugging Face id, 'tiny' (default), or "
                   "'random' (the full Qwen3.6-35B-A3B geometry with random 4-bit weights)")
    b.add_argument("--backend", default=None, help=BACKEND_HELP)
    b.add_argument("--lengths", default=None, help="comma-separated prompt lengths (default 256 … 131072)")
    b.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per length (default 64)")
    b.add_argument("--budget", type=float, default=600.0, help="start no new length after this many seconds")
    b.add_argument("--greedy", action="store_true", help="also time greedy decoding at each length")
    b.add_argument("--repeats", type=int, default=3, help="generations per length up to 32K, medians reported "
                   "(default 3; longer prompts run once)")
    b.add_argument("--ablate", action="store_true",
                   help="repeat 4K/32K/128K with each optimisation that acts on the backend off alone")
    b.add_argument("--out", default=None, help="JSON path (the PNG goes beside it)")
    b.set_defaults(func=cmd_bench)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"lily: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nlily: interrupted", file=sys.stderr)
        return 130
