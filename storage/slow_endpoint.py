"""A slow and faulty object store, for rehearsals and benchmarks: an HTTP proxy in front of an S3
API endpoint that adds a fixed delay to every request — what a real object store costs per
request (~20 ms on S3), where a loopback endpoint costs almost nothing — counts the requests and
the body bytes it passes back, by method and path, and, given `fault_every`, answers every n-th
request with one of the faults an object store serves in a busy week, each about as often (`FAULTS`): 503
SlowDown, 400 RequestTimeout, a connection reset before the answer (for a PUT: after the target
stored it, a lost response), and a GET's body cut short at half its Content-Length.

    with SlowEndpoint("http://127.0.0.1:5555", delay=0.020) as proxy:
        storage.options = {"endpoint_url": proxy.url}
        ...
        proxy.gets("/bucket/data/")   # GETs of objects under that prefix (listings not counted)
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple
from urllib.parse import urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "te",
              "trailer", "upgrade"}


class Request(NamedTuple):
    method: str
    path: str  # without the query
    query: str
    bytes: int  # response body bytes


FAULTS = ("slow_down", "request_timeout", "reset", "truncated")
S3_ERRORS = {  # status, code, message of an S3 error answer
    "slow_down": (503, "SlowDown", "Please reduce your request rate."),
    "request_timeout": (400, "RequestTimeout", "Your socket connection to the server was not read from or written "
                                               "to within the timeout period."),
}


class SlowEndpoint:
    def __init__(self, target: str, delay: float = 0.020, fault_every: int = 0):
        parts = urlsplit(target)
        self.host, self.port, self.delay = parts.hostname, parts.port or 80, delay
        self.fault_every, self.seen = fault_every, 0
        self.injected: Counter[str] = Counter()  # faults served, by kind
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._local = threading.local()  # one keep-alive connection to the target per proxy thread
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> SlowEndpoint:
        threading.Thread(target=self.server.serve_forever, daemon=True, name="slow-endpoint").start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()

    def fault(self, method: str) -> str | None:
        """The fault to serve this request, if it is its turn: the kind served least so far (a
        truncated body only for a GET), so that each kind is served about as often whatever the
        order of the requests (a plain rotation skipped truncation whenever a PUT held its turn)."""
        if not self.fault_every:
            return None
        with self._lock:
            self.seen += 1
            if self.seen % self.fault_every:
                return None
            kinds = FAULTS if method == "GET" else FAULTS[:-1]
            kind = min(kinds, key=lambda k: (self.injected[k], FAULTS.index(k)))
            self.injected[kind] += 1
            return kind

    def gets(self, prefix: str = "/") -> list[Request]:
        """Object reads under `prefix` (a GET with no query: listings carry one)."""
        with self._lock:
            return [r for r in self.requests if r.method == "GET" and not r.query and r.path.startswith(prefix)]

    def _forward(self, method: str, path: str, headers: dict[str, str], body: bytes) -> http.client.HTTPResponse:
        for attempt in range(2):  # a kept-alive connection the target closed is opened again once
            connection = getattr(self._local, "connection", None)
            if connection is None:
                connection = self._local.connection = http.client.HTTPConnection(self.host, self.port, timeout=60)
            try:
                connection.request(method, path, body=body, headers=headers)
                return connection.getresponse()
            except (ConnectionError, http.client.HTTPException):
                connection.close()
                self._local.connection = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms delayed-ACK stall

            def log_message(self, *args) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _proxy(self) -> None:
                body = self._body()
                time.sleep(endpoint.delay)
                fault = endpoint.fault(self.command)
                if fault in S3_ERRORS:
                    return self._error(*S3_ERRORS[fault])
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                response = endpoint._forward(self.command, self.path, headers, body)
                data = response.read()
                if fault == "reset":  # the target did it (a PUT is stored): the answer is lost
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response(response.status, response.reason)
                for key, value in response.getheaders():
                    if key.lower() not in HOP_BY_HOP:
                        self.send_header(key, value)
                length = response.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data[: len(data) // 2] if fault == "truncated" else data)
                if fault == "truncated":  # the rest never comes
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                path, _, query = self.path.partition("?")
                with endpoint._lock:
                    endpoint.requests.append(Request(self.command, path, query, len(data)))

            def _error(self, status: int, code: str, message: str) -> None:
                xml = (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code><Message>{message}"
                       f"</Message></Error>").encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(xml) if self.command != "HEAD" else 0))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(xml)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _proxy

        return Handler
