"""A corpus of bad configs, each as a careless operator writes it (issue 36, item 5):
`zerod config check` refuses every one with one line per problem and exit 78, never a
traceback, never a hang; `zerod run` refuses the same ones with 78 before anything starts
(the exit code systemd's RestartPreventExitStatus stops on, so no restart loop)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from zerod.cmd_config import config as config_command
from zerod.config import MAX_CONFIG_BYTES
from zerod.engine.config import MAX_NUM_SEQS

ROOT = Path(__file__).resolve().parent.parent
M = '[engine]\nmodel = "demo"\n'

# (id, file text, a piece of the refusal)
CORPUS = [
    # the engine's own bounds and callbacks, which only `zerod serve` knew
    ("block_size_3", M + "block_size = 3\n", "block_size must be a power of two"),
    ("block_size_0", M + "block_size = 0\n", "block_size"),
    ("lora_modules_int", M + "enable_lora = true\nlora_modules = 5\n", "is not name=path"),
    ("lora_modules_no_enable", M + 'lora_modules = ["a=/tmp"]\n', "need enable_lora"),
    ("lora_modules_missing_dir", M + 'enable_lora = true\nlora_modules = ["a=/nonexistent/adapter"]\n',
     "is not a directory"),
    ("lora_modules_bad_json", M + 'enable_lora = true\nlora_modules = ["{oops"]\n', "not valid JSON"),
    ("runtime_lora_no_enable", M + "allow_runtime_lora = true\n", "need enable_lora"),
    ("max_num_seqs_1e20", M + "max_num_seqs = 100000000000000000000\n", f"<= {MAX_NUM_SEQS}"),
    ("max_num_seqs_1e9", M + "max_num_seqs = 1000000000\n", f"<= {MAX_NUM_SEQS}"),
    ("max_num_seqs_float", M + "max_num_seqs = 1e9\n", "must be a whole number"),
    ("max_num_batched_tokens_huge", M + "max_num_batched_tokens = 9999999999999\n", "<= 2147483647"),
    ("max_model_len_1", M + "max_model_len = 1\n", "max_model_len"),
    ("gpu_mem_2", M + "gpu_memory_utilization = 2.0\n", "gpu_memory_utilization"),
    ("gpu_mem_tiny", M + "gpu_memory_utilization = 0.01\n", "gpu_memory_utilization"),
    ("kv_pages_1", M + "kv_pages = 1\n", "kv_pages"),
    ("target_itl_0", M + "target_itl_ms = 0\n", "target_itl_ms"),
    ("max_loras_0", M + "enable_lora = true\nmax_loras = 0\n", "max_loras"),
    ("max_lora_rank_big", M + "enable_lora = true\nmax_lora_rank = 4096\n", "max_lora_rank"),
    ("max_cpu_loras_small", M + "enable_lora = true\nmax_loras = 4\nmax_cpu_loras = 2\n", "max_cpu_loras"),
    ("tool_choice_no_parser", M + "enable_auto_tool_choice = true\n", "needs tool_call_parser"),
    ("chat_template_missing", M + 'chat_template = "/nonexistent/t.jinja"\n', "chat_template"),
    ("model_missing_path", '[engine]\nmodel = "/nonexistent/model"\n', "no such directory"),
    ("model_is_file", '[engine]\nmodel = "/etc/hostname"\n', "is not a directory"),
    ("model_dir_no_config", '[engine]\nmodel = "/tmp"\n', "has no config.json"),
    ("model_empty", '[engine]\nmodel = ""\n', "model"),
    ("dtype_bad", M + 'dtype = "fp4"\n', "dtype"),
    ("device_bad", M + 'device = "tpu"\n', "device"),
    ("kv_dtype_bad", M + 'kv_cache_dtype = "int4"\n', "kv_cache_dtype"),
    ("tp_zero", M + "tensor_parallel_size = 0\n", "tensor_parallel_size"),
    ("tp_string", M + 'tensor_parallel_size = "2"\n', "tensor_parallel_size"),
    # ports: the daemon's endpoints against the engine's
    ("port_is_metrics_port", M + "port = 9477\n", "metrics_port too"),
    ("port_is_set_metrics_port", M + "port = 9100\n[daemon]\nmetrics_port = 9100\n", "metrics_port too"),
    ("port_wildcard_metrics", M + 'port = 9100\nhost = "0.0.0.0"\n[daemon]\nmetrics_port = 9100\n',
     "metrics_port too"),
    ("port_negative", M + "port = -1\n", "port"),
    ("port_huge", M + "port = 70000\n", "port"),
    ("port_string", M + 'port = "http"\n', "port"),
    # the schema's own refusals
    ("typo_engine", M + "max_modle_len = 4\n", "did you mean max_model_len"),
    ("typo_daemon", M + "[daemon]\nhealth_intervall_s = 1\n", "unknown key"),
    ("nan_interval", M + "[daemon]\nhealth_interval_s = nan\n", "finite"),
    ("inf_watch", M + "[daemon]\nwatch_interval_s = inf\n", "finite"),
    ("threshold_0", M + "[daemon]\nhealth_failure_threshold = 0\n", "health_failure_threshold"),
    ("period_neg", M + "[daemon]\nhealth_failure_period_s = -1\n", "health_failure_period_s"),
    ("slow_limit_str", M + '[daemon]\nhealth_slow_limit_s = "2m"\n', "health_slow_limit_s"),
    ("metrics_port_big", M + "[daemon]\nmetrics_port = 99999\n", "metrics_port"),
    ("socket_long", M + '[daemon]\ncontrol_socket = "/tmp/' + "x" * 200 + '"\n', "107 bytes"),
    ("socket_int", M + "[daemon]\ncontrol_socket = 5\n", "control_socket"),
    ("engine_kind", M + '[daemon]\nengine = "tgi"\n', "engine"),
    ("numa_bad", M + '[daemon]\nnuma = "yes"\n', "numa"),
    ("engine_command_empty", M + "[daemon]\nengine_command = []\n", "engine_command"),
    ("alerts_url", M + '[alerts]\nalertmanager_url = "am:9093"\n', "http://"),
    ("alerts_labels", M + '[alerts]\nlabels = "x"\n', "labels"),
    ("doctor_waiver", M + '[doctor.waivers]\n"gpu.nope" = "x"\n', "no such check ID"),
    ("doctor_type", M + '[doctor]\nmax_num_seqs = "x"\n', "whole number"),
    ("section_unknown", M + "[demon]\nx = 1\n", "unknown section"),
    ("section_not_table", 'engine = 5\n', "must be a table"),
    ("engines_empty", "engines = []\n" + M, "[[engines]]"),
    ("engines_no_gpus", M + '[[engines]]\nname = "a"\nport = 8001\n', "gpus is not set"),
    ("engines_dup_port", M + '[[engines]]\nname = "a"\ngpus = [0]\nport = 8001\n'
                             '[[engines]]\nname = "b"\ngpus = [1]\nport = 8001\n', "is the port of"),
    ("engines_block_size", M + '[[engines]]\nname = "a"\ngpus = [0]\nport = 8001\nblock_size = 3\n',
     "block_size must be a power of two"),
    ("engines_metrics_port", M + '[[engines]]\nname = "a"\ngpus = [0]\nport = 9477\n', "metrics_port too"),
    # files that are not a config at all
    ("not_toml", "this is not toml = = =\n", "not valid TOML"),
    ("not_utf8", b"[engine]\nmodel = \"\xff\xfe\"\n", "not valid TOML"),
    ("deep_array", M + "x = " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper"),
    ("deep_table", M + "x = " + "{ a = " * 40 + "1" + " }" * 40 + "\n", "nested deeper"),
    ("huge_file", M + "# " + "x" * MAX_CONFIG_BYTES + "\n", "MAX_CONFIG_BYTES"),
]
SPECIAL = ["fifo", "directory", "dangling_link", "dev_zero"]


def _path(tmp_path: Path, case: str) -> Path:
    p = tmp_path / f"{case}.toml"
    if case == "fifo":
        os.mkfifo(p)
    elif case == "directory":
        p.mkdir()
    elif case == "dangling_link":
        p.symlink_to(tmp_path / "nowhere.toml")
    elif case == "dev_zero":
        p.symlink_to("/dev/zero")
    else:
        text = dict((c[0], c[1]) for c in CORPUS)[case]
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


def test_dev_null_is_an_empty_config_on_purpose():
    r = CliRunner().invoke(config_command, ["check", "--demo", os.devnull])
    assert r.exit_code == 0 and r.output.strip() == f"{os.devnull}: OK", r.output


def test_the_corpus_is_large():
    assert len(CORPUS) + len(SPECIAL) >= 65


@pytest.mark.parametrize("case, text, expected", CORPUS, ids=[c[0] for c in CORPUS])
def test_config_check_refuses_each_with_78_and_one_line(tmp_path, case, text, expected):
    r = CliRunner().invoke(config_command, ["check", str(_path(tmp_path, case))])
    assert r.exit_code == 78, (r.exit_code, r.output, r.exception)
    assert "Traceback" not in r.output and r.exception is None or isinstance(r.exception, SystemExit)
    lines = r.output.strip().splitlines()
    assert lines[-1].endswith("zerod run would refuse to start")
    assert any(expected in line for line in lines[:-1]), r.output
    assert all(len(line) < 600 for line in lines), "a refusal echoes its input at length"


@pytest.mark.parametrize("case", SPECIAL)
def test_config_check_refuses_files_that_are_not_configs_without_waiting(tmp_path, case):
    r = subprocess.run([sys.executable, "-m", "zerod", "config", "check", str(_path(tmp_path, case))],
                       cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert r.returncode == 78, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 2, r.stderr


@pytest.mark.parametrize("case", ["block_size_3", "lora_modules_int", "port_is_metrics_port",
                                  "max_num_seqs_1e20", "model_missing_path", "deep_array", "fifo",
                                  "directory"])
def test_zerod_run_refuses_what_check_refuses_with_78(tmp_path, case):
    r = subprocess.run([sys.executable, "-m", "zerod", "run", "--config", str(_path(tmp_path, case))],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 78, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "configuration refused" in r.stderr
