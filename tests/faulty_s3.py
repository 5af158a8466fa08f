"""A loopback proxy in front of the tests' S3 server that behaves like a busy S3: a seeded
share of requests answered 503 SlowDown or 500 InternalError (a HEAD with no body, as S3
answers it), some connections reset after the server acted (the write happened, the client
never heard), and storms in which every request is throttled.

Every process that reaches S3 through ``AWS_ENDPOINT_URL`` meets the faults, Ray's workers
included, so the proxy is started (and the variable set) before Ray starts. ``counts`` says
what it injected; ``faults`` turns the injection off and on (a fault-free run through the
same endpoint).
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_ERROR_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
    "<RequestId>faulty-s3</RequestId></Error>"
)
_FAULTS = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "internal": (500, "InternalError", "We encountered an internal error. Please try again."),
}


@dataclass
class FaultCounts:
    requests: int = 0
    slowdown: int = 0
    internal: int = 0
    resets: int = 0
    throttled_in_storms: int = 0

    @property
    def injected(self) -> int:
        return self.slowdown + self.internal + self.resets + self.throttled_in_storms


@dataclass
class FaultPlan:
    """What share of requests meets each fault (seeded), and storms of ``storm_s`` seconds
    that begin every ``storm_every`` requests (0: none)."""

    error_rate: float = 0.05
    reset_rate: float = 0.01
    storm_every: int = 0
    storm_s: float = 0.0
    seed: int = 0
    counts: FaultCounts = field(default_factory=FaultCounts)


class FaultyS3:
    def __init__(self, upstream: str, plan: FaultPlan | None = None):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.plan = plan or FaultPlan()
        self.faults = True
        self._rng = random.Random(self.plan.seed)
        self._lock = threading.Lock()
        self._storm_until = 0.0
        self._storm_matching = ""
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def counts(self) -> FaultCounts:
        return self.plan.counts

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FaultyS3:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def storm(self, seconds: float, matching: str = "") -> None:
        """Throttle every request for the next ``seconds`` (only those whose request line,
        ``PUT /bucket/key?partNumber=1...``, contains ``matching``)."""
        with self._lock:
            self._storm_until = time.monotonic() + seconds
            self._storm_matching = matching

    def _fault(self, request_line: str) -> str | None:
        """The fault for the next request (None: served as it is), drawn under the lock so a
        seed gives the same sequence of draws."""
        with self._lock:
            plan = self.plan
            plan.counts.requests += 1
            if not self.faults:
                return None
            if plan.storm_every and plan.counts.requests % plan.storm_every == 0:
                self._storm_until = time.monotonic() + plan.storm_s
            if time.monotonic() < self._storm_until and self._storm_matching in request_line:
                plan.counts.throttled_in_storms += 1
                return "storm"
            draw = self._rng.random()
            if draw < plan.reset_rate:
                plan.counts.resets += 1
                return "reset"
            if draw < plan.reset_rate + plan.error_rate:
                kind = "slowdown" if self._rng.random() < 0.6 else "internal"
                setattr(plan.counts, kind, getattr(plan.counts, kind) + 1)
                return kind
            return None

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet: the tests read counts, not logs
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _answer(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
                self.send_response(status)
                length = str(len(body))
                for name, value in headers:
                    if name.lower() == "content-length" and self.command == "HEAD":
                        length = value  # a HEAD's length is the object's, with no body sent
                    elif name.lower() not in ("transfer-encoding", "content-length", "connection", "date", "server"):
                        self.send_header(name, value)
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _error(self, kind: str) -> None:
                status, code, message = _FAULTS[kind]
                body = b"" if self.command == "HEAD" else _ERROR_BODY.format(code=code, message=message).encode()
                self._answer(status, [("Content-Type", "application/xml")], body)

            def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                    if body or self.command in ("PUT", "POST"):
                        headers["Content-Length"] = str(len(body))
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    return response.status, response.getheaders(), response.read()
                finally:
                    upstream.close()

            def _reset(self) -> None:
                # SO_LINGER 0: the close sends a RST, as a load balancer dropping the connection does.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True

            def _serve(self) -> None:
                body = self._body()
                fault = proxy._fault(f"{self.command} {self.path}")
                if fault == "storm":
                    self._error("slowdown")
                elif fault in _FAULTS:
                    self._error(fault)
                else:
                    answer = self._forward(body)
                    if fault == "reset":  # the server acted; the client never hears of it
                        self._reset()
                        return
                    self._answer(*answer)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _serve

        return Handler
