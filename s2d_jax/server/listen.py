"""The server's listening socket, bound before anything loads: a port in use or a host that
is not this machine's is one clear S2DError at once, not a uvicorn log line after minutes
of compiling. uvicorn then serves on this socket (uvicorn.Server.run(sockets=...)).
"""

from __future__ import annotations

import errno
import socket

from s2d_jax.errors import S2DError

BACKLOG = 2048  # uvicorn's default


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening (port 0: a free one; its number in
    getsockname()). Connections made while the server warms up wait in the backlog and
    are answered once it serves."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    # as uvicorn binds: IPv6 for an address with colons, SO_REUSEADDR so that a restart
    # does not wait for the last run's connections to leave TIME_WAIT
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                         socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)  # what fails when another server listens on it too
    except OSError as e:
        sock.close()
        raise S2DError(f"cannot listen on {where}: {_why(e, host, port)}") from None
    sock.set_inheritable(True)
    return sock


def _why(e: OSError, host: str, port: int) -> str:
    if isinstance(e, socket.gaierror):
        return (f"the host {host!r} does not resolve to an address ({e.strerror}); pass "
                f"--host 127.0.0.1 (this machine only), 0.0.0.0 (every interface) or one of "
                f"its addresses")
    if e.errno == errno.EADDRINUSE:
        return (f"port {port} is in use (another server?); stop it, or pass another --port "
                f"(0: any free port)")
    if e.errno == errno.EADDRNOTAVAIL:
        return (f"{host} is not an address of this machine; pass --host 127.0.0.1 (this "
                f"machine only), 0.0.0.0 (every interface) or one of its addresses")
    if e.errno == errno.EACCES:
        return f"port {port} needs privileges (ports below 1024); pass a --port >= 1024"
    return f"{e.strerror or e}; check --host and --port"
