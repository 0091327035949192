"""An OTLP/HTTP trace endpoint that accepts every export and drops it: the collector for
measuring what tracing costs the router (docs/benchmarks.md, "Tracing")::

    python bench/otlp_sink.py 4318 &
    KVROUTER_TRACING_ENABLED=true KVROUTER_TRACING_ENDPOINT=http://127.0.0.1:4318/v1/traces \\
        python bench/proxy_bench.py

On SIGTERM or SIGINT it prints one JSON line: the exports and bytes it received, so a run
whose router exported nothing is told apart from a cheap one.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

received = {"exports": 0, "bytes": 0}
_lock = threading.Lock()


class _Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a collector serves the exporter

    def do_POST(self) -> None:
        n = int(self.headers.get("content-length", "0"))
        self.rfile.read(n)
        with _lock:
            received["exports"] += 1
            received["bytes"] += n
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def main() -> None:
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 4318
    server = ThreadingHTTPServer(("127.0.0.1", port), _Sink)

    def stop(*_: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.serve_forever()
    print(json.dumps(received), flush=True)


if __name__ == "__main__":
    main()
