"""What the functions of :mod:`kernel_variants` return, for annotations: a decision
(``Decision``), a bound op (``BoundOp``), a registered variant, calibration results, rows and
plans, verdicts, head-to-head results, system and build information. Callers get these objects
from the functions (a head-to-head also from a CSV file: ``HeadToHead.from_csv``)."""

from kernel_variants._api import (
    BuildResult,
    CalibrationJob,
    CalibrationPlan,
    HeadToHead,
    JobResult,
    ShadowReport,
    ShapeComparison,
    SystemInfo,
    TableRow,
)
from kernel_variants._policy import Decision
from kernel_variants._registry.registry import RegisteredVariant
from kernel_variants._runtime.bind import BoundOp
from kernel_variants._runtime.shadow import ShadowCount
from kernel_variants._table.rows import Verdict
from kernel_variants._tuning.calibrate import CalibrationResult, Progress

__all__ = [
    "BoundOp",
    "BuildResult",
    "CalibrationJob",
    "CalibrationPlan",
    "CalibrationResult",
    "Decision",
    "HeadToHead",
    "JobResult",
    "Progress",
    "RegisteredVariant",
    "ShadowCount",
    "ShadowReport",
    "ShapeComparison",
    "SystemInfo",
    "TableRow",
    "Verdict",
]
