"""How a process under torchrun ends: its exit status, without the interpreter's teardown.

A rank that has left the process group (``Launch.close``) can still have a gloo worker thread
finishing its last collective: ``wait()`` returns on the main thread when the work completes, and
the worker destroys the work object a moment later. The work's saved thread-local state holds a
Python object, so that destructor takes the GIL; if the main thread has meanwhile entered
interpreter finalisation, CPython ends the worker thread there (``PyThread_exit_thread``), the
forced unwind meets a ``noexcept`` destructor, and the process aborts after the run has finished
(``terminate called without an active exception``, SIGABRT): torchrun then reports the job as
failed and stops the other ranks. pytorch#179291 describes the same race.

So a process under torchrun ends as ``multiprocessing`` ends the children it forks: it waits for
its other Python threads, runs the exit handlers (``atexit``: MLflow's, logging's), flushes
stdout and stderr, and leaves with ``os._exit(status)``, without finalisation. Meanwhile the main
thread releases the GIL as usual, so a worker can finish its destructor. No file the run writes
is open by then (steps.csv, checkpoints and the MLflow store close themselves when the run ends).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable


def exit_status(code: object) -> int:
    """The process exit status ``sys.exit(code)`` would give (a message is printed, as Python does)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run_then_leave(main: Callable[[], object]) -> None:
    """Run ``main()``, then end the process with its exit status and without interpreter teardown."""
    interrupted = False
    try:
        main()
        status = 0
    except SystemExit as e:
        status = exit_status(e.code)
    except BaseException as e:  # what Python prints for an uncaught exception, and its status
        traceback.print_exc()
        status, interrupted = 1, isinstance(e, KeyboardInterrupt)
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced by the user
            pass
    if interrupted:  # Python ends an uncaught Ctrl-C by dying of SIGINT, so that callers see the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)
