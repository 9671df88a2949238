"""torch TCPStore client exercising a gpubridge store server.

Usage: torch_client.py HOST PORT

Runs every TCPStore operation torch 2.11 offers against the server, asserts
the results and prints "TORCH CLIENT OK" on success. Any mismatch raises, so
the exit status is non-zero. Leaves keys behind for the Go side to check:
"/from_python" = b"hello", "/py/nested/k" = b"v" (via PrefixStore).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Deadlines are for hangs: GPUBRIDGE_TEST_TIMEOUT_SCALE stretches them on a
# loaded machine (lib/testenv).
try:
    SCALE = max(1.0, float(os.environ.get("GPUBRIDGE_TEST_TIMEOUT_SCALE") or 1))
except ValueError:
    SCALE = 1.0
TIMEOUT = timedelta(seconds=60 * SCALE)


def expect_raises(fn: Callable[[], object], what: str) -> tuple[Exception, float]:
    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # DistStoreError, QueueEmptyError, ...
        print(f"  {what}: raised {type(e).__name__}: {e}", flush=True)
        return e, time.monotonic() - start
    raise AssertionError(f"{what}: did not raise")


def eq(got: Any, want: Any, what: str) -> None:
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")
    print(f"  {what}: {got!r}", flush=True)


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    print(f"torch {torch.__version__}", flush=True)
    s = dist.TCPStore(host, port, is_master=False, timeout=TIMEOUT)
    other = dist.TCPStore(host, port, is_master=False, timeout=TIMEOUT)

    s.set("k", "v")
    eq(s.get("k"), b"v", "set/get")
    s.set("bin", bytes(range(256)))
    eq(s.get("bin"), bytes(range(256)), "binary value")
    big = b"x" * (4 << 20)
    s.set("big", big)
    eq(len(s.get("big")), len(big), "4 MiB value")

    eq(s.add("ctr", 3), 3, "add new")
    eq(s.add("ctr", -1), 2, "add existing")
    eq(s.get("ctr"), b"2", "add stores ascii")

    eq(s.compare_set("cs", "x", "y"), b"x", "compare_set missing key, non-empty expected")
    eq(s.check(["cs"]), False, "compare_set stored nothing")
    eq(s.compare_set("cs", "", "y"), b"y", "compare_set missing key, empty expected")
    eq(s.compare_set("cs", "y", "z"), b"z", "compare_set match")
    eq(s.compare_set("cs", "q", "w"), b"z", "compare_set mismatch")

    eq(s.check(["k", "ctr"]), True, "check present")
    eq(s.check(["k", "nope"]), False, "check missing")

    s.wait(["k", "ctr"])
    s.wait(["k"], timedelta(seconds=1))
    e, took = expect_raises(lambda: s.wait(["nope"], timedelta(milliseconds=300)), "wait timeout")
    assert "timeout" in str(e).lower(), e
    assert took < 10 * SCALE, took
    # The connection must still be in sync after CANCEL_WAIT.
    eq(s.get("k"), b"v", "get after wait timeout")
    s.set_timeout(timedelta(milliseconds=300))
    expect_raises(lambda: s.get("missing"), "get timeout")
    s.set_timeout(TIMEOUT)
    eq(s.add("ctr", 1), 3, "add after get timeout")

    # Server-side WAIT woken by another client.
    def later() -> None:
        time.sleep(0.3)
        other.set("late", "here")
        other.add("late_ctr", 5)

    th = threading.Thread(target=later)
    th.start()
    eq(s.get("late"), b"here", "blocking get woken by set")
    s.wait(["late_ctr"])
    th.join()

    s.multi_set(["m1", "m2"], ["1", "2"])
    eq(s.multi_get(["m2", "m1"]), [b"2", b"1"], "multi_set/multi_get")

    eq(s.delete_key("m1"), True, "delete existing")
    eq(s.delete_key("m1"), False, "delete missing")

    s.append("ap", "a")
    s.append("ap", "bc")
    eq(s.get("ap"), b"abc", "append")

    n = s.num_keys()
    keys = s.list_keys()
    eq(n, len(keys), "num_keys == len(list_keys)")
    eq(sorted(keys), sorted(["k", "bin", "big", "ctr", "cs", "late", "late_ctr", "m2", "ap"]), "list_keys")

    if hasattr(s, "queue_push"):
        s.queue_push("q", "a")
        s.queue_push("q", b"b")
        eq(s.queue_len("q"), 2, "queue_len")
        eq(s.queue_pop("q"), b"a", "queue_pop")
        eq(s.queue_pop("q", block=False), b"b", "queue_pop non-blocking")
        expect_raises(lambda: s.queue_pop("q", block=False), "queue_pop empty")

        def push_later() -> None:
            time.sleep(0.3)
            other.queue_push("q2", "later")

        th = threading.Thread(target=push_later)
        th.start()
        eq(s.queue_pop("q2"), b"later", "blocking queue_pop")
        th.join()
        eq(s.queue_len("q2"), 0, "queue empty again")

    inner = dist.PrefixStore("py", s)
    nested = dist.PrefixStore("nested", inner)
    nested.set("k", "v")
    eq(s.get("py/nested/k"), b"v", "PrefixStore chain")
    eq(inner.get("nested/k"), b"v", "PrefixStore inner view")
    eq(nested.add("n", 7), 7, "PrefixStore add")
    eq(nested.check(["k", "n"]), True, "PrefixStore check")

    s.set("from_python", "hello")
    print("TORCH CLIENT OK", flush=True)


if __name__ == "__main__":
    main()
