"""The process: the gRPC server, admin port, background loops, reload, console client, workers."""
