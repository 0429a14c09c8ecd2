"""The model spec, torch-free: the families (families.py), config.json and
generation_config.json read and refused (hf_config.py, rope_scaling.py, quant.py), the
files a checkpoint folder must hold (checkpoint.py), what a configuration cannot serve
(servable.py), the weights' bytes (weights.py) and the KV sizing (sizing.py). The engine
and `zerod doctor` both read a checkpoint through it."""
