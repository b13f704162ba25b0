"""The ingress replica's own HTTP listener (`ingress.direct_http_port`): uvicorn in the
replica's event loop on a socket with SO_REUSEPORT, serving the same FastAPI app that
Serve's HTTP proxy forwards to. A request then reaches the ingress without a Ray hop,
and its SSE events go straight to the client's socket instead of each being a Ray
message to the proxy. Every ingress replica of a node binds the same port (the kernel
spreads connections over them); a stopping replica closes its socket first, so new
connections go to the others while its own streams finish.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)

BACKLOG = 2048


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) that other processes may bind as well."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


class DirectHTTP:
    """Serves `app` on (host, port) from the running event loop until `stop`."""

    def __init__(self, app: Any, host: str, port: int, drain_s: float) -> None:
        self._socket = reuse_port_socket(host, port)
        config = uvicorn.Config(
            app,
            lifespan="off",
            access_log=False,
            log_config=None,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=drain_s,
        )
        self._server = uvicorn.Server(config)
        self._task = asyncio.get_running_loop().create_task(
            self._server.serve(sockets=[self._socket])
        )
        logger.info("ingress serving HTTP itself on %s:%d", host, port)

    async def aclose(self) -> None:
        """Stops taking connections and waits, up to the drain time, for the streams
        in flight to end."""
        self._server.should_exit = True
        await asyncio.shield(self._task)
