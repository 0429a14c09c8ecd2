"""Wait for a starting server's /health (device scripts). Prints ok, dead (its process
exited first) or timeout.

    python3 gpu/wait_health.py PORT TIMEOUT_S PID
"""

import os
import sys
import time
import urllib.request


def main() -> str:
    port, limit, pid = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if not os.path.exists(f"/proc/{pid}"):
            return "dead"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return "ok"
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.25)
    return "timeout"


if __name__ == "__main__":
    print(main())
