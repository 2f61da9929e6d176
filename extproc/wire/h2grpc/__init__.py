"""A gRPC server on the event loop, for the picker's long ext_proc streams: HTTP/2 frames read
and written here, every message handed to its stream in the same callback that read it.

Why not grpcio: under ``FULL_DUPLEX_STREAMED`` a gateway sends every SSE event of every
response to the picker and waits for it back, so the cost per message is the picker's cost
per event. grpc.aio spends ~100 µs of CPU on each (measured, ``bench.echo_stacks``): the C
core reads the frame on its own thread, the completion crosses to the event loop through
a poller thread, and each message is a future, a task step and a batch of C calls. Here a
read of the socket is parsed in Python where it lands: a whole SSE chunk's message goes to
the stream's ``fast`` hook and its echo is written before the callback returns; messages
read together are answered in one write.

What it implements (RFC 9113 as a server, gRPC's HTTP/2 mapping): the preface and SETTINGS
exchange, PING, WINDOW_UPDATE and flow control both ways (each stream's window and the
connection's; data over the peer's window waits), HEADERS with CONTINUATION and padding,
request headers through ``hpack`` (whose decoder keeps the connection's table), DATA carrying
length-prefixed gRPC messages split or joined across frames, RST_STREAM both ways, GOAWAY on
shutdown (the graceful two-step: the maximum id and a PING, then the last id). What it does
not: compressed messages (answered UNIMPLEMENTED), server push, priorities (ignored),
``grpc-timeout`` (Envoy's ext_proc streams carry none the picker could use). Response header
blocks are written as HPACK literals, never indexed, so no encoder state is needed.

The modules, from the bottom (each imports only those above it in this list):
``frames`` (HTTP/2's frame layout, codes and this server's limits), ``blocks`` (the HPACK
decoder, with the blocks that leave its table alone remembered), ``status`` (gRPC status
codes and the response header blocks), ``stream`` (one call's sending side and the
connection's: windows, resets, GOAWAY), ``connection`` (reading frames off the socket),
``server`` (the listening socket, stop, TLS) and ``calls`` (unary and streaming handlers).
"""
