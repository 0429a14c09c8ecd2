"""The configuration checked before anything starts: one line per refusal
naming the key, the value and what is allowed; `zerod run` exits 78 without
a traceback; `zerod config check` says OK or the same refusals."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from zerod.cmd_config import check_config, config as config_command

ROOT = Path(__file__).resolve().parent.parent
MODEL = '[engine]\nmodel = "demo"\n'


def refusals(text: str, demo: bool = False) -> list[str]:
    data = tomllib.loads(text)
    return check_config({s: data.get(s, {}) for s in ("doctor", "engine", "daemon", "alerts")}, demo=demo)


@pytest.mark.parametrize("text, expected", [
    # [doctor]
    ('[doctor]\nmax_num_seq = 8\n', '[doctor] max_num_seq = 8: unknown key (did you mean max_num_seqs?)'),
    ('[doctor]\nmax_num_seqs = "eight"\n', '[doctor] max_num_seqs = "eight": must be a whole number'),
    ('[doctor]\nmin_kernel_version = 5.10\n', '[doctor] min_kernel_version = 5.1: must be a string (in quotes)'),
    ('[doctor.waivers]\n"gpu.persistance_mode" = "cloud"\n',
     '[doctor] waivers."gpu.persistance_mode" = "cloud": no such check ID'),
    # [engine]: zerod serve's own options
    ('[engine]\nmodel = "demo"\nmax_modle_len = 4096\n',
     '[engine] max_modle_len = 4096: unknown key (did you mean max_model_len?)'),
    ('[engine]\nmodel = "demo"\nmax_num_seqs = "eight"\n', '[engine] max_num_seqs = "eight": must be a whole number'),
    ('[engine]\nmodel = "demo"\nmax_num_seqs = -1\n', '[engine] max_num_seqs = -1: must be >= 1 (zerod serve --max-num-seqs)'),
    ('[engine]\nmodel = "demo"\ngpu_memory_utilization = nan\n',
     '[engine] gpu_memory_utilization = nan: must be a finite number'),
    ('[engine]\nmodel = "demo"\nenforce_eager = "yes"\n', '[engine] enforce_eager = "yes": must be true or false'),
    ('[engine]\nmodel = "demo"\ndtype = "fp8"\n', "[engine] dtype = \"fp8\": 'fp8' is not one of"),
    ('[engine]\nmax_num_seqs = 8\n', '[engine] model is not set: set it to a checkpoint directory'),
    # [daemon]
    (MODEL + '[daemon]\ncontrol_socket = 5\n', '[daemon] control_socket = 5: must be a string'),
    (MODEL + '[daemon]\ncontrol_socket = "/tmp/' + 'x' * 120 + '"\n', 'must be at most 107 bytes long'),
    (MODEL + '[daemon]\nwatch_interval_s = inf\n', '[daemon] watch_interval_s = inf: must be a finite number >= 0.1'),
    (MODEL + '[daemon]\nhealth_interval_s = nan\n', '[daemon] health_interval_s = nan: must be a finite number'),
    (MODEL + '[daemon]\nlatency_min_samples = -1\n', '[daemon] latency_min_samples = -1: must be >= 0'),
    (MODEL + '[daemon]\nrestart_backoff_initial_s = 90\n',
     '[daemon] restart_backoff_initial_s = 90.0: must be <= restart_backoff_max_s (60)'),
    (MODEL + '[daemon]\nhealth_interval_s = 5\n', '[daemon] health_timeout_s = 3.0: must be > health_interval_s (5)'),
    (MODEL + '[daemon]\nthrottle_alert_reasons = "hw_slowdown"\n',
     '[daemon] throttle_alert_reasons = "hw_slowdown": must be a list of strings'),
    (MODEL + '[daemon]\nthrottle_alert_reasons = ["hw_slowdwn"]\n',
     '[daemon] throttle_alert_reasons = ["hw_slowdwn"]: each must be one of gpu_idle,'),
    (MODEL + '[daemon]\nnuma = "on"\n', '[daemon] numa = "on": must be one of auto, builtin, numactl, off'),
    (MODEL + '[daemon]\nengine_command = []\n', '[daemon] engine_command = []: must be a non-empty list'),
    (MODEL + '[daemon]\nmetrics_port = 70000\n', '[daemon] metrics_port = 70000: must be >= -1 and <= 65535'),
    # [alerts]
    (MODEL + '[alerts]\nlabels = "x"\n', '[alerts] labels = "x": must be a table of name = "text"'),
    (MODEL + '[alerts]\nlabels = { "bad-name" = "x" }\n', 'label names must match'),
    (MODEL + '[alerts]\nalertmanager_url = "alertmanager:9093"\n', 'must start with http:// or https://'),
])
def test_each_refusal_is_one_line_with_key_value_and_what_is_allowed(text, expected):
    out = refusals(text if "[engine]" in text else MODEL + text)
    assert len(out) == 1, out
    assert expected in out[0] and "\n" not in out[0], out


def test_a_good_config_and_the_shipped_example():
    assert refusals(MODEL + '[daemon]\nrestart_backoff_initial_s = 0.5\nslo_itl_p99_s = 0.1\n') == []
    assert refusals('[engine]\nmodel = "demo"\nserved_model_name = ["a", "b"]\nkv_cache_memory_bytes = "2GiB"\n'
                    'enforce_eager = true\ngpu_memory_utilization = 0.9\n') == []
    example = (ROOT / "systemd/zerod.toml.example").read_text()
    # as `zerod install` leaves it: no model; with --demo it is fine
    assert refusals(example) == [refusals('[engine]\n')[0]] and "model is not set" in refusals(example)[0]
    assert refusals(example, demo=True) == []
    # another engine (engine_command) needs no zerod serve model
    assert refusals('[daemon]\nengine_command = ["/opt/vllm/bin/vllm", "serve"]\n') == []


def test_all_refusals_at_once():
    out = refusals('[engine]\nmax_modle_len = 1\n[daemon]\nwatch_interval_s = inf\ncontrol_socket = 5\n'
                   '[alerts]\nlabels = "x"\n')
    assert len(out) == 5, out  # the typo, no model, two [daemon] keys, [alerts]


def test_zerod_run_refuses_with_78_one_line_each_and_no_traceback(tmp_path):
    cfg = tmp_path / "zerod.toml"
    cfg.write_text('[engine]\nmax_modle_len = 4096\n[daemon]\nhealth_interval_s = nan\ncontrol_socket = 5\n'
                   '[alerts]\nlabels = "x"\n[doctor]\nwaivers = 3\n')
    r = subprocess.run([sys.executable, "-m", "zerod", "run", "--config", str(cfg)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 78, r.stderr
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if "configuration refused:" in line]
    assert len(lines) == 6, r.stderr  # max_modle_len, no model, nan, 5, labels, waivers
    for key in ("max_modle_len", "health_interval_s = nan", "control_socket = 5", 'labels = "x"',
                "model is not set", "waivers = 3"):
        assert any(key in line for line in lines), key


def test_config_check_command(tmp_path):
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text(MODEL)
    bad.write_text(MODEL + "[daemon]\nwatch_interval_s = 0\n")
    r = CliRunner().invoke(config_command, ["check", str(good)])
    assert r.exit_code == 0 and r.output.strip() == f"{good}: OK"
    r = CliRunner().invoke(config_command, ["check", str(bad)])
    assert r.exit_code == 78 and "[daemon] watch_interval_s = 0: must be >= 0.1" in r.output
    r = CliRunner().invoke(config_command, ["check", str(tmp_path / "missing.toml")])
    assert r.exit_code == 78 and "does not exist" in r.output
    r = CliRunner().invoke(config_command, ["check", "--demo", str(tmp_path / "missing.toml")])
    assert r.exit_code == 78
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert CliRunner().invoke(config_command, ["check", "--demo", str(empty)]).exit_code == 0


def test_checking_engine_keys_does_not_import_torch():
    r = subprocess.run([sys.executable, "-c", "import sys, zerod.cmd_config; print('torch' in sys.modules)"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr


FLEET = """
[engine]
model = "demo"
[[engines]]
name = "a"
gpus = [0, 1]
port = 8001
[[engines]]
name = "b"
gpus = [2]
port = 8002
max_num_seqs = 8
"""


def fleet_refusals(text: str) -> list[str]:
    return check_config(tomllib.loads(text))


def test_engines_tables_each_with_its_gpus_port_and_flags(tmp_path):
    (tmp_path / "z.toml").write_text(FLEET)
    r = CliRunner().invoke(config_command, ["check", str(tmp_path / "z.toml")])
    assert r.exit_code == 0 and r.output.endswith(": OK\n")
    (tmp_path / "z.toml").write_text(FLEET.replace("gpus = [2]", "gpus = [1]"))
    r = CliRunner().invoke(config_command, ["check", str(tmp_path / "z.toml")])
    assert r.exit_code == 78 and "GPU 1 is in [engines.a] already" in r.output
    assert fleet_refusals(FLEET) == []
    assert fleet_refusals(FLEET + 'tensor_parallel_size = 1\n') == []  # said explicitly: must match its GPUs
    assert fleet_refusals('[engine]\nmodel = "demo"\ntensor_parallel_size = 2\n') == []  # accepted before serve has it


@pytest.mark.parametrize("extra, expected", [
    ('[[engines]]\nname = "a"\ngpus = [3]\nport = 8003\n',
     ['[engines.2] name = "a": is the name of engines.0 too: names must differ']),
    ('[[engines]]\nname = "c"\ngpus = [1, 3]\nport = 8003\n',
     ["[engines.c] gpus = [1, 3]: GPU 1 is in [engines.a] already: a GPU serves one engine"]),
    ('[[engines]]\nname = "c"\ngpus = [3]\nport = 8002\n',
     ["[engines.c] port = 8002: is the port of [engines.b] already"]),
    ('[[engines]]\nname = "c"\ngpus = [3, 3]\nport = 8003\n', ["[engines.c] gpus = [3, 3]: lists a GPU twice"]),
    ('[[engines]]\nname = "c d"\ngpus = [3]\nport = 8003\n',
     ['[engines.2] name = "c d": must be 1-32 of A-Z a-z 0-9 _ . - (the engine\'s label)']),
    ('[[engines]]\nname = "c"\nport = 8003\n',
     ["[engines.c] gpus is not set: the GPU indexes this engine runs on, e.g. gpus = [0]"]),
    ('[[engines]]\nname = "c"\ngpus = [3]\n', ["[engines.c] port is not set: each engine listens on a port of its own"]),
    ('[[engines]]\nname = "c"\ngpus = [3, 4]\nport = 8003\ntensor_parallel_size = 4\n',
     ["[engines.c] tensor_parallel_size = 4: must equal the number of its GPUs (2), or be left out"]),
    ('[[engines]]\nname = "c"\ngpus = [3]\nport = 8003\nmax_num_seqs = 0\n',
     ["[engines.c] max_num_seqs = 0: must be >= 1 (zerod serve --max-num-seqs)"]),
    ('[daemon]\ngpu_index = 1\n', ["[daemon] gpu_index = 1: with [[engines]], each entry's gpus say it"]),
])
def test_engines_refusals(extra, expected):
    text = FLEET + extra
    if extra.startswith("[daemon]"):
        text = extra + FLEET
    assert fleet_refusals(text) == expected
