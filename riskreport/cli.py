"""``riskserve shadow-report``: build an experiment report, print its key table, write files."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from engines.manifest import Thresholds, load_manifest
from riskreport.build import (
    DEFAULT_MEMORY_LIMIT,
    DEFAULT_RESAMPLES,
    DEFAULT_SEED,
    build_report,
    elapsed_printer,
)
from riskreport.html import render_html
from riskreport.summary import render_summary
from service.shadow.errors import ShadowError

__all__ = ["configure_parser", "run_shadow_report", "shadow_report_main"]


def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the subcommand's options to `parser` (a subparser of the main CLI or a fresh one)."""
    parser.add_argument(
        "--prefix",
        help="log folder or URI (default: RISKSERVE_SHADOW_LOG_PREFIX, as the server writes it)",
    )
    parser.add_argument("--experiment", help="experiment name when the prefix holds several")
    parser.add_argument("--labels", help="labels file (CSV or Parquet) to measure quality")
    parser.add_argument("--start", type=_utc, help="ISO 8601 start (inclusive); naive = UTC")
    parser.add_argument("--end", type=_utc, help="ISO 8601 end (exclusive); naive = UTC")
    parser.add_argument("--model-dir", type=Path, help="model version folder: its thresholds")
    parser.add_argument("--review", type=float, help="review threshold in [0, 1] (with --decline)")
    parser.add_argument(
        "--decline", type=float, help="decline threshold in [--review, 1] (with --review)"
    )
    parser.add_argument(
        "--bootstrap", type=int, default=DEFAULT_RESAMPLES,
        help="Poisson-bootstrap resamples for the intervals; 0 = analytic (DeLong)",
    )  # fmt: skip
    parser.add_argument(
        "--unit", choices=("entity", "request"), default="entity",
        help="what the intervals treat as independent (default: entity)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="bootstrap seed")
    parser.add_argument(
        "--memory-limit", default=DEFAULT_MEMORY_LIMIT,
        help="DuckDB memory cap, e.g. 1GB (it spills to disk beyond it)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, help="DuckDB threads (default: all cores)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--json", type=Path, help="write the report as JSON here")
    parser.add_argument("--html", type=Path, help="write the report as an HTML page here")
    return parser


def _settings_prefix() -> str:
    """Where the server writes its experiment logs: the same setting it reads."""
    from service.config import Settings

    return Settings().shadow_log_prefix  # type: ignore[call-arg]  # fields from the environment


class _OptionError(ValueError):
    """Options that cannot be run as given; the message names the flags."""


def run_shadow_report(args: argparse.Namespace) -> int:
    """Run with parsed options; prints the key table, returns the exit status."""
    try:
        thresholds = _thresholds(args)
    except _OptionError as exc:
        print(f"shadow-report: {exc}", file=sys.stderr)
        return 2
    prefix = args.prefix or _settings_prefix()
    try:
        report = build_report(
            prefix,
            start=args.start,
            end=args.end,
            labels_path=args.labels,
            thresholds=thresholds,
            experiment=args.experiment,
            bootstrap_resamples=args.bootstrap,
            seed=args.seed,
            unit=args.unit,
            memory_limit=args.memory_limit,
            threads=args.threads,
            progress=None if args.quiet else elapsed_printer(sys.stderr),
        )
    except ShadowError as exc:
        print(f"shadow-report: {exc}", file=sys.stderr)
        return 2
    if args.json:
        args.json.write_text(report.to_json())
    if args.html:
        args.html.write_text(render_html(report))
    print(render_summary(report))
    return 0


def shadow_report_main(
    argv: Sequence[str] | None = None, *, prog: str = "riskserve shadow-report"
) -> int:
    """Parse `argv` (default: the process's arguments) and run; returns the exit status."""
    parser = configure_parser(argparse.ArgumentParser(prog=prog))
    return run_shadow_report(parser.parse_args(argv))


def _utc(text: str) -> datetime:
    moment = datetime.fromisoformat(text)
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _thresholds(args: argparse.Namespace) -> Thresholds | None:
    """The decision thresholds: --model-dir's, or --review with --decline; or none. Raises
    _OptionError naming the flags where they are incomplete, contradict, or cannot work."""
    given = [flag for flag in ("--review", "--decline") if getattr(args, flag[2:]) is not None]
    if args.model_dir is not None:
        if given:
            raise _OptionError(f"--model-dir gives the thresholds: drop {' and '.join(given)}")
        return load_manifest(args.model_dir).thresholds
    if not given:
        return None
    if len(given) == 1:
        other = "--decline" if given == ["--review"] else "--review"
        raise _OptionError(f"{given[0]} needs {other}: give both thresholds, or --model-dir")
    review, decline = args.review, args.decline
    for flag, value in (("--review", review), ("--decline", decline)):
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise _OptionError(f"{flag} {value:g} is not a score in [0, 1]")
    if decline < review:
        raise _OptionError(
            f"--decline {decline:g} is below --review {review:g}: scores from --review up are "
            "reviewed and from --decline up declined, so --decline must be at least --review"
        )
    return Thresholds(review=review, decline=decline)
