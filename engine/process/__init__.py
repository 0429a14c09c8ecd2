"""The engine in its own process (`zerod serve --engine-process`).

The HTTP server's Python (accepting, parsing, validating, tokenizing, writing each
token) and the step thread's (scheduling, staging, launching) share one GIL when they
share a process: during a burst of arrivals the step thread waits for it at each torch
call's return (docs/perf.md, *The GIL and the step thread*). Here the HTTP server keeps
the process it was started in and talks to the engine through `EngineClient`, an
`EngineLike`; the engine (scheduler, step thread, output poller, detokenizer) runs in a
child process (`child.py`) and the two exchange pickled messages over a socket pair
(`channel.py`).
"""
