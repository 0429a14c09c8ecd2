"""Wait on a running daemon's control socket until an alert fires (gpu/diag_faults.sh), then
print one JSON object: how long it took, the alert as the control API gives it, the
engine's /health at that moment (its last step) and the other firing alerts.

    python3 gpu/alert_wait.py SOCKET ALERTNAME TIMEOUT_S [ENGINE_URL]
"""

import json
import sys
import time
import urllib.request

from control_wait import get  # same folder

sock, name, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
url = sys.argv[4] if len(sys.argv) > 4 else "http://127.0.0.1:8000"
t0 = time.time()
out = {"alertname": name, "fired": False}
while time.time() - t0 < timeout:
    firing = [a for a in get(sock, "/v1/alerts")["alerts"] if a["state"] == "firing"]
    hit = [a for a in firing if a["alertname"] == name]
    if hit:
        out.update(fired=True, after_s=round(time.time() - t0, 1), alert=hit[0],
                   others=[a["id"] for a in firing if a["alertname"] != name])
        break
    time.sleep(0.25)
try:
    out["health"] = json.loads(urllib.request.urlopen(url + "/health", timeout=3).read())
except Exception as exc:  # noqa: BLE001 - a restarting engine may not answer
    out["health"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out, indent=1, default=str))
