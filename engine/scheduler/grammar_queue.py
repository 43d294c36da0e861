"""Requests whose grammar is compiling: SGLang's grammar queue.

Compiling a JSON schema for a large vocabulary takes from tens of milliseconds to seconds
(and building the grammar backend, for the first such request, as long again). Done on the
scheduler's thread, that time is a pause in every running request's decoding. So a request
with a grammar waits here while a thread pool compiles it (xgrammar releases the GIL, so the
scheduler keeps stepping), and joins the waiting queue once its matcher is made; one whose
grammar does not compile, or takes longer than `timeout_s`, is rejected with the reason.
The backend itself is built by the first compilation, on a pool thread too. (SGLang builds
it at start-up; done here in the background at the worker's start, it changed the services'
timing enough to make a fault-injection system test fail two runs in three, for a reason
not found yet, so it is left to the first grammar request.)

Compiled grammars are kept (`cache_size` of them, least recently used out), so a request
whose grammar was compiled before gets its matcher at once and is never queued; requests
with a grammar that is compiling share its one compilation. `threads=0` compiles on the
caller's thread instead, in `submit` (a grammar error is then `submit`'s ValueError).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from engine.sampling.grammar_spec import grammar_spec

logger = logging.getLogger(__name__)

GRAMMAR_TIMEOUT_S = 300.0  # SGLang's default (SGLANG_GRAMMAR_TIMEOUT)
CACHE_SIZE = 256


class GrammarQueue:
    def __init__(
        self,
        make_backend: Callable[[], Any],
        threads: int = 1,
        timeout_s: float = GRAMMAR_TIMEOUT_S,
        cache_size: int = CACHE_SIZE,
    ) -> None:
        self._make_backend = make_backend
        self._backend: Any = None
        self._backend_lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(threads, "grammar") if threads > 0 else None
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._done: OrderedDict[tuple[str, str], Any] = OrderedDict()  # compiled or ValueError
        self._compiling: dict[tuple[str, str], cf.Future] = {}
        self._queue: list[tuple[Any, tuple[str, str], float]] = []  # (req, spec, deadline)

    def __len__(self) -> int:
        return len(self._queue)

    def reqs(self) -> list[Any]:
        """The requests waiting for their grammar."""
        return [req for req, _, _ in self._queue]

    def backend(self) -> Any:
        """The grammar backend, built on first use (by whichever thread needs it first)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def warm_up(self) -> cf.Future | None:
        """Build the backend now, on a compile thread (SGLang builds it at start-up: at a
        vocabulary of 152k tokens that takes ~0.6 s the first structured request would
        otherwise wait). A backend that cannot be built (no xgrammar) is left to fail where a
        request needs it."""
        return None if self._pool is None else self._pool.submit(self.backend)

    def submit(self, req: Any) -> bool:
        """Give `req` its grammar's matcher now (True) if the grammar is compiled, or queue
        it (False); ValueError if the grammar is known not to compile (inline, with
        `threads=0`, it is compiled here)."""
        spec = grammar_spec(req.sampling_params)
        assert spec is not None, "a request without a grammar"
        if spec not in self._done and self._pool is None:
            self._store(spec, self._compile(spec))
        if spec in self._done:
            self._done.move_to_end(spec)
            req.grammar = self.backend().matcher(_result(self._done[spec]))
            return True
        if spec not in self._compiling:
            self._compiling[spec] = self._pool.submit(self._compile, spec)
        self._queue.append((req, spec, time.monotonic() + self.timeout_s))
        return False

    def take_ready(self) -> tuple[list[Any], list[tuple[Any, str]]]:
        """(requests given their matcher, in arrival order; (request, why) rejected)."""
        finished = {}
        for spec, future in list(self._compiling.items()):
            if future.done():
                del self._compiling[spec]
                finished[spec] = future.result()
                self._store(spec, finished[spec])
        ready: list[Any] = []
        rejected: list[tuple[Any, str]] = []
        now, left = time.monotonic(), []
        for req, spec, deadline in self._queue:
            outcome = finished.get(spec, self._done.get(spec))
            if outcome is not None:
                if isinstance(outcome, ValueError):
                    rejected.append((req, str(outcome)))
                else:
                    req.grammar = self.backend().matcher(outcome)
                    ready.append(req)
            elif now >= deadline:
                rejected.append((req, f"the grammar did not compile in {self.timeout_s:g} s"))
            else:
                left.append((req, spec, deadline))
        self._queue = left
        return ready, rejected

    def remove(self, rid: str) -> Any | None:
        """Take the queued request `rid` out (an abort); None if it is not here."""
        for i, (req, _, _) in enumerate(self._queue):
            if req.rid == rid:
                return self._queue.pop(i)[0]
        return None

    def wait(self, timeout_s: float) -> None:
        """Block until a compilation ends or `timeout_s` passes (the scheduler has nothing
        else to do)."""
        if self._compiling:
            cf.wait(list(self._compiling.values()), timeout_s, cf.FIRST_COMPLETED)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: tuple[str, str]) -> Any:
        """The compiled grammar, or the ValueError saying why there is none."""
        try:
            return self.backend().compile(spec)
        except ValueError as exc:
            return exc
        except Exception as exc:  # a failure of the backend itself: the request's error
            logger.exception("compiling a %s grammar failed", spec[0])
            return ValueError(f"{spec[0]}: the grammar could not be compiled ({exc})")

    def _store(self, spec: tuple[str, str], outcome: Any) -> None:
        self._done[spec] = outcome
        self._done.move_to_end(spec)
        while len(self._done) > self.cache_size:
            self._done.popitem(last=False)


def _result(outcome: Any) -> Any:
    if isinstance(outcome, ValueError):
        raise ValueError(str(outcome))
    return outcome
