"""Runs an `Engine` on its own thread, for callers on other threads or an asyncio event loop.

    loop = EngineLoop(llm.engine())
    stream = loop.submit(prompt_ids, params)        # validated here: bad input raises at once
    for event in stream: ...                         # TokenEvents as tokens are produced
    out = stream.result()                            # the SampleOutput
    async for event in stream: ...                   # the same, from a coroutine
    loop.cancel(stream.request_id)                   # blocks are released at the next step
    loop.close()

The engine is only touched by the loop thread: submissions and cancellations are queued and
applied between steps. An exception inside a step fails the requests in flight (their streams
receive the error, their blocks are released) and the loop goes on serving new requests. Every
request gets exactly one final event and `on_done` call, however it ends: a consumer whose stream
cannot take events (an asyncio loop that was closed) has its request cancelled, a raising hook
is ignored, and a request submitted as the loop closes gets EngineLoopClosed.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator

from forklm.engine.engine import Engine
from forklm.engine.request import TokenEvent
from forklm.errors import ForkLMError
from forklm.outputs import SampleOutput
from forklm.sampling.params import SamplingParams


class EngineLoopClosed(ForkLMError):
    """The engine loop was closed; no new requests are accepted."""


class _Mailbox:
    """Events bound for one asyncio loop, handed over in one call per burst: the engine thread
    wakes the loop once per step, not once per token (each wake-up is a self-pipe write and a
    trip of the loop's thread through the GIL, which slowed the engine's steps in process)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, TokenEvent]] = []
        self._broken: BaseException | None = None

    def put(self, q: asyncio.Queue, event: TokenEvent) -> None:
        """Raises if the loop is closed."""
        with self._lock:
            if self._broken is not None:
                raise self._broken
            self._items.append((q, event))
            if len(self._items) > 1:
                return  # a hand-over is already scheduled and will take this one too
            try:
                self.loop.call_soon_threadsafe(self._hand_over)
            except Exception as exc:  # the loop is closed: nothing bound for it can arrive
                self._broken, self._items = exc, []
                raise

    def _hand_over(self) -> None:  # on the asyncio loop
        with self._lock:
            items, self._items = self._items, []
        for q, event in items:
            q.put_nowait(event)


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = weakref.WeakKeyDictionary()
_mailboxes_lock = threading.Lock()


def _mailbox_of(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    with _mailboxes_lock:
        box = _mailboxes.get(loop)
        if box is None:
            box = _mailboxes[loop] = _Mailbox(loop)
        return box


class RequestStream:
    """The events of one request, readable from any thread or from asyncio."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._events: queue.Queue[TokenEvent] = queue.Queue()
        self._aio: tuple[_Mailbox, asyncio.Queue] | None = None
        self._lock = threading.Lock()
        self._backlog: list[TokenEvent] = []
        self.output: SampleOutput | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._wants_tokens = True

    # called on the loop thread
    def _push(self, event: TokenEvent) -> None:
        """Raises if an attached asyncio loop is closed (the result is still set)."""
        if event.done:
            self.output, self.error = event.output, event.error
        try:
            with self._lock:
                if self._aio is not None:
                    box, q = self._aio
                    box.put(q, event)
                else:
                    self._events.put(event)
                    self._backlog.append(event)
        finally:
            if event.done:
                self._done.set()

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            event = self._events.get()
            if event.done:
                if event.error is not None:
                    raise event.error
                return
            yield event

    def _attach(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:  # events that arrived before we attached, then live ones
            for ev in self._backlog:
                q.put_nowait(ev)
            self._aio = (_mailbox_of(asyncio.get_running_loop()), q)
        return q

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        q = self._attach()
        while True:
            event = await q.get()
            if event.done:
                if event.error is not None:
                    raise event.error
                return
            yield event

    async def batches(self) -> AsyncIterator[list[TokenEvent]]:
        """Token events in lists of whatever has arrived (one engine step's, typically)."""
        q = self._attach()
        while True:
            batch = [await q.get()]
            while not q.empty():
                batch.append(q.get_nowait())
            tokens = [e for e in batch if not e.done]
            if tokens:
                yield tokens
            if len(tokens) < len(batch):
                if self.error is not None:
                    raise self.error
                return

    async def wait(self) -> SampleOutput:
        """The result, awaited from a coroutine."""
        async for _ in self.batches():
            pass
        return self.output

    def result(self, timeout: float | None = None) -> SampleOutput:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.output

    @property
    def done(self) -> bool:
        return self._done.is_set()


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        name: str = "forklm-engine",
        on_step: Callable[[Engine, float], None] | None = None,
        on_done: Callable[[TokenEvent], None] | None = None,
    ) -> None:
        """Hooks, run on the loop thread: on_step(engine, seconds) after every step, on_done(event)
        with every request's final event (output or error), however it ended."""
        self.engine = engine
        self.on_step = on_step
        self.on_done = on_done
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._closed = False
        self._lock = threading.Lock()  # `close` and the thread's exit cannot slip between a submit's check and put
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, events: bool = True
    ) -> RequestStream:
        """Queues a request; raises InvalidArgumentError at once if it can never run.
        events=False: the stream receives only the final event (less overhead when nobody streams)."""
        if self._closed:
            raise EngineLoopClosed("the engine loop is closed")
        self.engine.validate_request(prompt_ids, params)
        rid = request_id if request_id is not None else f"loop-{next(self._ids)}"
        stream = RequestStream(rid)
        stream._wants_tokens = events
        with self._lock:
            if self._closed:
                raise EngineLoopClosed("the engine loop is closed")
            self._inbox.put(("add", list(prompt_ids), params, stream))
        self._wake.set()
        return stream

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))
        self._wake.set()

    def close(self, timeout: float | None = 10.0) -> None:
        """Stops the thread; requests still in flight fail with EngineLoopClosed."""
        with self._lock:
            self._closed = True
            self._inbox.put(("close",))
        self._wake.set()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while self._drain_inbox():
                if not engine.has_unfinished():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                t0 = time.perf_counter()
                try:
                    engine.step()
                except Exception as exc:  # noqa: BLE001 - a failed step must not kill the server
                    self._fail_all(exc)
                if self.on_step is not None:
                    try:
                        self.on_step(engine, time.perf_counter() - t0)
                    except Exception:  # noqa: BLE001 - an observer must not stop the engine
                        pass
        finally:  # closed, or a bug in this loop: no request may wait forever
            with self._lock:
                self._closed = True
            closed = EngineLoopClosed("the engine loop was closed")
            self._fail_all(closed)
            while True:  # submissions queued before the close
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item[0] == "add":
                    stream = item[3]
                    self._deliver(stream)(TokenEvent(stream.request_id, done=True, error=closed))

    def _drain_inbox(self) -> bool:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if item[0] == "close":
                return False
            if item[0] == "cancel":
                self.engine.cancel(item[1])
                continue
            _, prompt_ids, params, stream = item
            deliver = self._deliver(stream)
            try:
                self.engine.add_request(prompt_ids, params, stream.request_id, on_event=deliver)
            except Exception as exc:  # noqa: BLE001 - InvalidArgumentError, or a bug: this request fails
                deliver(TokenEvent(stream.request_id, done=True, error=exc))

    def _deliver(self, stream: RequestStream) -> Callable[[TokenEvent], None]:
        """The engine's callback for one request; it never raises into the engine."""

        def deliver(event: TokenEvent) -> None:
            try:
                if event.done or stream._wants_tokens:
                    stream._push(event)
            except Exception:  # noqa: BLE001 - nobody can read this request any more: stop it
                if not event.done:
                    self._inbox.put(("cancel", stream.request_id))
            finally:
                if event.done and self.on_done is not None:
                    try:
                        self.on_done(event)
                    except Exception:  # noqa: BLE001 - a hook's failure must not cost the next request its call
                        pass

        return deliver

    def _fail_all(self, exc: BaseException) -> None:
        """Ends every request in flight with `exc`, releasing its blocks."""
        engine = self.engine
        for req in list(engine.waiting) + list(engine.active):
            callback, req.on_event = req.on_event, None
            try:
                engine.abort(req.request_id)
            except Exception:  # noqa: BLE001 - report the original error, not a follow-up
                pass
            if callback is not None:
                callback(TokenEvent(req.request_id, done=True, error=exc))
