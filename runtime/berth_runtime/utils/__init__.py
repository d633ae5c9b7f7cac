"""Small shared helpers: IPC sockets, logging, process management, dataclass CLI flags."""
