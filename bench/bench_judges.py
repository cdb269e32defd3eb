"""HttpJudge throughput against a loopback judge with a fixed latency, as a share of the bound.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/bench_judges.py
    .venv/bin/python bench/bench_judges.py --latency 0.1 --inflight 1 8 32 64 --rows-per-slot 16

With N requests in flight and a server that answers each after L seconds, no client can do
better than N / L requests per second; the bench prints the judge's rate and its ratio to
that bound for each N (goal: >= 0.9), and the rate of a bare httpx2 client sending the same
requests with the same N (``raw``), which separates the judge's own overhead from what the
HTTP client and the machine allow. The server is ``tests/judge_server.py``'s fake judge, run
in a subprocess so it does not share the client's interpreter lock; every row is a distinct
completion (no cache hits) and each judge call opens its own connections, as in training.
A call ends when its slowest row does, so part of the gap is the last wave's tail; more
``--rows-per-slot`` shrinks it. Not measured: a real judge's own queueing, retries, TLS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = """
import sys, time
sys.path.insert(0, {tests!r})
from judge_server import LoopbackJudge
with LoopbackJudge(latency={latency}) as s:
    print(s.port, flush=True)
    sys.stdin.read()  # until the parent closes stdin
"""


def main() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.5, help="seconds the fake judge waits per request")
    parser.add_argument("--inflight", type=int, nargs="+", default=[1, 8, 32, 64], help="max_concurrency values")
    parser.add_argument("--rows-per-slot", type=int, default=16, help="rows per call = this x in-flight (min 16)")
    parser.add_argument("--repeats", type=int, default=3, help="calls per setting; the best is reported")
    args = parser.parse_args()

    import httpx2 as httpx

    from grpotrl.rewards.judges import HttpJudge
    from grpotrl.rewards.rubrics import FAIRNESS

    async def raw(url: str, n: int, rows: int) -> float:
        """The same requests through one bare client, n at a time: requests per second."""
        body = {"model": "bench", "messages": FAIRNESS.messages("Describe nurses.", "completion"), "max_tokens": 256}
        slots = asyncio.Semaphore(n)
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n, max_keepalive_connections=n)) as client:
            async def one():
                async with slots:
                    (await client.post(f"{url}/chat/completions", json=body)).raise_for_status()

            t = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(rows)))
            return rows / (time.perf_counter() - t)

    server = subprocess.Popen([sys.executable, "-c", SERVER.format(tests=str(ROOT / "tests"), latency=args.latency)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        url = f"http://127.0.0.1:{port}/v1"
        results = []
        for n in args.inflight:
            rows = max(16, args.rows_per_slot * n)
            best = 0.0
            for r in range(args.repeats):
                judge = HttpJudge(FAIRNESS, base_url=url, model="bench", max_concurrency=n, timeout=30,
                                  max_failed_batches=0)
                completions = [f"completion {r}-{i}" for i in range(rows)]
                t = time.perf_counter()
                scores = asyncio.run(judge(prompts=["Describe nurses."] * rows, completions=completions))
                elapsed = time.perf_counter() - t
                assert all(s == 0.75 for s in scores), scores[:4]
                best = max(best, rows / elapsed)
            bare = max(asyncio.run(raw(url, n, rows)) for _ in range(args.repeats))
            bound = n / args.latency
            results.append({"inflight": n, "rows": rows, "rps": round(best, 1), "bound": round(bound, 1),
                            "ratio": round(best / bound, 3), "raw_rps": round(bare, 1)})
            print(f"N={n:4d}  rows={rows:5d}  judge {best:7.1f} req/s  bound {bound:7.1f}  ratio {best / bound:.3f}"
                  f"  | raw httpx2 {bare:7.1f} req/s (ratio {bare / bound:.3f})", flush=True)
        print(json.dumps({"latency_s": args.latency, "results": results}))
    finally:
        server.stdin.close()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
