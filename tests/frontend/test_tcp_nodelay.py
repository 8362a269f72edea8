"""The front end's connections send without Nagle's delay: its own listening socket
(startup.bind_socket, which asyncio does not take for TCP) serving uvicorn with the
gateway's protocol, on the event loop `gateway serve` runs."""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from gateway.frontend.http.connections import http_protocol
from gateway.frontend.startup import bind_socket


async def _app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_accepted_connections_have_tcp_nodelay() -> None:
    seen: list[int] = []
    base = http_protocol(5.0)

    class Recording(base):  # type: ignore[valid-type, misc]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    async def main() -> None:
        listening = bind_socket("127.0.0.1", 0)
        assert listening.proto == 0  # what asyncio leaves without TCP_NODELAY
        port = listening.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(_app, http=Recording, log_level="warning",
                                               lifespan="off"))
        serving = asyncio.create_task(server.serve(sockets=[listening]))
        while not server.started:
            await asyncio.sleep(0.01)
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
            writer.close()
        server.should_exit = True
        await serving

    asyncio.run(main())
    assert seen == [1, 1]
