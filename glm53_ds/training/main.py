"""`main`: `deepspeed launch/train.py`'s entry point. The arguments (with a `--config` file's in front of them)
become the run's `TrainConfig` (training/option_checks.py's `resolve_config`), which a `Trainer` runs; every failure
becomes one `error:` line and an exit code (2: set-up, 3: training stopped, 4: a collective lost its peers; a stop signal's own code), and a stop
signal says where the run stopped and what survived."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from ..engine import close_distributed
from .args import build_parser
from .config import SetupError
from .option_checks import resolve_config
from .peers import lost_peers_line
from .run_file import parse_with_config
from .run_plan import report_error
from .step import TrainingStopped
from .stop_signals import Interrupted, StopSignals, signal_name
from .trainer import Trainer

LOST_PEERS_EXIT = 4  # a collective lost its peers (a node died or froze)

__all__ = ["main"]


def _report_stop(signum: int, trainer: Trainer | None) -> None:
    """A stop signal's one line (rank 0): where the run stopped and what survived; then the --save lock goes."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("LOCAL_RANK", "0"))
    if rank == 0:
        at = (
            f" at step {trainer.running_step + 1}"
            if trainer is not None and trainer.running_step is not None
            else ""
        )
        survived = trainer.last_good() if trainer is not None else "Nothing was written yet"
        released = (
            "; the --save lock is released"
            if trainer is not None and any(lock.option == "--save" for lock in trainer.locks)
            else ""
        )
        print(
            f"\nerror: stopped by {signal_name(signum)}{at}{released}. {survived}",
            file=sys.stderr,
            flush=True,
        )
    if trainer is not None:
        trainer.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    trainer: Trainer | None = None
    stop = StopSignals(lambda signum: _report_stop(signum, trainer)).install()
    try:
        args, overrides = parse_with_config(parser, sys.argv[1:] if argv is None else list(argv))
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            for line in overrides:
                print(line, file=sys.stderr)
        trainer = Trainer(resolve_config(args))
        last = trainer.run()
        final = trainer.report.final_line()
        if dist.is_initialized() and dist.get_rank() == 0 and last and final:
            print(final)
        return 0
    except SetupError as e:
        stop.quiet()
        report_error(e)
        return 2
    except TrainingStopped as e:
        stop.quiet()
        report_error(e, lead="\n")  # after the progress bar's line
        return 3
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (`Interrupted`)
        return stop.code_of(e)
    except Exception as e:  # a collective broken by a peer that stopped first: still the signal's stop
        if stop.received is None:
            lost = None if trainer is None else lost_peers_line(trainer.heartbeat, e, trainer.running_step,
                                                                trainer.config.save)  # fmt: skip
            if lost is None:
                raise
            stop.quiet()
            print(f"\nerror: {lost}", file=sys.stderr, flush=True)
            os._exit(LOST_PEERS_EXIT)  # no teardown: its collectives would wait on the peers that are gone
        return stop.code_of(Interrupted())
    finally:  # every rank reaches here together: refusals and stops are decided on all ranks alike
        stop.uninstall()
        if trainer is not None:
            trainer.close()
        close_distributed()
