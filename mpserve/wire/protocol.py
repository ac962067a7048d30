"""The wire, as every caller imports it: the messages (``mpserve.wire.messages``: each body a frozen msgspec
Struct with its limits and rules) and their framing (``mpserve.wire.framing``: frames, batches, decoding).

    caller ─▶ protocol ─┬─▶ messages  (Request, GenerateParams, Done, ... ; pack, decode_as)
                        ├─▶ framing   (encode, decode, parse_header, encode_step, step_entries, ...)
                        └─▶ figures   (ModelStats, ModelScaling, TenantStats: what STATS carries)
"""

from mpserve.wire.figures import *  # noqa: F403
from mpserve.wire.framing import *  # noqa: F403
from mpserve.wire.messages import *  # noqa: F403
