"""Saying so when kernels compile: a first call can spend seconds compiling for this machine, and a user who
sees nothing thinks the library hangs.

Once a process has spent NOTICE_S compiling (one long kernel, or several short ones), one line goes to stderr
naming the kernel being compiled, the target and where compiled kernels are kept; after it, progress (kernels
compiled, seconds) rewrites one line on a terminal, or is printed every REPORT_S otherwise. Kernels found in
the cache or a kernel pack cost no compile and say nothing.

Silenced by ``TVM_MAMBA_QUIET=1``, or by the logging level of the ``tvm_mamba.compile`` logger
(``logging.getLogger("tvm_mamba.compile").setLevel(logging.WARNING)``): its level is INFO unless set.
The lines are written to ``sys.stderr`` directly (a library must not install logging handlers), only the
decision to write them follows the logger.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time

NOTICE_S = 1.0   # compile seconds in this process before the first line
REPORT_S = 5.0   # at most one progress line this often when stderr is not a terminal
ENV = "TVM_MAMBA_QUIET"
log = logging.getLogger("tvm_mamba.compile")
if log.level == logging.NOTSET:
    log.setLevel(logging.INFO)


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.spent = 0.0         # compile seconds so far (finished compiles)
        self.count = 0           # kernels compiled so far
        self.noticed = False     # the first line has been written
        self.reported = 0.0      # monotonic time of the last progress line


_state = _State()


def enabled() -> bool:
    return os.environ.get(ENV, "0") in ("", "0") and log.isEnabledFor(logging.INFO)


def _stream():
    return sys.stderr


def _write(text: str, end: str) -> None:
    try:
        _stream().write(text + end)
        _stream().flush()
    except (OSError, ValueError):  # a closed stderr: saying so is best effort
        pass


def _notice(name: str, target: str, where: str) -> None:
    with _state.lock:
        if _state.noticed or not enabled():
            return
        _state.noticed = True
        _state.reported = time.monotonic()
    _write(f"tvm_mamba: compiling kernels for {target} on first use (now {name}); compiled kernels are kept in "
           f"{where}, so later runs load them. {ENV}=1 silences this.", "\n")


def _progress(name: str, seconds: float) -> None:
    tty = getattr(_stream(), "isatty", lambda: False)()
    now = time.monotonic()
    with _state.lock:
        if not _state.noticed or not enabled() or (not tty and now - _state.reported < REPORT_S):
            return
        _state.reported = now
        count, spent = _state.count, _state.spent
    _write(f"tvm_mamba: compiled {count} kernel{'s' * (count != 1)} ({spent:.1f} s; last {name}, "
           f"{seconds:.1f} s)", "\r" if tty else "\n")


@contextlib.contextmanager
def compiling(name: str, target: str, where: str):
    """Around one kernel's compile: ``name`` (``ssd.chunk_scan``), ``target`` (``llvm-znver3``), ``where`` (the
    cache folder). Arms a timer for whatever is left of NOTICE_S, so a single long compile is announced while
    it runs, not after."""
    with _state.lock:
        left = NOTICE_S - _state.spent
        timer = None
        if not _state.noticed:
            timer = threading.Timer(max(left, 0.0), _notice, (name, target, where))
            timer.daemon = True
            timer.start()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
        seconds = time.perf_counter() - t0
        with _state.lock:
            _state.spent += seconds
            _state.count += 1
            crossed = not _state.noticed and _state.spent >= NOTICE_S
        if crossed:
            _notice(name, target, where)
        _progress(name, seconds)


def reset() -> None:
    """Forget what this process has compiled (tests; a new notice can then be written)."""
    global _state
    _state = _State()
