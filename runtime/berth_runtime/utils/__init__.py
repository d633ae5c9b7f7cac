"""Runtime helpers: typed ZeroMQ IPC sockets, token bytes (shared helpers: berth_common)."""
