"""horovodrun's gloo-mode launch environment, for launching ranks without Horovod installed.

``horovodrun`` (gloo mode, ``horovod/runner/gloo_run.py`` of Horovod 0.28)
starts an HTTP key-value server in the launcher for the job's lifetime and
runs every rank with ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``,
``HOROVOD_LOCAL_SIZE``, ``HOROVOD_CROSS_RANK``, ``HOROVOD_CROSS_SIZE``,
``HOROVOD_HOSTNAME`` and the server's address in
``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``HOROVOD_GLOO_RENDEZVOUS_PORT``
(plus ``HOROVOD_CONTROLLER=gloo``, ``HOROVOD_CPU_OPERATIONS=gloo``,
``HOROVOD_GLOO_IFACE``, ``NCCL_SOCKET_IFNAME``).  :class:`RendezvousServer`
speaks that server's protocol (``PUT``/``GET``/``DELETE /<scope>/<key>``, 404
while a key is absent) and :func:`horovodrun_env` makes one rank's variables,
so a script, a test or ``scripts/horovod_suite --horovod-env`` can launch
ranks exactly as horovodrun would, on one machine.  ``dearopt.init()`` reads
the variables and meets its peers through the server.
"""

from __future__ import annotations

import http.server
import socketserver
import threading
from typing import Dict, Optional

__all__ = ["RendezvousServer", "horovodrun_env"]


class _Handler(http.server.BaseHTTPRequestHandler):
    timeout = 3  # seconds per request, as Horovod's server

    def _parts(self):
        parts = self.path.split("/")
        if len(parts) != 3:
            self._status(400)
            return None
        return parts[1], parts[2]

    def _status(self, code: int, body: bytes = b"") -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def do_GET(self):  # noqa: N802 (http.server's naming)
        parts = self._parts()
        if parts is None:
            return
        with self.server.lock:
            value = self.server.cache.get(parts[0], {}).get(parts[1])
        if value is None:
            self._status(404)
        else:
            self._status(200, value)

    def do_PUT(self):  # noqa: N802
        parts = self._parts()
        if parts is None:
            return
        value = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.server.lock:
            self.server.cache.setdefault(parts[0], {})[parts[1]] = value
        self._status(200)

    def do_DELETE(self):  # noqa: N802
        parts = self._parts()
        if parts is None:
            return
        with self.server.lock:
            scope = self.server.cache.get(parts[0], {})
            scope.pop(parts[1], None)
            if not scope:
                self.server.cache.pop(parts[0], None)
        self._status(200)

    def log_message(self, format, *args):  # noqa: A002 (http.server's signature): silent
        pass


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class RendezvousServer:
    """horovodrun's HTTP key-value rendezvous server, in a thread of this process.

    ``with RendezvousServer() as server: ...`` serves on ``server.addr``,
    ``server.port`` (a free port unless one is given) until the block ends.
    Keys are kept in memory per scope.
    """

    def __init__(self, addr: str = "127.0.0.1", port: int = 0):
        self._httpd = _Server((addr, port), _Handler)
        self._httpd.lock = threading.Lock()
        self._httpd.cache = {}
        self.addr, self.port = self._httpd.server_address[:2]
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "RendezvousServer":
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._httpd.serve_forever, name="horovod-rendezvous", kwargs={"poll_interval": 0.1}, daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def keys(self, scope: str):
        """The keys stored under ``scope`` now."""
        with self._httpd.lock:
            return sorted(self._httpd.cache.get(scope, {}))

    def __enter__(self) -> "RendezvousServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def horovodrun_env(
    rank: int,
    size: int,
    server: RendezvousServer,
    local_size: Optional[int] = None,
    hostname: str = "localhost",
    iface: str = "lo",
) -> Dict[str, str]:
    """The variables horovodrun's gloo mode gives rank ``rank`` of ``size`` (``local_size`` per machine,
    placed contiguously: machine ``rank // local_size``; default all on one machine)."""
    local_size = size if local_size is None else local_size
    if not (0 <= rank < size and 0 < local_size and size % local_size == 0):
        raise ValueError(f"rank {rank} of {size} with {local_size} per machine is not a horovodrun placement")
    return {
        "HOROVOD_HOSTNAME": hostname if local_size == size else f"{hostname}-{rank // local_size}",
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(rank % local_size),
        "HOROVOD_LOCAL_SIZE": str(local_size),
        "HOROVOD_CROSS_RANK": str(rank // local_size),
        "HOROVOD_CROSS_SIZE": str(size // local_size),
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": str(server.addr),
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(server.port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": iface,
        "NCCL_SOCKET_IFNAME": iface,
        "PYTHONUNBUFFERED": "1",
    }
