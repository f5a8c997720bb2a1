"""``python -m pagedkv.worker --connect ADDR``: start one worker process (how the control plane spawns them).

The worker-channel secret comes from ``--secret-file`` or ``$PAGEDKV_WORKER_SECRET`` (a spawned
worker gets its parent's per-start secret in that variable). A spawned worker (``$PAGEDKV_PARENT_PID``
set) ignores SIGINT: its control plane stops it. A worker started on its own stops on Ctrl-C.
torch is imported only after `host_memory.use_huge_pages_for_tensors`, which must come first.
"""

from __future__ import annotations

import argparse
import os
import signal

from pagedkv.common.config import add_rank_arguments, check_rank_arguments
from pagedkv.common.log import configure_logging
from pagedkv.common.protocol import SECRET_ENV, load_secret
from pagedkv.worker.host_memory import use_huge_pages_for_tensors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.worker", description="pagedkv worker process")
    parser.add_argument("--connect", required=True, metavar="ADDR",
                        help="the control plane's ZeroMQ address, e.g. ipc:///tmp/pagedkv.sock or tcp://host:5555")
    parser.add_argument("--secret-file", metavar="PATH", help=f"the worker-channel secret (default: ${SECRET_ENV})")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    parser.add_argument("--log-format", choices=["console", "json"], default="console")
    add_rank_arguments(parser)
    args = parser.parse_args(argv)
    check_rank_arguments(args, parser)
    try:
        secret = load_secret(args.secret_file)
    except (OSError, ValueError) as e:
        parser.error(f"--secret-file: {e}")
    if secret is None:
        parser.error(f"no worker-channel secret: give --secret-file or set {SECRET_ENV}")
    configure_logging(args.log_format, args.log_level)
    if os.environ.get("PAGEDKV_PARENT_PID"):
        # spawned by a control plane, which stops it (Shutdown, its socket, its exit): a terminal's
        # Ctrl-C reaches the whole process group and interrupted the drain with a traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    use_huge_pages_for_tensors()
    from pagedkv.worker.worker import exit_now, run  # imports torch

    run(args.connect, secret, args.rank, args.world_size, args.dist_init_method)
    exit_now(0)


if __name__ == "__main__":
    main()
