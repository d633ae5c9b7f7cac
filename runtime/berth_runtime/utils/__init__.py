"""Runtime helpers: typed ZeroMQ IPC sockets (what deployables share is in berth_common)."""
