"""A stand-in for ``loom serve`` that costs almost nothing: it answers every streaming
``POST /v1/completions`` with ``max_tokens`` completion chunks shaped like loom's (one token
of text each, then the usage chunk and ``[DONE]``), serialized once at start-up and written
as fast as the socket takes them. ``bench/serve_throughput.py --client-ceiling`` loads it
with the same client and workload as a real serve, which measures how many streamed tokens a
second the official OpenAI client itself can take on this machine.

    python bench/_sse_replay.py PORT
"""

from __future__ import annotations

import asyncio
import json
import sys


def _event(payload: object) -> bytes:
    data = f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n".encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"  # one HTTP/1.1 chunk per event


def _chunk(text: str, finish: str | None, usage: dict | None = None) -> bytes:
    choices = [] if usage else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                                 "stop_reason": None}]
    return _event({"id": "cmpl-replay", "object": "text_completion", "created": 0, "model": "replay",
                   "choices": choices, "usage": usage})


_TOKEN = _chunk(" tok", None)
_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
         b"transfer-encoding: chunked\r\n\r\n")


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = json.loads(await reader.readexactly(length)) if length else {}
            n = int(body.get("max_tokens") or 16)
            writer.write(_HEAD)
            for _ in range(n - 1):
                writer.write(_TOKEN)
                await writer.drain()  # one event per write, as a server producing tokens would
            writer.write(_chunk(" tok", "length"))
            usage = {"prompt_tokens": len(body.get("prompt") or []), "completion_tokens": n}
            usage["total_tokens"] = usage["prompt_tokens"] + n
            writer.write(_chunk("", None, usage) + _event("[DONE]") + b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main(port: int) -> None:
    server = await asyncio.start_server(_handle, "127.0.0.1", port, backlog=1024)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
