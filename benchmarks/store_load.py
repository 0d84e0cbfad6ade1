"""The launcher's store under the rollout ranks' waiting (issue: ~55k calls/s at 64 of 128 ranks on one thread).

One real libuv ``TCPStore`` server (what ``torchrun`` / ``accelerate launch`` start), and ``--clients`` clients
(threads spread over ``--procs`` processes, each with its own connection) that wait the way the bridge's processes
wait while the engines generate: each waits for a key that is not written yet and writes a heartbeat every second.

- ``old``: the wait before this change: a check of the key, then the sender's heartbeat (a check and a get), every
  5 ms, and every client's heartbeat thread reads every other client's heartbeat each second (a rollout rank
  watched every rank of the launch);
- ``new``: :meth:`trl_nrollout.rollout.bridge.Bridge.wait_for`: a check at intervals growing to 50 ms, the sender's
  heartbeat once a second, and only client 0 (trainer rank 0) reads every heartbeat; the others read client 0's.

A probe client measures the latency of one ``get`` while they wait (p50 / p99, ms), against the same probe with no
waiters in the same run (the baseline). Prints and saves ``store_load.json`` / ``.md`` under ``--out``.

    python benchmarks/store_load.py [--clients 64] [--procs 4] [--seconds 6] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from common import check_load, write_table  # noqa: E402


def _client(port: int, index: int, clients: int, scheme: str, go, stop, ready, calls) -> None:
    import torch

    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, use_libuv=True,
                                       timeout=timedelta(seconds=60))
    count = 0
    done = threading.Event()
    ready.put(index)
    go.wait()

    def heartbeat() -> None:
        nonlocal count
        peers = range(clients) if scheme == "old" or index == 0 else [0]
        while not done.wait(1.0):
            store.set(f"beat/{index}", f"{time.time()}|waiting")
            count += 1
            for p in peers:
                if p != index and store.check([f"beat/{p}"]):
                    store.get(f"beat/{p}")
                    count += 2

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    delay, checked = 0.001, time.monotonic()
    while not stop.is_set():
        store.check(["never"])
        count += 1
        if scheme == "old":
            if store.check(["beat/0"]):
                store.get("beat/0")
            count += 2
            time.sleep(0.005)
        else:
            if time.monotonic() - checked >= 1.0:
                checked = time.monotonic()
                if store.check(["beat/0"]):
                    store.get("beat/0")
                count += 2
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
    done.set()
    beat.join()
    calls.put(count)


def _proc(port: int, first: int, count: int, clients: int, scheme: str, go, stop, ready, calls) -> None:
    threads = [threading.Thread(target=_client, args=(port, first + k, clients, scheme, go, stop, ready, calls))
               for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _probe(store, seconds: float) -> list[float]:
    store.set("probe", b"x" * 256)
    out, end = [], time.time() + seconds
    while time.time() < end:
        t0 = time.perf_counter()
        store.get("probe")
        out.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.01)
    return out


def run(scheme: str | None, clients: int, procs: int, seconds: float) -> dict:
    import torch

    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, timeout=timedelta(seconds=60))
    probe = torch.distributed.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True,
                                       timeout=timedelta(seconds=60))
    if scheme is None:
        lat = _probe(probe, seconds)
        return {"scheme": "idle", "clients": 0, "calls_per_s": 0.0, **_stats(lat)}
    ctx = mp.get_context("spawn")
    calls, ready, go, stop = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    per = [clients // procs + (1 if p < clients % procs else 0) for p in range(procs)]
    workers = [ctx.Process(target=_proc, args=(server.port, sum(per[:p]), per[p], clients, scheme, go, stop, ready,
                                               calls)) for p in range(procs)]
    for w in workers:
        w.start()
    for _ in range(clients):  # every client connected (torch imported) before anything is measured
        ready.get(timeout=300)
    go.set()
    t0 = time.perf_counter()
    time.sleep(1.0)
    lat = _probe(probe, seconds)
    stop.set()
    elapsed = time.perf_counter() - t0
    total = sum(calls.get(timeout=120) for _ in range(clients))
    for w in workers:
        w.join()
    return {"scheme": scheme, "clients": clients, "calls_per_s": total / elapsed, **_stats(lat)}


def _stats(lat: list[float]) -> dict:
    lat = sorted(lat)
    return {"probe_p50_ms": statistics.median(lat), "probe_p99_ms": lat[int(0.99 * (len(lat) - 1))],
            "probes": len(lat)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench")
    args = parser.parse_args(argv)
    load, busy = check_load("the store's latency")
    rows = [run(None, 0, 1, args.seconds)]
    for scheme in ("old", "new"):
        rows.append(run(scheme, args.clients, args.procs, args.seconds))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["probe_p50_ms"]
    for r in rows:
        r["p50_vs_idle"] = r["probe_p50_ms"] / base
    result = {"load_at_start": load, "busy_at_start": busy, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    lines = ["| waiting | clients | store calls/s | probe get p50 (ms) | p99 (ms) | p50 / idle |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['scheme']} | {r['clients']} | {r['calls_per_s']:.0f} | {r['probe_p50_ms']:.3f} | "
              f"{r['probe_p99_ms']:.3f} | {r['p50_vs_idle']:.2f} |" for r in rows]
    write_table(result, lines, args.out, "store_load")
    for r in rows:
        print(f"{r['scheme']:>5}: {r['clients']:3d} waiters, {r['calls_per_s']:8.0f} store calls/s, probe get p50 "
              f"{r['probe_p50_ms']:.3f} ms p99 {r['probe_p99_ms']:.3f} ms ({r['p50_vs_idle']:.2f}x idle)")
    return result


if __name__ == "__main__":
    main()
