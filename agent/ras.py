"""NCCL RAS: the status NCCL's reliability service gives on each node (NCCL >= 2.24, on by
default), relayed by the agent while a rank is stuck, since it answers only on the node's own
localhost (port 28028, NCCL_RAS_ADDR).

The protocol is the one of NCCL's `ncclras` client (`src/ras/client.cc`): plain text lines;
`CLIENT PROTOCOL 2` is answered by `SERVER PROTOCOL n`, `TIMEOUT s` by `OK`, and `STATUS`
by the report, until NCCL closes the connection.
"""

from __future__ import annotations

import socket

RAS_PORT = 28028
CLIENT_PROTOCOL = 2
MAX_REPORT_BYTES = 64 * 1024


class RasUnavailable(ConnectionError):
    """Nothing answers as NCCL RAS there (no NCCL job on this node, or RAS is off)."""


def _line(sock: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n") and len(data) < 4096:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def ras_status(host: str = "localhost", port: int = RAS_PORT, timeout_s: float = 5.0) -> str:
    """NCCL RAS's STATUS report as text; raises RasUnavailable when nothing answers."""
    try:
        sock = socket.create_connection((host, port), timeout=1.0)
    except OSError as exc:
        raise RasUnavailable(f"no NCCL RAS at {host}:{port}: {exc}") from None
    with sock:
        try:
            sock.sendall(f"CLIENT PROTOCOL {CLIENT_PROTOCOL}\n".encode())
            hello = _line(sock)
            if not hello.upper().startswith("SERVER PROTOCOL"):
                raise RasUnavailable(f"{host}:{port} is not NCCL RAS (it said {hello[:80]!r})")
            seconds = max(1, int(timeout_s))
            sock.sendall(f"TIMEOUT {seconds}\n".encode())
            if _line(sock).upper() != "OK":
                raise RasUnavailable(f"NCCL RAS at {host}:{port} refused TIMEOUT {seconds}")
            sock.settimeout(timeout_s + 5.0)  # RAS asks its peers before it answers
            sock.sendall(b"STATUS\n")
            report = b""
            while len(report) < MAX_REPORT_BYTES:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                report += chunk
        except OSError as exc:
            raise RasUnavailable(f"NCCL RAS at {host}:{port} stopped answering: {exc}") from None
    return report.decode(errors="replace")[:MAX_REPORT_BYTES]
