"""Loopback HTTP pieces for the judge tests and bench (127.0.0.1 only, every wait bounded).

``LoopbackJudge`` is a small HTTP/1.1 server on its own thread and event loop. With an
``upstream`` URL it is a counting, fault-injecting proxy in front of a real OpenAI-compatible
server (``transformers serve`` in the tests); with ``upstream=None`` it is itself a fake judge
that answers ``reply`` (a string, or a function of the request's messages) after ``latency``
seconds (the bench).

Faults, per request: the next entry of ``script`` if any is left, else ``fault``:
  None       forward (or answer, when fake)
  "slow"     wait ``slow_s`` first (meant to exceed the client's timeout), then go on as None
  "500"      HTTP 500 with a JSON error       "429"   HTTP 429, ``Retry-After: 0``
  "drop"     close the connection without answering
  "garbage"  HTTP 200 whose body is not JSON   "leak"  HTTP 500 echoing the Authorization header
  "parrot"   HTTP 200, a chat completion whose content repeats the last user message (a judge
             that echoes the graded text, the way SmolLM2-135M does without worked examples)
Echoes of the key (the Authorization header is ``Bearer <key>``), as proxies' error pages do:
  "leak_cut"   HTTP 502 whose JSON body is padded so that the header value starts at character
               ``LEAK_AT`` of the body: a cut at 200 characters falls inside the key
  "leak_head"  HTTP 500 echoing only the key's first 20 characters
  "leak_tail"  HTTP 500 echoing only the key's last 12 characters
Replies a client cannot decode or should not read whole (status 200 unless said):
  "bad_gzip"   ``Content-Encoding: gzip`` on a body that is not gzip
  "bad_utf8"   a chat completion whose bytes are not UTF-8
  "truncated"  a chunked body cut off mid-JSON (the connection closes)
  "short"      a ``Content-Length`` 100 bytes longer than the body sent (the connection closes)
  "bad_retry_after"  HTTP 429 whose ``Retry-After`` is the byte 0xB2 (latin-1 superscript two)
  "huge"       a valid chat completion of ``huge_bytes`` (verdict at its end), streamed chunked
  "forever"    a chunked body that never ends
For "huge" and "forever" the bytes written before the client hung up are in the request's
``sent``.
Every request is recorded in ``requests`` (method, path, lower-cased headers, body);
``chat_requests`` are the chat-completion ones with the body parsed. A CONNECT (a client
that took this server for its HTTPS proxy) is recorded and dropped.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx2 as httpx

_MAX_BODY = 4 << 20
_IDLE_S = 30.0
LEAK_AT = 180  # where "leak_cut" puts the echoed header value: its key crosses a cut at 200
_CHUNK = 64 << 10


class LoopbackJudge:
    def __init__(self, upstream: str | None = None, *, reply="VERDICT: 4", latency: float = 0.0,
                 slow_s: float = 3.0, huge_bytes: int = 50 << 20):
        self.upstream, self.reply, self.latency, self.slow_s = upstream, reply, latency, slow_s
        self.huge_bytes = huge_bytes
        self.fault: str | None = None
        self.script: list[str | None] = []
        self.requests: list[dict] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="loopback-judge", daemon=True)
        self._server = None
        self._client = None
        self.port = 0

    # ------------------------------------------------------------------ life cycle

    def __enter__(self):
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def chat_requests(self) -> list[dict]:
        """The chat-completion requests received, bodies parsed."""
        return [{**r, "json": json.loads(r["body"])} for r in self.requests if r["path"].endswith("/chat/completions")]

    def reset(self, fault: str | None = None, script: list[str | None] | None = None) -> None:
        self.fault, self.script, self.requests = fault, list(script or []), []

    async def _start(self):
        if self.upstream:
            self._client = httpx.AsyncClient(base_url=self.upstream, timeout=120.0, trust_env=False)
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=_MAX_BODY)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self):
        self._server.close()
        if self._client is not None:
            await self._client.aclose()
        for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
            task.cancel()

    # ------------------------------------------------------------------ one connection

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while True:  # keep-alive: several requests per connection
                request = await asyncio.wait_for(self._read(reader), _IDLE_S)
                if request is None:
                    break
                if not await self._answer(request, reader, writer):
                    break
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _read(reader) -> dict | None:
        line = await reader.readline()
        if not line:
            return None
        method, path, _ = line.decode("latin-1").split(" ", 2)
        headers = {}
        while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = h.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        size = int(headers.get("content-length", 0))
        if size > _MAX_BODY:
            raise ValueError("body too large")
        body = await reader.readexactly(size) if size else b""
        return {"method": method, "path": path, "headers": headers, "body": body}

    async def _answer(self, request, reader, writer) -> bool:
        if request["method"] == "CONNECT":
            self.requests.append({"method": "CONNECT", "path": request["path"], "headers": request["headers"],
                                  "body": b"", "fault": None, "t": time.time()})
            return False
        fault = self.script.pop(0) if self.script else self.fault
        self.requests.append({"method": request["method"], "path": request["path"], "headers": request["headers"],
                              "body": request["body"], "fault": fault, "t": time.time()})
        if fault == "slow":
            await asyncio.sleep(self.slow_s)
            if reader.at_eof():  # the client gave up: spare the real server the work
                return False
            fault = None
        if fault == "drop":
            return False
        if fault in ("500", "429"):
            headers = {"Retry-After": "0"} if fault == "429" else {}
            return await self._send(writer, int(fault), json.dumps({"error": f"injected {fault}"}).encode(), headers)
        if fault == "leak":
            leaked = request["headers"].get("authorization", "")
            return await self._send(writer, 500, json.dumps({"error": f"rejected {leaked}"}).encode())
        key = request["headers"].get("authorization", "").removeprefix("Bearer ")
        if fault == "leak_cut":
            head = '{"error": "upstream rejected the request; '
            pad = "x" * (LEAK_AT - len(head) - len("authorization: "))
            body = head + pad + "authorization: " + request["headers"].get("authorization", "") + '"}'
            return await self._send(writer, 502, body.encode())
        if fault in ("leak_head", "leak_tail"):
            echoed = key[:20] if fault == "leak_head" else key[-12:]
            return await self._send(writer, 500, json.dumps({"error": f"invalid key {echoed}..."}).encode())
        if fault == "bad_gzip":
            return await self._send(writer, 200, _completion("VERDICT: 4"), {"Content-Encoding": "gzip"})
        if fault == "bad_utf8":
            return await self._send(writer, 200, _completion("VERDICT: 4").replace(b"VERDICT", b"\xff\xfeVERDICT"))
        if fault == "bad_retry_after":
            return await self._send(writer, 429, b'{"error": "slow down"}', {"Retry-After": "\xb2"})
        if fault == "truncated":
            body = _completion("VERDICT: 4")
            await self._head(writer, 200, {"Transfer-Encoding": "chunked"})
            writer.write(b"%x\r\n%s\r\n" % (len(body) // 2, body[:len(body) // 2]))
            await writer.drain()
            return False
        if fault == "short":
            body = _completion("VERDICT: 4")
            await self._head(writer, 200, {"Content-Length": str(len(body) + 100)})
            writer.write(body)
            await writer.drain()
            return False
        if fault in ("huge", "forever"):
            return await self._stream(writer, self.requests[-1], None if fault == "forever" else self.huge_bytes)
        if fault == "garbage":
            return await self._send(writer, 200, b"\x00<html>not a chat completion")
        if fault == "parrot":
            messages = json.loads(request["body"])["messages"]
            return await self._send(writer, 200, _completion(messages[-1]["content"]))
        if self.upstream is None:
            if request["path"].rstrip("/").endswith("/health"):
                return await self._send(writer, 200, b'{"status": "ok"}')
            await asyncio.sleep(self.latency)
            reply = self.reply(json.loads(request["body"])["messages"]) if callable(self.reply) else self.reply
            return await self._send(writer, 200, _completion(reply))
        up = await self._client.request(request["method"], request["path"], content=request["body"],
                                        headers={"content-type": request["headers"].get("content-type",
                                                                                          "application/json")})
        return await self._send(writer, up.status_code, up.content)

    @staticmethod
    async def _send(writer, status: int, body: bytes, headers: dict | None = None) -> bool:
        await LoopbackJudge._head(writer, status, {"Content-Length": str(len(body)), **(headers or {})})
        writer.write(body)
        await writer.drain()
        return True

    @staticmethod
    async def _head(writer, status: int, headers: dict) -> None:
        head = [f"HTTP/1.1 {status} X", "Content-Type: application/json", "Connection: keep-alive",
                *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))

    @staticmethod
    async def _stream(writer, record: dict, size: int | None) -> bool:
        """A chat completion of about ``size`` bytes (endless when None) in 64 KiB chunks, counting
        in ``record["sent"]`` what was written before the client hung up."""
        head = b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "'
        tail = b'\\nVERDICT: 4"}}]}'
        record["sent"] = 0
        await LoopbackJudge._head(writer, 200, {"Transfer-Encoding": "chunked"})

        async def chunk(data: bytes):
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()  # blocks while the client does not read: sent stays what it took
            record["sent"] += len(data)

        await chunk(head)
        while size is None or record["sent"] + _CHUNK + len(tail) < size:
            await chunk(b"a" * _CHUNK)
        await chunk(tail)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


def _completion(content: str) -> bytes:
    return json.dumps({"id": "loopback", "object": "chat.completion", "model": "loopback",
                       "choices": [{"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": content}}]}).encode()
