"""The build report: one self-contained `report.html` per build, rebuilt from the files a build leaves."""

from edgetune.report.report import REPORT_NAME, render_report, tuning_curves

__all__ = ["REPORT_NAME", "render_report", "tuning_curves"]
