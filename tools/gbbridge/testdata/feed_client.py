"""The Python plugin's feed client as BenchmarkServeLatency's helper: the
same lockstep protocol as feedClient in latency_test.go. Connects to the feed
socket argv[1], maps a 4 KiB region and, for every "N [SPIN]" line on stdin,
runs N 4-byte float32 all_reduces with gpubridge._feed.FeedClient (spinning
SPIN, a Go duration such as 100µs or 0s, before it blocks) and prints the
round times in nanoseconds on one line. PYTHONPATH must reach torchplugin/."""

from __future__ import annotations

import sys
import time

from gpubridge._feed import DType, FeedClient, Op


def seconds(go: str) -> float:
    for unit, scale in (("µs", 1e-6), ("us", 1e-6), ("ms", 1e-3), ("ns", 1e-9), ("s", 1.0)):
        if go.endswith(unit):
            return float(go[: -len(unit)]) * scale
    raise ValueError(f"feed_client: not a duration: {go!r}")


def main() -> int:
    c = FeedClient.connect(sys.argv[1], timeout=60.0)
    region = c.map_region(4096)
    for line in sys.stdin:
        f = line.split()
        n = int(f[0])
        c.spin = seconds(f[1]) if len(f) > 1 else 0.0
        times = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            c.all_reduce(region, 0, 4, DType.FLOAT32, Op.SUM)
            times.append(str(time.perf_counter_ns() - t0))
        sys.stdout.write(" ".join(times) + "\n")
        sys.stdout.flush()
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
