"""ShardServer: a static file server on 127.0.0.1 (http.server in a thread) with HTTP Range support, per-request
latency and injectable faults (a connection dropped mid-body, corrupt bytes, an error status). It logs every request.

Used by `tools/benchmark.py data --remote-latency-ms` (object storage with a round-trip time) and by the remote-data
tests (faults, request counts).
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class ShardServer:
    """Serves `root` at http://127.0.0.1:PORT/; `requests` lists (method, path, range header or None)."""

    def __init__(self, root: Path, latency_s: float = 0.0):
        self.root = Path(root)
        self.latency_s = latency_s
        self.drop: dict[str, int] = {}  # path -> which GET of it (1-based) sends half its body, then closes
        self.corrupt: set[str] = set()  # paths served with one byte flipped
        self.status: dict[str, int] = {}  # path -> an error status answered instead of the file (403, 503, ...)
        self.requests: list[tuple[str, str, str | None]] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(head=True)

            def do_GET(self) -> None:
                self._serve(head=False)

            def _serve(self, head: bool) -> None:
                path = self.path.split("?")[0]
                rng = self.headers.get("Range")
                with server._lock:
                    server.requests.append((self.command, path, rng))
                if server.latency_s:
                    time.sleep(server.latency_s)
                file = server.root / path.lstrip("/")
                if path in server.status or not file.is_file():
                    self.send_response(server.status.get(path, 404))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = file.read_bytes()
                if path in server.corrupt and data:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                start, end, status = 0, len(data), 200
                if rng and rng.startswith("bytes="):
                    a, _, b = rng[len("bytes=") :].partition("-")
                    start, end, status = int(a), min(len(data), int(b) + 1 if b else len(data)), 206
                body = data[start:end]
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                self.end_headers()
                if head:
                    return
                with server._lock:
                    nth = sum(1 for m, p, _ in server.requests if m == "GET" and p == path)
                    drop = server.drop.get(path) == nth and len(body) > 1
                if drop:  # half the promised body, then a dead connection
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def gets(self, path: str) -> list[str | None]:
        """Range headers of every GET of `path`."""
        with self._lock:
            return [r for m, p, r in self.requests if m == "GET" and p == path]

    def __enter__(self) -> ShardServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=10)
