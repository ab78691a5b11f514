"""Binding the server's port first, before anything slow is imported: from then on a connection waits in the
kernel's backlog until the server answers, instead of being refused; a port in use is a one-line error."""
from __future__ import annotations

import errno
import socket

from ..errors import WasteError


def bind(host: str, port: int, backlog: int = 2048) -> socket.socket:
    if not 0 <= port <= 65535:
        raise WasteError(f"--port must be 0 to 65535, not {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise WasteError(f"port {port} on {host} is in use (another `waste serve`?): stop it or choose another "
                             "--port") from None
        if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
            raise WasteError(f"cannot listen on {host}: not an address of this machine (--host)") from None
        raise WasteError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock
