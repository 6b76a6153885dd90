"""Start-up checks (the fatal gate) and the ``check`` command, over one set of probes."""

from worker.checks.report import run_checks
from worker.checks.rows import CheckResult
from worker.checks.startup import StartupCheckFailed, run_startup_checks

__all__ = ["CheckResult", "StartupCheckFailed", "run_checks", "run_startup_checks"]
