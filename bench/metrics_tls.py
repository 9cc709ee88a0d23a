"""What TLS with client certificates costs a metrics scrape: plain HTTP vs HTTPS, same registry.

Serves this process's default registry (every rlbus metric family, as a component does) twice,
once plain and once with the server context of fresh ``busctl keys`` files, and times
``busctl.scrape.scrape`` (a new connection per scrape, as the supervisor's poller does, so each
HTTPS scrape pays a full handshake). Prints the median and p90 per scrape, milliseconds.

    .venv/bin/python -m bench.metrics_tls [--scrapes N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import telemetry.metrics  # noqa: F401  (registers the bus/stage families in the default registry)
from bus import auth
from telemetry.metrics import start_metrics_server
from telemetry.tls import MetricsTls
from busctl.scrape import scrape


def time_scrapes(port: int, tls, n: int) -> list[float]:
    """Milliseconds of each of ``n`` scrapes of ``127.0.0.1:port`` (``tls``: client context or None)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        scrape(port, tls=tls, timeout_s=10)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        auth.create_keys(Path(tmp) / "keys")
        tls = MetricsTls.load(Path(tmp) / "keys")
        plain = start_metrics_server(0)
        secure = start_metrics_server(0, tls=tls.server_context())
        client = tls.client_context()
        time_scrapes(plain.server_address[1], None, 5)  # warm-up
        time_scrapes(secure.server_address[1], client, 5)
        for name, port, ctx in (
            ("http", plain.server_address[1], None),
            ("https+client cert", secure.server_address[1], client),
        ):
            ms = sorted(time_scrapes(port, ctx, args.scrapes))
            print(
                f"{name:18s} median {statistics.median(ms):6.2f} ms  p90 {ms[int(0.9 * len(ms))]:6.2f} ms  "
                f"({args.scrapes} scrapes)"
            )
        for server in (plain, secure):
            server.shutdown()
            server.server_close()


if __name__ == "__main__":
    main()
