"""`python -m riskreport`: the same report as `riskserve shadow-report`."""

from riskreport.cli import shadow_report_main

raise SystemExit(shadow_report_main(prog="python -m riskreport"))
