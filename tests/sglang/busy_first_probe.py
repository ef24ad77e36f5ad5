"""TEST SCAFFOLDING: run SGLang 0.5.17's real SchedulePolicy.calc_priority with the MORI plugin
loaded the way SGLang loads it (entry point + hook registry), and print the queue order.

Run with the SGLang venv's python and tests/sglang/server.server_env(); prints a JSON list.
"""

import json
import sys
import types

from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.srt.managers.schedule_policy import SchedulePolicy  # noqa: E402

from engine_patches.hint_book import HintBatch  # noqa: E402
from engine_patches.sglang_0_5_17 import ENGINE  # noqa: E402

hints, queue = json.loads(sys.argv[1]), json.loads(sys.argv[2])
ENGINE.book.apply(HintBatch.parse({"epoch": 1, "hints": hints}))
cache = types.SimpleNamespace(disable=True, supports_fast_match_prefix=lambda: False)
policy = SchedulePolicy("fcfs", cache, True, False, False)
reqs = [types.SimpleNamespace(session_id=s) for s in queue]
policy.calc_priority(reqs)
print(json.dumps([r.session_id for r in reqs]))
