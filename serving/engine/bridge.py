"""Between the engine's step loop and asyncio code: per-request output streams, and
`run_beside`, which keeps the step loop on the calling thread.

Which thread should run the step loop matters on CPU. GNU OpenMP (torch's intra-op threads)
counts the threads of every team in the process; once they outnumber the cores it stops letting
idle workers spin, so every parallel op pays a futex wake-up. A team started from a second thread
always brings the count over: the main thread plus the engine's team is `1 + cores`. Measured
on 2 cores, a decode step took 2x as long on a background thread as on the main thread, and it
slowed the main thread's torch work as much. So the server (`tessera serve`) runs the loop on
the main thread and its HTTP event loop on a helper thread; `run_beside(engine, coroutine)` does
the same for scripts. (`LLMEngine` still defaults to a background thread: convenient, and on a
GPU the device does the work.)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tessera.serving.types import GenerationOutput

if TYPE_CHECKING:
    from tessera.serving.engine import LLMEngine

T = TypeVar("T")


class Sink:
    """Where the step loop puts a request's outputs: the asyncio queue of its stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[GenerationOutput] = asyncio.Queue()

    def deliver(self, out: GenerationOutput) -> bool:
        """Hand `out` to the event loop (from any thread); False if the loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, out)
            return True
        except RuntimeError:
            return False


class RequestStream:
    """The async iterator `LLMEngine.generate` returns. Closing it (`aclose`), cancelling the
    task that awaits it, or dropping it unfinished aborts the request and frees its slot."""

    def __init__(self, request_id: str, sink: Sink, abort: Callable[[], None]):
        self.request_id = request_id
        self._sink, self._abort = sink, abort  # the engine never holds a reference to this
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> GenerationOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._sink.queue.get()
        except asyncio.CancelledError:
            self._cancel()
            raise
        if out.finished:
            self._done = True
        return out

    async def aclose(self) -> None:
        self._cancel()

    def _cancel(self) -> None:
        if not self._done:
            self._done = True
            self._abort()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self._abort()


def run_beside(engine: LLMEngine, work: Callable[[], Awaitable[T]]) -> T:
    """Run the coroutine `work()` on an event loop in a helper thread while `engine`'s step loop
    runs in the calling thread; return its result when it is done.

    The engine (built with `background=False`) keeps its state and can be used again."""
    if engine.background:
        raise RuntimeError("run_beside needs an engine built with background=False")
    done = threading.Event()
    outcome: dict[str, Any] = {}

    def client() -> None:
        try:
            outcome["value"] = asyncio.run(work())
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc
        finally:
            done.set()
            engine.wake()

    thread = threading.Thread(target=client, name="tessera-client", daemon=True)
    thread.start()
    engine.run(until=done)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    if not engine.alive and "value" not in outcome:
        raise RuntimeError("the engine stopped before the work was done")
    return outcome["value"]
