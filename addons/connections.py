"""The one place Sluice reaches into mitmproxy's connection handlers.

mitmproxy checks `flow.kill()` only at hook boundaries and does nothing for a
TCP tunnel, so caps that trip between hooks (a timer, a streamed chunk, a
tunnel message) act on the connection handler directly: answer the client
with raw bytes when nothing was sent yet, and close every socket of the
client connection, which frees its resources.
"""

from __future__ import annotations

import logging

from mitmproxy import connection, ctx

logger = logging.getLogger("sluice.connections")


def _handler(client_id: str):
    proxyserver = ctx.master.addons.get("proxyserver")
    return proxyserver.connections.get(client_id) if proxyserver else None


def handler_of(client: connection.Client):
    """The client connection's mitmproxy ConnectionHandler (None: gone)."""
    return _handler(client.id)


def write_to_client(client: connection.Client, data: bytes) -> bool:
    """Send bytes straight to the client socket (an HTTP/1 response that
    replaces whatever mitmproxy would have sent). False if it is gone."""
    if client.tls:
        # The client speaks TLS to us (an intercepted tunnel): plaintext on
        # its socket would be garbage inside the TLS stream. The caller closes
        # the connection instead; the audit line has the refusal.
        return False
    handler = _handler(client.id)
    if handler is None:
        return False
    io = handler.transports.get(handler.client)
    if io is None or io.writer is None or io.writer.is_closing():
        return False
    io.writer.write(data)
    return True


def shut_client_writer(client: connection.Client) -> None:
    """Stop anything more reaching the client: what was already written (a
    refusal, or a body cut at its cap) is flushed, and nothing mitmproxy
    writes afterwards (such as the final empty chunk that would make a cut
    body look complete) goes out. Safe to call from inside mitmproxy's event
    processing (a stream callable)."""
    handler = _handler(client.id)
    io = handler.transports.get(handler.client) if handler is not None else None
    if io is not None and io.writer is not None and not io.writer.is_closing():
        io.writer.close()


def shut_server_writer(client: connection.Client, server: connection.Server) -> None:
    """Stop anything more reaching a server: an upload cut at its cap must
    never be completed by mitmproxy's final empty chunk (the origin would
    take a truncated body for a whole one). Safe inside event processing."""
    handler = _handler(client.id)
    io = handler.transports.get(server) if handler is not None else None
    if io is not None and io.writer is not None and not io.writer.is_closing():
        io.writer.close()


def close_client(client: connection.Client) -> bool:
    """Close the client connection and every server connection it holds."""
    handler = _handler(client.id)
    if handler is None:
        return False
    shut_client_writer(client)
    for conn in list(handler.transports):
        try:
            if handler.transports[conn].handler is not None:
                handler.close_connection(conn)
        except (KeyError, OSError, AssertionError):
            logger.debug("closing %s failed", conn, exc_info=True)
    return True


def abort_server(client: connection.Client, server: connection.Server) -> None:
    """Drop a server socket at once, discarding anything buffered for it, so
    not one byte reaches that peer (used when the peer is not the pinned one)."""
    handler = _handler(client.id)
    io = handler.transports.get(server) if handler is not None else None
    if io is not None and io.writer is not None:
        transport = getattr(io.writer, "transport", None)
        if transport is not None:
            transport.abort()
        else:
            io.writer.close()


def set_idle_timeout(client: connection.Client, seconds: float) -> None:
    """Per-profile idle timeout: mitmproxy's watchdog for this client connection."""
    handler = _handler(client.id)
    if handler is not None:
        handler.timeout_watchdog.timeout = seconds


def http1_response_bytes(status: int, reason: str, headers: dict[str, str], body: bytes) -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}"]
    for name, value in headers.items():
        lines.append(f"{name}: {value}")
    lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def close_server(client: connection.Client, server: connection.Server) -> bool:
    """Close one server connection of a client connection the way mitmproxy
    closes it (its layers see the connection end; the fd is freed)."""
    handler = _handler(client.id)
    io = handler.transports.get(server) if handler is not None else None
    if io is None or io.handler is None or io.handler.done():
        return False
    handler.close_connection(server)
    return True


def idle_http1_servers(client: connection.Client) -> set[str]:
    """Ids of this client connection's server connections that speak HTTP/1
    and are between exchanges (keep-alive, nothing in flight): the ones that
    can be closed without cutting anything. Anything else (a tunnel, a pipe,
    an HTTP/2 upstream, an exchange in progress) is never in it."""
    from mitmproxy.proxy.layers.http import HttpLayer, HttpStream
    from mitmproxy.proxy.layers.http._http1 import Http1Client

    handler = _handler(client.id)
    if handler is None:
        return set()
    idle: set[str] = set()
    seen: set[int] = set()
    todo = [handler.layer]
    while todo:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        # A layer's context lists the stack it sits in (mode layers such as
        # HttpProxy keep no reference to their child).
        context = getattr(item, "context", None)
        todo.extend(getattr(context, "layers", ()))
        if isinstance(item, HttpLayer):
            for conn, child in item.connections.items():
                if isinstance(conn, connection.Server):
                    found = _innermost(child)
                    if (isinstance(found, Http1Client) and found.stream_id is None
                            and found.state == found.read_headers and conn.connected):
                        idle.add(conn.id)
                else:
                    todo.append(child)
            todo.extend(item.streams.values())
        elif isinstance(item, HttpStream):
            todo.append(getattr(item, "child_layer", None))
        else:
            todo.append(getattr(item, "layer", None))  # NextLayer
            todo.append(getattr(item, "child_layer", None))
    return idle


def _innermost(layer_):
    """Down a server connection's stack (TLS, HttpClient) to its HTTP/1 or
    HTTP/2 client layer."""
    for _ in range(8):  # a server stack is a few layers deep
        child = getattr(layer_, "child_layer", None)
        if child is None:
            return layer_
        layer_ = child
    return layer_


def destination_named(client: connection.Client) -> bool:
    """Whether the client's mode layer knows its destination (a SOCKS5
    handshake's CONNECT request was read)."""
    handler = _handler(client.id)
    context = getattr(getattr(handler, "layer", None), "context", None)
    return context is not None and context.server.address is not None
