"""Wait on a running daemon's control socket (device scripts): until the engine is
healthy, or until a ForeignGpuProcess alert fires. Prints how long it took.

    python3 gpu/control_wait.py SOCKET healthy|foreign TIMEOUT_S
"""

import json
import socket
import sys
import time


def get(sock_path: str, path: str) -> dict:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(3)
    s.connect(sock_path)
    s.sendall(f"GET {path} HTTP/1.0\r\nHost: zerod\r\n\r\n".encode())
    buf = b""
    while chunk := s.recv(65536):
        buf += chunk
    s.close()
    return json.loads(buf.partition(b"\r\n\r\n")[2])


CONDITIONS = {
    "healthy": lambda p: get(p, "/v1/status")["engine"]["state"] == "healthy",
    "foreign": lambda p: any(a["alertname"] == "ForeignGpuProcess" and a["state"] == "firing"
                             for a in get(p, "/v1/alerts")["alerts"]),
}

def main() -> int:
    sock_path, what, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
    t0 = time.time()
    while time.time() - t0 < limit:
        try:
            if CONDITIONS[what](sock_path):
                print(what, round(time.time() - t0, 1))
                return 0
        except (OSError, ValueError, KeyError):
            pass  # not up yet
        time.sleep(0.3)
    print(what, "not reached in", limit, "s")
    return 1


if __name__ == "__main__":
    sys.exit(main())
