"""The conv ops' named sweeps of (B, D, L) shapes.

``seed69`` is the 69 shapes of the Ascend 910B2 regression report; ``seed69-cpu`` the same with
B divided by 64 (B from 1 to 128) so a CPU measures them in minutes; ``decode`` and
``decode-spec`` the decode sweep of causal_conv1d_update; ``smoke`` a few tiny shapes.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from kernel_variants._registry.case import Sweep, read_csv_rows, read_shapes
from kernel_variants._registry.spec import Shape

FN, UPDATE = "causal_conv1d_fn", "causal_conv1d_update"
# CSV column names of each axis, as the regression report and users write them
AXIS_ALIASES = {"B": ("B", "batch"), "D": ("dim", "D"), "L": ("seq", "L", "seqlen")}


def _seed69() -> tuple[Shape, ...]:
    path = Path(str(files(__package__) / "seed69.csv"))
    return tuple(read_shapes(*read_csv_rows(path), ("B", "D", "L"), AXIS_ALIASES, str(path))[1])


def sweeps() -> dict[str, dict[str, Sweep]]:
    """op -> sweep name -> sweep."""
    seed = _seed69()
    decode = tuple((b, d, 1) for b in (1, 8, 64, 256) for d in (1024, 4096, 8192))
    return {
        FN: {
            "seed69": Sweep("seed69", FN, seed, description="the 69 shapes of the 910B2 regression report"),
            "seed69-cpu": Sweep("seed69-cpu", FN, tuple((max(b // 64, 1), d, s) for b, d, s in seed),
                                description="seed69 with B divided by 64, for CPUs"),
            "smoke": Sweep("smoke", FN, ((1, 64, 16), (2, 256, 64), (4, 512, 128), (8, 1024, 256)),
                           description="a few small shapes, seconds to calibrate"),
        },
        UPDATE: {
            "decode": Sweep("decode", UPDATE, decode, description="decode: B x D, one token"),
            "decode-spec": Sweep("decode-spec", UPDATE, tuple((b, d, 4) for b, d, _ in decode), {"spec": True},
                                 description="speculative verify: B x D, L=4 with num_accepted_tokens"),
        },
    }
