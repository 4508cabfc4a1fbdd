"""How a process under torchrun ends: its exit status, without the interpreter's teardown.

A rank that has left the process group (``Launch.close``) still holds gloo's C++ threads: the
group's worker and TCP-loop threads outlive ``destroy_process_group``, whose C++ object is still
referenced when Python starts to tear itself down. Rarely, a rank then aborts *after* its last line
of Python ran (``terminate called without an active exception``, SIGABRT, no Python frame on any
thread): torchrun reports a finished job as failed and stops the other ranks. A two-process gloo
script with nothing of clipamp in it (DDP steps, ``barrier``, ``destroy_process_group``, exit)
does it too; the same class of abort in interpreter finalisation is described in pytorch#179291.

So a process under torchrun ends as ``multiprocessing`` ends the children it forks: it waits for
its other Python threads, runs the exit handlers (``atexit``: MLflow's, logging's), flushes
stdout and stderr, and leaves with ``os._exit(status)``. What that skips is the teardown of
modules and C++ static objects, where the abort happens; no file the run writes is open by then
(steps.csv, checkpoints and the MLflow store close themselves when the run ends).
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
