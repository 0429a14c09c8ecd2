# Sourced by the device scripts that need the daemon: `zerod run` with the default config
# plus a dummy engine of $M ($DT on $DEV, port 8000), its control socket under $W/run, the
# doctor checks that fail on the device VM before the run waived (named in the output),
# and wait until the engine is healthy. Leaves the daemon's pid in DPID.
# DAEMON_EXTRA: more [daemon] lines (gpu/diag_faults.sh: ZEROD_FAULT, the canary's interval).
#   M=... DEV=... DT=... W=... PY=... . gpu/parts/daemon_up.sh
CFG="$W/zerod.toml"
cat > "$CFG" <<TOML
[engine]
model = "$M"
load_format = "dummy"
dtype = "$DT"
device = "$DEV"
max_model_len = 8192
max_num_seqs = 256
gpu_memory_utilization = 0.80
port = 8000

[daemon]
control_socket = "$W/run/control.sock"
metrics_port = 9477
${DAEMON_EXTRA:-}
TOML
$PY -m zerod doctor --json --config "$CFG" > "$W/doctor.json"
$PY - "$W/doctor.json" "$CFG" <<'PYEOF'
import json, sys
fails = [c["id"] for c in json.load(open(sys.argv[1]))["checks"] if c["status"] == "fail"]
if fails:
    with open(sys.argv[2], "a") as f:
        f.write("\n[doctor.waivers]\n" + "".join(f'"{i}" = "failing on the device VM before the run"\n' for i in fails))
print("waived:", fails)
PYEOF
echo "== $(date -u +%T) zerod run" | tee -a "$W/timeline.txt"
$PY -m zerod run --config "$CFG" > "$W/daemon.log" 2>&1 &
DPID=$!
$PY gpu/control_wait.py "$W/run/control.sock" healthy 150 | tee -a "$W/timeline.txt"
