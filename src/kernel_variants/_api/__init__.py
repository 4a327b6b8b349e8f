"""The public functions behind ``kernel_variants``: calibration and the table
(:mod:`.calibration`), planning what a calibration measures (:mod:`.plan`), head-to-heads
(:mod:`.compare`), qualification (:mod:`.qualification`), moving tables between machines and ranks
(:mod:`.exchange`) and what this installation holds (:mod:`.system`). Only re-exports here."""

from kernel_variants._api.calibration import (
    TableRow,
    calibrate,
    check_shapes,
    clear_table,
    missing_variants,
    recorded,
    recorder,
    stale_rows,
    table,
)
from kernel_variants._api.compare import HeadToHead, ShapeComparison, compare
from kernel_variants._api.exchange import (
    check_agreement,
    export_table,
    import_table,
)
from kernel_variants._api.plan import CalibrationJob, CalibrationPlan, JobResult, plan_calibration
from kernel_variants._api.qualification import QUALIFY_DTYPES, clear_verdicts, qualify, verdicts
from kernel_variants._api.shadowing import (
    ShadowReport,
    clear_shadow,
    replay_mismatch,
    shadow,
    shadow_report,
)
from kernel_variants._api.system import (
    BuildResult,
    SystemInfo,
    build,
    dtype_name,
    info,
    op_specs,
    read_sweep,
)

__all__ = [
    "QUALIFY_DTYPES",
    "BuildResult",
    "CalibrationJob",
    "CalibrationPlan",
    "HeadToHead",
    "JobResult",
    "ShadowReport",
    "ShapeComparison",
    "SystemInfo",
    "TableRow",
    "build",
    "calibrate",
    "check_agreement",
    "check_shapes",
    "clear_shadow",
    "clear_table",
    "clear_verdicts",
    "compare",
    "dtype_name",
    "export_table",
    "import_table",
    "info",
    "missing_variants",
    "op_specs",
    "plan_calibration",
    "qualify",
    "read_sweep",
    "recorded",
    "recorder",
    "replay_mismatch",
    "shadow",
    "shadow_report",
    "stale_rows",
    "table",
    "verdicts",
]
