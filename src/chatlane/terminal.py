"""``chatlane chat``: a terminal conversation with a gateway's OpenAI-compatible API.

What stays true:

* Every line read is sent as one ``POST /v1/chat/completions`` with
  ``stream: true`` for the session named in ``X-Chatlane-Session``; the reply
  is printed piece by piece as the server-sent events arrive.
* Standard input is read by a daemon thread, so the event loop (and a reply
  that is streaming) never waits for the keyboard; input from a pipe or a file
  works the same and is sent strictly one line after the other.
* On a terminal, a line typed while a reply streams is sent at once (after the
  previous request was accepted, so the order is kept): ``/approve``,
  ``/stop`` and friends work mid-reply. When standard output is a terminal
  too, lines are read with an editor (:mod:`chatlane.terminal_prompt`:
  history, Ctrl-R, completion) whose prompt stays live under the replies.
* The user sees a message, never a traceback: HTTP errors print the gateway's
  message; an unreachable gateway or a refused token ends with status 1.
* Ctrl-C while replies are awaited stops the turn: their requests are
  cancelled and ``/stop`` is sent, and the prompt is back. At an idle prompt
  it exits with status 130; EOF and ``/quit`` exit with status 0. SIGTERM and
  SIGHUP end the conversation as Ctrl-C at an idle prompt does (status 143,
  129): the terminal's modes are put back and a ``--local`` gateway shuts down.
* A line the editor read with bytes that are no UTF-8 is sent with U+FFFD in
  their place, as a line read from a pipe is.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import getpass
import json
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import click
import httpx
import uvicorn

from chatlane.errors import ChatlaneError
from chatlane.identity import check_session_name
from chatlane.terminal_prompt import Command, Prompt, open_history

EXIT_INTERRUPTED = 130
_SESSION_CHARS = re.compile(r"[^A-Za-z0-9._@:+-]")
_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""Control characters (terminal escapes among them); tab and newline are kept."""


class GatewayUnreachable(ChatlaneError, ConnectionError):
    """No connection could be made to the gateway (wrong URL, not running, refused)."""


class InvalidToken(ChatlaneError, ValueError):
    """An access token with control characters cannot travel in a header."""


class TokenRefused(ChatlaneError, PermissionError):
    """The gateway answered HTTP 401: the access token is missing or wrong."""


def default_session() -> str:
    """``terminal-<user name>``, reduced to characters a header can carry."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):
        user = "user"
    return "terminal-" + (_SESSION_CHARS.sub("_", user)[:64] or "user")


def check_session(name: str) -> str:
    """``name`` if the gateway accepts it as a session name (it travels as UTF-8, unchanged).

    :raises ~chatlane.errors.InvalidSessionName: as :func:`~chatlane.identity.check_session_name`.
    """
    return check_session_name(name)


def check_token(token: str) -> str:
    """``token`` if it can travel in an ``Authorization`` header (sent as UTF-8).

    :raises InvalidToken: if it holds control characters (a stray newline, say).
    """
    if re.search(r"[\x00-\x1f\x7f]", token):
        raise InvalidToken("the access token holds control characters (a stray newline?)")
    return token


@dataclass(frozen=True)
class RemoteGateway:
    """A gateway reached over HTTP: where to send messages, and as which session and token."""

    url: str
    session: str
    token: str = ""

    def headers(self) -> dict[bytes, bytes]:
        """The session and token headers (the token travels as UTF-8)."""
        headers = {b"X-Chatlane-Session": self.session.encode(), b"Accept": b"text/event-stream"}
        if self.token:
            headers[b"Authorization"] = b"Bearer " + self.token.encode()
        return headers


@dataclass(frozen=True)
class StreamEvent:
    """One line of a reply stream, classified: reply text, a status line, an error, or the end."""

    text: str = ""
    status: str = ""
    error: str = ""
    done: bool = False


def parse_event(line: str) -> StreamEvent:
    """Classify one server-sent-events line; unknown fields and blank lines mean nothing."""
    if line.startswith(":"):
        return StreamEvent(status=line[1:].strip())
    if not line.startswith("data:"):
        return StreamEvent()
    data = line[5:].strip()
    if data == "[DONE]":
        return StreamEvent(done=True)
    try:
        payload = json.loads(data)
    except ValueError:
        return StreamEvent(error=f"the gateway sent an unreadable event: {data[:80]!r}")
    if isinstance(payload, dict) and payload.get("error") is not None:
        return StreamEvent(error=_error_text(payload["error"]) or "the gateway reported an error")
    return StreamEvent(text=_content(payload, "delta"))


def _content(payload: Any, field: str) -> str:
    """``payload.choices[0].<field>.content`` if it is text, else ``""``."""
    try:
        content = payload["choices"][0][field].get("content")
    except (KeyError, IndexError, TypeError, AttributeError):
        return ""
    return content if isinstance(content, str) else ""


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        error = error.get("message")
    return error if isinstance(error, str) else ""


def whole_reply(response: httpx.Response) -> StreamEvent:
    """A reply that came as one JSON completion rather than a stream."""
    try:
        return StreamEvent(text=_content(response.json(), "message"))
    except ValueError:
        return StreamEvent(error="the gateway sent an unreadable reply")


def _lists_models(response: httpx.Response) -> bool:
    """Whether ``response`` is a ``GET /v1/models`` answer: a JSON object with a ``data`` list."""
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("data"), list)


def response_error(response: httpx.Response) -> str:
    """The gateway's message for an HTTP error: its JSON ``error.message``, else the start
    of a plain-text body; a web page (another server at that address) is named as such,
    never printed."""
    try:
        message = _error_text(response.json().get("error"))
    except (ValueError, AttributeError):
        message = ""
    if not message and "html" in response.headers.get("content-type", "").lower():
        message = "a web page, not a chatlane gateway's answer"
    message = message or response.text.strip()[:200] or response.reason_phrase
    return f"{message} (HTTP {response.status_code})"


class Console:
    """Replies go to ``out``, status lines and errors to ``err``; a prompt only on a terminal.

    A reply's unfinished line is ended before anything else is printed, so
    concurrent replies and status lines never share a line.
    """

    def __init__(
        self,
        out: TextIO,
        err: TextIO,
        interactive: bool,
        *,
        redraw: Callable[[], None] | None = None,
    ) -> None:
        self.out = out
        self.err = err
        self.interactive = interactive
        self.own_prompt = interactive and redraw is None
        """Whether this console prints the prompt (not when an editor draws its own)."""
        self.prompting = False
        self._owner: object | None = None
        self._redraw = redraw
        self.partial = ""
        """With an editor: the reply's unfinished line, which the editor shows above its
        prompt (``redraw`` tells it to) until the line is complete and printed."""

    def prompt(self) -> None:
        """Show the prompt once (a terminal only); it is due again after the next line."""
        if self.own_prompt and not self.prompting:
            self._write(self.out, "> ")
            self.prompting = True

    def show(self, event: StreamEvent, owner: object) -> None:
        if event.text:
            self.chunk(event.text, owner)
        if event.status:
            self.status(event.status)
        if event.error:
            self.error(event.error)

    def chunk(self, text: str, owner: object) -> None:
        if self._owner is not owner:
            self.newline()
        if self._redraw is None:
            self._write(self.out, clean(text))
            self._owner = None if text.endswith("\n") else owner
            return
        *lines, self.partial = (self.partial + clean(text)).split("\n")
        if lines:
            self._write(self.out, "\n".join(lines) + "\n")
        self._owner = owner if self.partial else None
        self._redraw()

    def end(self, owner: object) -> None:
        """``owner``'s reply is complete: finish its line."""
        if self._owner is owner:
            self.newline()

    def status(self, text: str) -> None:
        self._aside()
        self._write(self.err, click.style(f"-- {clean(text)}", dim=True) + "\n")

    def error(self, text: str) -> None:
        self._aside()
        self._write(self.err, click.style(f"! {clean(text)}", fg="red", bold=True) + "\n")

    def _aside(self) -> None:
        """Make room for a line that is not reply text: end the reply's unfinished line,
        unless the editor shows it (then the line goes above it, and it goes on)."""
        if self._redraw is None:
            self.newline()

    def newline(self) -> None:
        """End the unfinished reply line, if any."""
        if self._owner is None:
            return
        self._write(self.out, self.partial + "\n")
        self._owner = None
        if self._redraw is not None:
            self.partial = ""
            self._redraw()

    def interrupted(self) -> None:
        """Ctrl-C cancelled the replies in flight (the terminal echoed ``^C`` mid-line)."""
        if self._owner is None and self.own_prompt:
            self._write(self.out, "\n")
        self.status("Ctrl-C: stopping the turn (/stop)")

    def leave(self) -> None:
        """The conversation ends: the shell's prompt starts on a line of its own."""
        self.newline()
        if self.own_prompt:
            self._write(self.out, "\n")

    def _write(self, stream: TextIO, text: str) -> None:
        encoding = getattr(stream, "encoding", None) or "utf-8"
        click.echo(text.encode(encoding, "replace").decode(encoding), file=stream, nl=False)


def clean(text: str) -> str:
    """``text`` without control characters, so a reply cannot drive the terminal."""
    return _UNSAFE.sub("", text)


class Eof:
    """Standard input ended."""


class Interrupt:
    """Ctrl-C at an idle prompt."""


class Idle:
    """A request finished; the prompt may be due."""


@dataclass(frozen=True)
class Hangup:
    """The process was told to end (SIGTERM) or its terminal went away (SIGHUP): the
    conversation ends now, with ``code``, as Ctrl-C at an idle prompt ends it (the
    terminal's modes put back, a ``--local`` gateway shut down)."""

    code: int


@dataclass(frozen=True)
class Fatal:
    """The conversation cannot go on."""

    error: ChatlaneError


Event = str | Eof | Interrupt | Idle | Fatal | Hangup


def start_reader(fd: int, events: asyncio.Queue[Event]) -> threading.Thread:
    """Read lines from ``fd`` in a daemon thread and queue them, then :class:`Eof`.

    ``os.read`` holds no Python-level lock, so an abandoned reader never blocks
    the interpreter's exit.
    """
    loop = asyncio.get_running_loop()

    def put(item: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody listens
            loop.call_soon_threadsafe(events.put_nowait, item)

    thread = threading.Thread(
        target=_read_lines, args=(fd, put), name="chatlane-stdin", daemon=True
    )
    thread.start()
    return thread


def _well_formed(line: str) -> str:
    """``line`` as the editor read it, each byte that was no UTF-8 (kept as a lone surrogate)
    a U+FFFD, as :func:`_read_lines` reads a pipe: no request could carry it."""
    try:
        raw = line.encode("utf-8", "surrogateescape")  # the bytes the terminal sent
    except UnicodeEncodeError:  # a lone surrogate no byte stands for
        raw = line.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "replace")


def _read_lines(fd: int, put: Callable[[Event], None]) -> None:
    """Every line of ``fd`` (undecodable bytes become U+FFFD), then :class:`Eof`."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    pending, data = "", b"start"
    while data:
        try:
            data = os.read(fd, 65536)
        except OSError:  # closed or unreadable: the same as its end
            data = b""
        pending += decoder.decode(data, final=not data)
        *lines, pending = pending.split("\n")
        for line in lines:
            put(line.rstrip("\r"))
    if pending:
        put(pending)
    put(Eof())


class Chat:
    """The prompt loop: lines in, streamed replies out."""

    def __init__(self, gateway: RemoteGateway, http: httpx.AsyncClient, console: Console) -> None:
        self.gateway = gateway
        self.http = http
        self.console = console
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.inflight: set[asyncio.Task[None]] = set()
        self._order = asyncio.Lock()

    async def run(
        self, stdin_fd: int, editor: Callable[[Chat], Awaitable[Prompt]] | None = None
    ) -> int:
        """Talk until EOF, ``/quit``, Ctrl-C at the prompt, or a fatal error; the exit status.

        :param editor: makes the prompt that reads the lines (else ``stdin_fd`` is read
            as it comes); it is made once the gateway answered, with its commands.
        """
        await self.probe()
        reading = None
        if editor is None:
            start_reader(stdin_fd, self.events)
        else:
            reading = asyncio.create_task(self._edit(await editor(self)))
        self.console.prompt()
        try:
            while True:
                code = await self.handle(await self.events.get())
                if code is not None:
                    return code
        finally:
            if reading is not None:
                reading.cancel()
            await self.cancel()

    async def _edit(self, prompt: Prompt) -> None:
        """Queue the lines ``prompt`` reads, then :class:`Eof` or :class:`Interrupt`."""

        def put(line: str | None) -> None:
            self.events.put_nowait(Eof() if line is None else _well_formed(line))

        try:
            await prompt.until_closed(put)
        except KeyboardInterrupt:
            self.events.put_nowait(Interrupt())

    async def commands(self) -> list[Command]:
        """The slash commands the gateway knows (none if it does not say)."""
        try:
            response = await self.http.get(
                self._url("/admin/commands"), headers=self.gateway.headers()
            )
            listed = response.json()["commands"] if response.status_code == 200 else []
            return [Command(str(item["name"]), str(item.get("summary", ""))) for item in listed]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return []

    async def probe(self) -> None:
        """Fail early if the gateway is unreachable or refuses the token.

        :raises GatewayUnreachable: if no connection can be made.
        :raises TokenRefused: on HTTP 401.
        """
        try:
            port = httpx.URL(self.gateway.url).port
            if port is not None and not 0 < port < 65536:
                raise httpx.InvalidURL(f"port {port} is not between 1 and 65535")
            response = await self.http.get(self._url("/v1/models"), headers=self.gateway.headers())
        except (httpx.HTTPError, httpx.InvalidURL) as error:
            raise self.unreachable(error) from None
        if response.status_code == 401:
            raise TokenRefused(response_error(response))
        if response.status_code != 200 or not _lists_models(response):
            raise GatewayUnreachable(
                f"no chatlane gateway answers at {self.gateway.url} ({response_error(response)}); "
                "--url is the gateway's base URL, such as http://127.0.0.1:8080"
            )

    async def handle(self, event: Event) -> int | None:
        """Act on one event; an exit status ends the conversation."""
        if isinstance(event, str):
            return await self.on_line(event.strip())
        if isinstance(event, Fatal):
            self.console.error(str(event.error))
            return 1
        if isinstance(event, Eof):
            await self.drain()
            self.console.leave()
            return 0
        if isinstance(event, Interrupt):
            self.console.leave()
            return EXIT_INTERRUPTED
        if isinstance(event, Hangup):
            with contextlib.suppress(OSError):  # the terminal may be gone
                self.console.leave()
            return event.code
        if not self.inflight:
            self.console.prompt()
        return None

    async def on_line(self, text: str) -> int | None:
        self.console.prompting = False
        if text == "/quit":
            return 0
        if not text:
            if not self.inflight:
                self.console.prompt()
            return None
        task = self.submit(text)
        if not self.console.interactive:
            await asyncio.wait({task})
        return None

    def submit(self, text: str) -> asyncio.Task[None]:
        """Send ``text`` (after the requests before it were accepted) and print its reply."""
        task = asyncio.create_task(self.exchange(text))
        self.inflight.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[None]) -> None:
        self.inflight.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:  # a bug: say so rather than wait forever
            self.events.put_nowait(Fatal(ChatlaneError(f"the terminal client failed: {error!r}")))
        self.events.put_nowait(Idle())

    def hang_up(self, signum: int) -> None:
        """SIGTERM or SIGHUP: leave now (:class:`Hangup`)."""
        self.events.put_nowait(Hangup(128 + signum))

    def interrupt(self) -> None:
        """Ctrl-C: stop the turn if replies are awaited, else leave."""
        if self.inflight:
            self.stop()
        else:
            self.events.put_nowait(Interrupt())

    def stop(self) -> None:
        """Stop awaiting the replies in flight, and send ``/stop`` to stop the turn."""
        for task in self.inflight:
            task.cancel()
        self.console.interrupted()
        self.submit("/stop")

    async def drain(self) -> None:
        if self.inflight:
            await asyncio.wait(set(self.inflight))

    async def cancel(self) -> None:
        for task in self.inflight:
            task.cancel()
        await self.drain()

    async def exchange(self, text: str) -> None:
        """Send ``text`` and print its reply; fatal conditions become :class:`Fatal` events."""
        try:
            async with self._order:
                response = await self.send(text)
            try:
                await self.show(response, owner=object())
            finally:
                await response.aclose()
        except (GatewayUnreachable, TokenRefused) as error:
            self.events.put_nowait(Fatal(error))
        except httpx.HTTPError as error:
            self.console.error(f"the connection to the gateway broke: {error or type(error)}")

    async def send(self, text: str) -> httpx.Response:
        message = {"role": "user", "content": text}
        body = {"model": "chatlane", "stream": True, "messages": [message]}
        url = self._url("/v1/chat/completions")
        request = self.http.build_request("POST", url, json=body, headers=self.gateway.headers())
        try:
            return await self.http.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            raise self.unreachable(error) from None

    async def show(self, response: httpx.Response, owner: object) -> None:
        """Print one response: a streamed reply, a whole JSON reply, or an error."""
        if response.status_code == 401:
            await response.aread()
            raise TokenRefused(response_error(response))
        if response.status_code != 200:
            await response.aread()
            self.console.error(response_error(response))
            return
        if "text/event-stream" in response.headers.get("content-type", ""):
            await self.stream(response, owner)
        else:
            await response.aread()
            self.console.show(whole_reply(response), owner)
        self.console.end(owner)

    async def stream(self, response: httpx.Response, owner: object) -> None:
        """Print server-sent events as they arrive, up to ``[DONE]``."""
        async for line in response.aiter_lines():
            event = parse_event(line)
            if event.done:
                return
            self.console.show(event, owner)

    def unreachable(self, error: Exception) -> GatewayUnreachable:
        return GatewayUnreachable(f"cannot reach the gateway at {self.gateway.url}: {error}")

    def _url(self, path: str) -> str:
        return self.gateway.url.rstrip("/") + path


@contextlib.contextmanager
def on_signals(chat: Chat) -> Iterator[None]:
    """Route Ctrl-C to :meth:`Chat.interrupt`, and SIGTERM and SIGHUP to
    :meth:`Chat.hang_up`, while the conversation runs: killed by their default action, the
    client would leave the terminal in raw mode and a ``--local`` gateway's lease held."""
    loop = asyncio.get_running_loop()
    handled: dict[signal.Signals, Callable[[], None]] = {
        signal.SIGINT: chat.interrupt,
        signal.SIGTERM: partial(chat.hang_up, signal.SIGTERM),
        signal.SIGHUP: partial(chat.hang_up, signal.SIGHUP),
    }
    added: list[signal.Signals] = []
    try:
        for signum, handler in handled.items():
            loop.add_signal_handler(signum, handler)
            added.append(signum)
    except (NotImplementedError, RuntimeError, ValueError):  # no signals here: the defaults
        pass
    try:
        yield
    finally:
        for signum in added:
            loop.remove_signal_handler(signum)


async def converse(
    gateway: RemoteGateway,
    stdin_fd: int = 0,
    out: TextIO | None = None,
    err: TextIO | None = None,
    *,
    history: Path | None = None,
) -> int:
    """Run one terminal conversation with ``gateway``; the exit status.

    With a terminal on ``stdin_fd`` and on standard output (and ``out`` and
    ``err`` not given), lines are read with the editor of
    :mod:`chatlane.terminal_prompt`, its history kept in ``history`` (default:
    :func:`~chatlane.config.chat_history_path`).

    :raises GatewayUnreachable: if the gateway cannot be reached at the start.
    :raises TokenRefused: if the gateway refuses the token at the start.
    """
    interactive = os.isatty(stdin_fd)
    if interactive and out is None and err is None and sys.stdout.isatty():
        return await _converse_edited(gateway, stdin_fd, history)
    console = Console(out or sys.stdout, err or sys.stderr, interactive)
    async with _client() as http:
        chat = Chat(gateway, http, console)
        with on_signals(chat):
            return await chat.run(stdin_fd)


async def _converse_edited(gateway: RemoteGateway, stdin_fd: int, history: Path | None) -> int:
    """:func:`converse` with the editor's prompt, live under the replies."""
    from prompt_toolkit.application import get_app_or_none
    from prompt_toolkit.patch_stdout import patch_stdout

    from chatlane.config import chat_history_path

    def redraw() -> None:
        app = get_app_or_none()
        if app is not None:
            app.invalidate()

    kept, problem = open_history(history or chat_history_path())
    async with _client() as http:
        with patch_stdout(raw=True):
            console = Console(sys.stdout, sys.stderr, True, redraw=redraw)
            chat = Chat(gateway, http, console)

            async def editor(chat: Chat) -> Prompt:
                if problem:
                    console.status(problem)
                return Prompt(
                    kept,
                    await chat.commands(),
                    busy=lambda: bool(chat.inflight),
                    stop=chat.stop,
                    above=lambda: console.partial,
                )

            with on_signals(chat):
                return await chat.run(stdin_fd, editor)


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None))


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves Ctrl-C to the conversation."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    with contextlib.suppress(SystemExit):  # uvicorn's way to report a failed startup
        await server.serve(sockets=[sock])


async def _started(server: uvicorn.Server, task: asyncio.Task[None]) -> None:
    """Wait until ``server`` accepts connections.

    :raises ChatlaneError: if it stopped before that (its log says why).
    """
    while not server.started:
        if task.done():
            raise ChatlaneError("the local gateway failed to start (see the log above)")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def local_gateway(
    store_url: str, config_path: str | None = None
) -> AsyncIterator[tuple[str, str]]:
    """An in-process gateway (configured agent, API adapter) on a free loopback port.

    Yields its URL and access token; on exit it shuts down like ``chatlane serve``.
    Its secrets are read once, here (:func:`~chatlane.secrets.resolve_secrets`).

    :raises ChatlaneError: for a bad configuration, secret or store, or a failed start.
    """
    from chatlane.adapters.api import ApiAdapter
    from chatlane.config import load_config
    from chatlane.hub import build_app, open_hub
    from chatlane.secrets import resolve_secrets

    config = load_config(config_path)
    secrets = resolve_secrets(config)
    hub = await open_hub(config, store_url, secrets=secrets)
    hub.add(ApiAdapter(config, access=hub.access, secrets=secrets))
    app = build_app(hub)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        server = _QuietServer(uvicorn.Config(app, lifespan="on", log_level="warning"))
        task = asyncio.create_task(_serve(server, sock))
        try:
            await _started(server, task)
            yield f"http://127.0.0.1:{sock.getsockname()[1]}", secrets.access_token.value
        finally:
            server.should_exit = True
            await task
            if not server.started:
                await hub.store.close()


async def run_chat(
    url: str, session: str, token: str, local_store: str | None, config_path: str | None = None
) -> int:
    """``chatlane chat``: talk to the gateway at ``url``, or to a local one with this store
    (configured from ``config_path`` and the environment, as ``chatlane serve`` is).

    :raises ChatlaneError: if the conversation cannot start (see :func:`converse`).
    """
    if local_store is None:
        return await converse(RemoteGateway(url, session, token))
    async with local_gateway(local_store, config_path) as (local_url, local_token):
        return await converse(RemoteGateway(local_url, session, token or local_token))
