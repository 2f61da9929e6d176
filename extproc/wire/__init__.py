"""The ext_proc gRPC protocol: building replies, reading the stream, the health service."""
