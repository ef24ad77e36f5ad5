"""TEST SCAFFOLDING: run SGLang's real SchedulePolicy.calc_priority with the MORI plugin
loaded the way SGLang loads it (entry point + hook registry), and print the queue order.

Run with the SGLang venv's python and tests/sglang/server.server_env(); prints a JSON list.
"""

import json
import os
import sys
import types

# 0.5.23's calc_priority may refresh waiting prefixes, which needs a whole published server
# config; the refresh touches LRU times, never the order this probe checks.
os.environ["SGLANG_ENABLE_WAITING_PREFIX_REFRESH"] = "0"

from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.srt.managers.schedule_policy import SchedulePolicy  # noqa: E402

from engine_patches import sglang_common  # noqa: E402
from engine_patches.hint_book import HintBatch  # noqa: E402

hints, queue = json.loads(sys.argv[1]), json.loads(sys.argv[2])
sglang_common.ENGINE.book.apply(HintBatch.parse({"epoch": 1, "hints": hints}))
cache = types.SimpleNamespace(disable=True, supports_fast_match_prefix=lambda: False)
policy = SchedulePolicy("fcfs", cache, True, False, False)
reqs = [types.SimpleNamespace(session_id=s) for s in queue]
policy.calc_priority(reqs)
print(json.dumps([r.session_id for r in reqs]))
