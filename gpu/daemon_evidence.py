"""The daemon on the device H200: `zerod run` with a Llama-3-8B-shaped dummy
engine, a fake NOTIFY_SOCKET, foreign processes under agent names, detection
times, the daemon's CPU while watching. Called by gpu/daemon.sh run.

    python3 gpu/daemon_evidence.py CONFIG OUTDIR

Writes OUTDIR/{summary.json, daemon.log, notify.txt, alerts.json, processes.json,
gpus.json, status.json, engine.json, metrics.txt} and prints a table last.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
cfg_path, out = sys.argv[1], Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
summary: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def control(path, target):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    s.sendall(f"GET {target} HTTP/1.0\r\nHost: zerod\r\n\r\n".encode())
    buf = b""
    while True:
        c = s.recv(1 << 20)
        if not c:
            break
        buf += c
    s.close()
    return json.loads(buf.partition(b"\r\n\r\n")[2])


def cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def holds_gpu(pid: int) -> bool:
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/nvidia"):
                    return True
            except OSError:
                pass
    except OSError:
        pass
    return False


import tomllib  # noqa: E402

sock_path = tomllib.loads(Path(cfg_path).read_text())["daemon"]["control_socket"]

# --- the fake systemd: a datagram socket the daemon notifies
notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
notify_addr = str(out / "notify.sock")
if os.path.exists(notify_addr):
    os.unlink(notify_addr)
notify.bind(notify_addr)
notify.settimeout(0.2)
messages: list[tuple[float, str]] = []
stop_listening = threading.Event()


def listen():
    while not stop_listening.is_set():
        try:
            data = notify.recv(4096)
        except socket.timeout:
            continue
        except OSError:
            return
        for line in data.decode().splitlines():
            messages.append((time.time(), line))


threading.Thread(target=listen, daemon=True).start()

env = dict(os.environ, NOTIFY_SOCKET=notify_addr, WATCHDOG_USEC="30000000", PYTHONUNBUFFERED="1")
log = open(out / "daemon.log", "w")
t_start = time.time()
daemon = subprocess.Popen([sys.executable, "-m", "zerod", "run", "--config", cfg_path], cwd=ROOT, env=env,
                          stdout=log, stderr=subprocess.STDOUT)
summary["daemon_pid"] = daemon.pid


def wait(pred, timeout, what):
    end = time.time() + timeout
    while time.time() < end:
        r = pred()
        if r:
            return r
        if daemon.poll() is not None:
            raise SystemExit(f"FAILED: daemon exited ({daemon.returncode}) while waiting for {what}")
        time.sleep(0.05)
    raise SystemExit(f"FAILED: timed out waiting for {what}")


def msg(prefix):
    return next((t for t, m in messages if m.startswith(prefix)), None)


agents: list[subprocess.Popen] = []
try:
    t_ready = wait(lambda: msg("READY=1"), 400, "READY=1")
    summary["ready_s"] = round(t_ready - t_start, 2)
    summary["extend_timeout_msgs_before_ready"] = sum(1 for t, m in messages if m.startswith("EXTEND_TIMEOUT") and t <= t_ready)
    st = control(sock_path, "/v1/status")
    summary["status_at_ready"] = st
    epid = st["engine"]["pid"]
    try:
        summary["engine_cpus_allowed"] = next(l.split(":")[1].strip() for l in Path(f"/proc/{epid}/status").read_text().splitlines() if l.startswith("Cpus_allowed_list"))
        summary["engine_numa_maps_first"] = Path(f"/proc/{epid}/numa_maps").read_text().splitlines()[0]
        summary["engine_env_has_notify_socket"] = b"NOTIFY_SOCKET=" in Path(f"/proc/{epid}/environ").read_bytes()
    except OSError as exc:
        summary["engine_proc_error"] = str(exc)
    time.sleep(3)  # let the watchers settle, then measure CPU while watching
    wait(lambda: msg("WATCHDOG=1"), 40, "WATCHDOG=1")

    # --- the daemon's CPU while watching (engine idle), ~20 s
    c0, w0 = cpu_seconds(daemon.pid), time.monotonic()
    time.sleep(20)
    c1, w1 = cpu_seconds(daemon.pid), time.monotonic()
    summary["daemon_cpu_percent_of_core_idle_watch"] = round(100 * (c1 - c0) / (w1 - w0), 3)
    summary["daemon_cpu_window_s"] = round(w1 - w0, 1)

    # --- foreign processes under agent names
    pypath = ":".join(p for p in sys.path if p)
    results = []
    agent_list = (("dcgm-exporter", "alloc", "2"), ("datadog-agent", "nvml", "")) if os.environ.get("AGENTS", "1") != "0" else ()
    for name, mode, arg in agent_list:
        t_spawn = time.time()
        p = subprocess.Popen(["bash", "-c", f"export PYTHONPATH='{pypath}'; exec -a {name} {sys.executable} "
                              f"gpu/doctor_agent.py {name} {mode} {arg}"], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        agents.append(p)
        t_open = wait(lambda: time.time() if holds_gpu(p.pid) else None, 120, f"{name} opening /dev/nvidia*")
        line = ""
        while "ready" not in line:  # "ready" once it holds its memory / NVML handle
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"FAILED: {name} ended before it was ready")
        t_held = time.time()

        def alert():
            for a in control(sock_path, "/v1/alerts")["alerts"]:
                if a["alertname"] == "ForeignGpuProcess" and a["state"] == "firing" and a["labels"].get("pid") == str(p.pid):
                    return a
            return None

        a = wait(alert, 30, f"ForeignGpuProcess for {name}")
        t_seen = time.time()
        results.append({"agent": name, "mode": mode, "pid": p.pid, "ready_line": line.strip(),
                        "open_to_alert_s": round(a["starts_at"] - t_open, 3),
                        "held_to_alert_s": round(a["starts_at"] - t_held, 3),
                        "open_to_seen_via_api_s": round(t_seen - t_open, 3),
                        "spawn_to_open_s": round(t_open - t_spawn, 3), "alert": a})
    summary["foreign"] = results
    time.sleep(2)
    for name, target in (("alerts", "/v1/alerts"), ("processes", "/v1/processes"), ("gpus", "/v1/gpus"),
                         ("status", "/v1/status"), ("engine", "/v1/engine"), ("checks", "/v1/checks")):
        (out / f"{name}.json").write_text(json.dumps(control(sock_path, target), indent=1))
    mport = tomllib.loads(Path(cfg_path).read_text())["daemon"]["metrics_port"]
    import urllib.request

    (out / "metrics.txt").write_bytes(urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read())
    # the agents go: their alerts resolve
    for p in agents:
        p.kill()
        p.wait()
    t_kill = time.time()
    wait(lambda: not [a for a in control(sock_path, "/v1/alerts")["alerts"]
                      if a["alertname"] == "ForeignGpuProcess" and a["state"] == "firing"], 15, "alerts resolved")
    summary["foreign_resolved_after_kill_s"] = round(time.time() - t_kill, 3)
    # CPU again, with the engine under no load but after the agents (steady state)
    c0, w0 = cpu_seconds(daemon.pid), time.monotonic()
    time.sleep(10)
    summary["daemon_cpu_percent_of_core_after"] = round(100 * (cpu_seconds(daemon.pid) - c0) / (time.monotonic() - w0), 3)
finally:
    for p in agents:
        if p.poll() is None:
            p.kill()
    t_term = time.time()
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
    try:
        summary["daemon_exit_code"] = daemon.wait(90)
    except subprocess.TimeoutExpired:
        daemon.kill()
        summary["daemon_exit_code"] = "killed after 90 s"
    summary["sigterm_to_exit_s"] = round(time.time() - t_term, 2)
    time.sleep(0.3)
    stop_listening.set()
    order = [m for _, m in messages if m.split("=")[0] in ("READY", "WATCHDOG", "STOPPING")]
    summary["notify_kinds_in_order"] = [k for i, k in enumerate(m.split("=")[0] for m in order)
                                        if i == 0 or k != order[i - 1].split("=")[0]]
    (out / "notify.txt").write_text("\n".join(f"{t:.3f} {m!r}" for t, m in messages) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    log.close()

# --- the table, last
rows = [("READY after start (s)", summary.get("ready_s")),
        ("notify order", " > ".join(summary.get("notify_kinds_in_order", []))),
        ("engine CPUs / numa_maps", f"{summary.get('engine_cpus_allowed')} / {summary.get('engine_numa_maps_first', '')[:40]}"),
        ("NOTIFY_SOCKET in engine env", summary.get("engine_env_has_notify_socket"))]
for r in summary.get("foreign", []):
    rows.append((f"{r['agent']} ({r['mode']}) open->alert (s)", f"{r['open_to_alert_s']} (held->alert {r['held_to_alert_s']}; target <= 2)"))
rows += [("daemon CPU while watching (% of a core)", f"{summary.get('daemon_cpu_percent_of_core_idle_watch')} (target <= 1)"),
         ("daemon CPU after agents (% of a core)", summary.get("daemon_cpu_percent_of_core_after")),
         ("SIGTERM -> exit (s), code", f"{summary.get('sigterm_to_exit_s')}, {summary.get('daemon_exit_code')}")]
w = max(len(k) for k, _ in rows)
print("\n== zerod run on the device")
for k, v in rows:
    print(f"{k:<{w}}  {v}")
