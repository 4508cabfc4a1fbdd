"""Imported first by every Python process started with this folder on PYTHONPATH (``site``): an audit
hook (PEP 578) that refuses, and writes to ``$CLIPAMP_NET_LOG``, any name lookup or socket connect to
a host other than this machine's loopback."""

import os
import sys

_LOCAL = {None, "", "127.0.0.1", "::1", "localhost", "0.0.0.0", b"127.0.0.1", b"localhost"}


def _audit(event, args):
    if event == "socket.connect":
        address = args[1]
        host = address[0] if isinstance(address, tuple) else None  # AF_UNIX: a path
    elif event == "socket.getaddrinfo":
        host = args[0]
    else:
        return
    if host not in _LOCAL:
        with open(os.environ["CLIPAMP_NET_LOG"], "a") as f:
            f.write(f"{event} {host!r} pid {os.getpid()} {' '.join(sys.argv)[:200]}\n")
        raise ConnectionRefusedError(f"network audit: {event} to {host!r} refused")


if os.environ.get("CLIPAMP_NET_LOG"):
    sys.addaudithook(_audit)
