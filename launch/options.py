"""Command line of ``python -m launch``: the launcher's own options plus torchrun's, unchanged.

torchrun's options are parsed with torchrun's own parser (``torch.distributed.run``), so every
option it has is accepted and validated as torchrun would, and forwarded token for token. The
only rewrite: ``--max-restarts N`` becomes N + 1 launcher starts and torchrun gets
``--max-restarts 0``, because an in-place torchrun restart does not give the checkpoint group
a fresh rendezvous (docs/launcher.md).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

from torch.distributed.run import get_args_parser

from dist_ckpt.launcher_api import RUNS_DIR, STOP_NAME

DEFAULT_BACKOFF = (10.0, 20.0, 40.0)
DEFAULT_STARTUP_TIMEOUT = 900.0
DEFAULT_STRAGGLER_FACTOR = 1.5
DEFAULT_STRAGGLER_WINDOW = 20
DEFAULT_GRACE_S = 60.0
DEFAULT_MAX_NO_PROGRESS = 2
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass
class LaunchOptions:
    checkpoint_root: str
    max_starts: int
    backoff_s: list[float]
    stop_file: str
    fresh: bool
    min_free_bytes: int | None
    run_id: str | None
    mirror: str | None
    torchrun_argv: list[str]
    torchrun: argparse.Namespace
    notes: list[str] = field(default_factory=list)
    hang_timeout: float | str = "auto"
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT
    straggler_factor: float = DEFAULT_STRAGGLER_FACTOR
    straggler_window: int = DEFAULT_STRAGGLER_WINDOW
    preempt_signal: signal.Signals = signal.SIGTERM
    grace_s: float = DEFAULT_GRACE_S
    max_no_progress: int = DEFAULT_MAX_NO_PROGRESS

    def backoff_before(self, start: int) -> float:
        """Seconds to wait before start number ``start`` (2, 3, ...)."""
        if start <= 1 or not self.backoff_s:
            return 0.0
        return self.backoff_s[min(start - 2, len(self.backoff_s) - 1)]


def _backoff(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--backoff wants seconds like 10,20,40, not {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError("--backoff values must be >= 0")
    return values


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def _bytes(text: str) -> int:
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"--min-free-bytes wants a size like 5000000000 or 5G, "
                                         f"not {text!r}")
    return int(match.group(1)) * units[match.group(2)]


def _seconds(name: str, *, zero_ok: bool = False) -> Callable[[str], float]:
    """A parser of ``name``'s seconds: positive and finite, or (``zero_ok``) any value >= 0."""
    def parse_seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} wants seconds, not {text!r}") from None
        if zero_ok and value < 0:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, not {value}")
        if not zero_ok and (not value > 0 or value == float("inf")):
            raise argparse.ArgumentTypeError(f"{name} must be a positive number of seconds, not {text}")
        return value
    return parse_seconds


def _hang_timeout(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return _seconds("--hang-timeout")(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"--hang-timeout wants seconds (> 0) or auto, not {text!r}") from None


def _factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--straggler-factor wants a number, not {text!r}") from None
    if not 1 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"--straggler-factor must be more than 1, not {text}")
    return value


def _window(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--straggler-window wants a number of updates, not {text!r}") from None
    if value < 3:
        raise argparse.ArgumentTypeError(f"--straggler-window must be at least 3 updates, not {value}")
    return value


def _signal(text: str) -> signal.Signals:
    name = text.strip().upper()
    try:
        chosen = signal.Signals(int(name)) if name.isdigit() else signal.Signals[
            name if name.startswith("SIG") else f"SIG{name}"]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"--preempt-signal wants a signal like USR1, not {text!r}") from None
    if chosen in (signal.SIGKILL, signal.SIGSTOP):
        raise argparse.ArgumentTypeError(f"--preempt-signal {chosen.name} cannot be caught")
    return chosen


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {value}")
    return value


def _run_id(text: str) -> str:
    if not _RUN_ID.match(text):
        raise argparse.ArgumentTypeError(f"--run-id {text!r}: letters, digits, '_', '.', '-' only")
    return text


def _add_launcher_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dist_ckpt launcher (everything else is torchrun's)")
    group.add_argument("--checkpoint-root", required=True, metavar="ROOT",
                       help=f"local or shared directory: {RUNS_DIR}/<id>/ holds each run's generations")
    group.add_argument("--max-starts", type=_positive, default=None,
                       help="starts before giving up (default 3; torchrun's --max-restarts N "
                            "means N + 1 starts)")
    group.add_argument("--backoff", type=_backoff, default=list(DEFAULT_BACKOFF),
                       metavar="S1,S2,...", help="seconds to wait before the 2nd, 3rd, ... start "
                                                 "(the last value repeats; default 10,20,40)")
    group.add_argument("--stop-file", default=None, metavar="PATH",
                       help="operator stop: when it exists the launcher preempts the job (the "
                            "workers save, then stop) and nothing starts again "
                            f"(default ROOT/{STOP_NAME})")
    group.add_argument("--preempt-signal", type=_signal, default=signal.SIGTERM, metavar="SIG",
                       help="a signal that preempts the job like SIGTERM does, e.g. USR1 for "
                            "SLURM's --signal=B:USR1@120 (default: SIGTERM only)")
    group.add_argument("--grace", type=_seconds("--grace", zero_ok=True), default=DEFAULT_GRACE_S,
                       metavar="SECONDS",
                       help="on a preemption, how long the workers may take to save before they "
                            "are killed (default 60)")
    group.add_argument("--max-no-progress", type=_count, default=DEFAULT_MAX_NO_PROGRESS, metavar="N",
                       help="stop (crash loop) after N consecutive failed starts that committed "
                            "nothing newer than what they resumed from (default 2; 0: never)")
    group.add_argument("--fresh", action="store_true",
                       help="start a new run in a new run directory; earlier runs are kept")
    group.add_argument("--min-free-bytes", type=_bytes, default=None, metavar="BYTES",
                       help="free space a start needs (default: the newest generation's size)")
    group.add_argument("--run-id", type=_run_id, default=None,
                       help="name of the run to start or continue (default: the active run, "
                            "or the next number); give the same one on every node")
    group.add_argument("--mirror", default=None, metavar="URL",
                       help=f"object-store URL; each run replicates to URL/{RUNS_DIR}/<id>; it must answer a "
                            "LIST before each start")
    group.add_argument("--hang-timeout", type=_hang_timeout, default="auto", metavar="SECONDS|auto",
                       help="end a start (outcome hung, restarted) when no rank made progress for "
                            "this long; auto: 10 x the longest interval between two marks of a "
                            "rank seen in this run, at least 60 s (default auto)")
    group.add_argument("--startup-timeout", type=_seconds("--startup-timeout"),
                       default=DEFAULT_STARTUP_TIMEOUT, metavar="SECONDS",
                       help="the hang timeout before a start's first mark: imports, rendezvous "
                            f"and restore (default {DEFAULT_STARTUP_TIMEOUT:g})")
    group.add_argument("--straggler-factor", type=_factor, default=DEFAULT_STRAGGLER_FACTOR,
                       metavar="F", help="name a rank whose own time per update is at least F x "
                                         f"the job's (default {DEFAULT_STRAGGLER_FACTOR:g})")
    group.add_argument("--straggler-window", type=_window, default=DEFAULT_STRAGGLER_WINDOW,
                       metavar="N", help="updates in the sliding window of the straggler medians "
                                         f"(default {DEFAULT_STRAGGLER_WINDOW})")


PROG = "python -m launch"
CONSOLE_SCRIPT = "dist-ckpt-run"
# torchrun's --nproc-per-node words; anything else must be a positive number of workers
NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")


def prog_name(argv0: str) -> str:
    """How the launcher was invoked, for its usage and its messages."""
    return CONSOLE_SCRIPT if os.path.basename(argv0) == CONSOLE_SCRIPT else PROG


def _suggesting(parser: argparse.ArgumentParser) -> None:
    """``parser.error`` adds "did you mean" for an option it does not know."""
    known = sorted({name for action in parser._actions for name in action.option_strings
                    if name.startswith("--")})
    plain = parser.error

    def error(message: str) -> NoReturn:
        for token in re.findall(r"--[\w-]+", message):
            close = difflib.get_close_matches(token, known, n=1) if token not in known else []
            if close:
                message = f"{message} (did you mean {close[0]}?)"
                break
        plain(message)

    parser.error = error  # type: ignore[method-assign]


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = get_args_parser()
    # no prefix matching: "--max-start 2" must be an error, not torchrun's option by another
    # name or a token forwarded raw to torchrun (which rejects it after every start)
    parser.allow_abbrev = False
    parser.prog = prog
    parser.description = ("Run a torchrun job with dist_ckpt checkpoints and a bounded restart "
                          "policy. All torchrun options are accepted and forwarded.")
    _add_launcher_options(parser)
    _suggesting(parser)
    return parser


def _strip_launcher_options(head: list[str]) -> tuple[list[str], int | None]:
    """The torchrun tokens of ``head`` in order, without the launcher's options, and the
    value of ``--max-restarts`` when given (removed: the launcher owns restarts)."""
    ours = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _add_launcher_options(ours)
    ours.add_argument("--max-restarts", "--max_restarts", type=int, default=None)
    for action in ours._actions:
        action.required = False
    known, rest = ours.parse_known_args(head)
    return rest, known.max_restarts


def parse(argv: list[str], prog: str = PROG) -> LaunchOptions:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    nproc = str(args.nproc_per_node)
    if nproc not in NPROC_WORDS and not (nproc.isdigit() and int(nproc) > 0):
        parser.error(f"--nproc-per-node {nproc}: a positive number of workers per node, or one of "
                     f"{', '.join(NPROC_WORDS)}")
    tail = 1 + len(args.training_script_args)
    head, script_part = argv[: len(argv) - tail], argv[len(argv) - tail:]
    if not script_part or script_part[0] != args.training_script:
        parser.error("could not find the training script in the command line")
    torchrun_head, max_restarts = _strip_launcher_options(head)
    notes = []
    max_starts = args.max_starts
    if max_restarts is not None:
        if max_starts is None:
            max_starts = max_restarts + 1
        notes.append(f"torchrun --max-restarts {max_restarts} is run as launcher restarts "
                     f"(--max-starts {max_starts}): each start is a fresh torchrun with a fresh "
                     f"rendezvous")
    root = os.path.abspath(args.checkpoint_root)
    if "://" in args.checkpoint_root:
        parser.error("--checkpoint-root must be a directory; put object storage in --mirror")
    args.max_restarts = 0
    return LaunchOptions(
        checkpoint_root=root, max_starts=max_starts or 3, backoff_s=args.backoff,
        stop_file=os.path.abspath(args.stop_file) if args.stop_file else os.path.join(root, STOP_NAME),
        fresh=args.fresh, min_free_bytes=args.min_free_bytes, run_id=args.run_id,
        mirror=args.mirror.rstrip("/") if args.mirror else None,
        torchrun_argv=["--max-restarts", "0", *torchrun_head, *script_part],
        torchrun=args, notes=notes, hang_timeout=args.hang_timeout,
        startup_timeout=args.startup_timeout, straggler_factor=args.straggler_factor,
        straggler_window=args.straggler_window,
        preempt_signal=args.preempt_signal, grace_s=args.grace,
        max_no_progress=args.max_no_progress)
