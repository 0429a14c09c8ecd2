"""Benchmarks: `zerod bench` (a streaming HTTP client for any OpenAI-compatible server)
and the tools behind the side-by-side figures of docs/perf.md.

This room measures from outside and imports nothing of the engine, the daemon or the
checks. `cli` is the command; `client`, `scenarios`, `stats` and `server_cpu` its parts.
`doctor_walltime` (wall time of `zerod doctor --json`) and `hf_compare` (the Hugging Face
transformers side of each comparison; needs `transformers` and a GPU) run as
`python -m zerod.bench.doctor_walltime` / `python -m zerod.bench.hf_compare`.
"""
