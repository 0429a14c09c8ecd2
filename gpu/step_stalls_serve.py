"""`zerod serve` under one variant of gpu/step_stalls.sh:
    python3 gpu/step_stalls_serve.py VARIANT serve ARGS...

cudnn-every-length: the rule before, fresh prompts' SDPA through the default backend
                    (cuDNN's on the H200) at their own lengths: a plan built per new length;
shipped:            as shipped (engine/model/decoder.py: the plan-free backends up to
                    SDPA_FLASH_MAX_LEN, the default above with lengths padded to buckets);
profiled:           as shipped, sampled by py-spy (gpu/step_stalls.sh starts it): where the
                    step thread's CPU goes in what slow launches are left.
Every variant logs launches over 30 ms (the engine's own threshold is 100 ms): a plan
build is ~42 ms.
"""

from __future__ import annotations

from serve_variant import serve
from zerod.engine.core import engine
from zerod.engine.model import decoder as model


def _slow_launches_logged() -> None:
    engine.SLOW_LAUNCH_S = 0.03


def _cudnn_every_length() -> None:
    _slow_launches_logged()
    model.SDPA_FLASH_MAX_LEN = 0
    model.SDPA_PAD_LENGTHS = False


if __name__ == "__main__":
    serve("step_stalls_serve.py", {"cudnn-every-length": _cudnn_every_length, "shipped": _slow_launches_logged,
                                   "profiled": _slow_launches_logged})
