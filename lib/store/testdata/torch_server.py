"""A torch TCPStore master for the Go client to talk to.

Usage: torch_server.py libuv|legacy

Prints "PORT <port>" once the server listens, then serves requests from
stdin, one JSON object per line, answering one JSON line each:
  {"op": "get", "prefixes": [...], "key": k}          -> {"value": hex} or {"error": msg}
  {"op": "set", "prefixes": [...], "key": k, "value": hex} -> {}
  {"op": "check", "prefixes": [...], "keys": [...]}   -> {"value": bool}
  {"op": "list_keys"}                                 -> {"value": [...]}
prefixes are applied like gpubridge's Client.Prefix chain: the first one is
closest to the TCPStore. Exits when stdin closes.
"""

import json
import sys
from datetime import timedelta

import torch.distributed as dist


def view(store: dist.Store, prefixes: list[str]) -> dist.Store:
    for p in prefixes:
        store = dist.PrefixStore(p, store)
    return store


def main() -> None:
    use_libuv = sys.argv[1] == "libuv"
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=5),
        use_libuv=use_libuv,
    )
    assert store.libuvBackend == use_libuv, store.libuvBackend
    print(f"PORT {store.port}", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        s = view(store, req.get("prefixes") or [])
        try:
            op = req["op"]
            if op == "get":
                resp = {"value": s.get(req["key"]).hex()}
            elif op == "set":
                s.set(req["key"], bytes.fromhex(req["value"]))
                resp = {}
            elif op == "check":
                resp = {"value": s.check(req["keys"])}
            elif op == "list_keys":
                resp = {"value": store.list_keys()}
            else:
                resp = {"error": f"unknown op {op}"}
        except Exception as e:
            resp = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(resp), flush=True)


if __name__ == "__main__":
    main()
