"""Run the stand-in in the foreground:

    python -m tests.flame_standin --port 8080 --workdir DIR [--max-executors N] [--gpu-slots 0,1]

Prints ``FLAME_ENDPOINT=http://127.0.0.1:<port>`` and serves until Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from . import StandinCluster


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.flame_standin", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8080, help="Frontend port (0 = ephemeral; default 8080)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--workdir", required=True, help="directory for auto process dirs")
    p.add_argument("--max-executors", type=int, default=8)
    p.add_argument("--gpu-slots", default=None, help="comma-separated slots, e.g. 0,1 (one executor per slot, "
                   "CUDA_VISIBLE_DEVICES=<slot>)")
    p.add_argument("--schedule-interval-ms", type=int, default=100)
    p.add_argument("--bind-retry-limit", type=int, default=5)
    p.add_argument("--socket-timeout-s", type=float, default=120.0)
    p.add_argument("--bind-delay-s", type=float, default=0.0)
    p.add_argument("--time-resolution-ms", type=int, default=1000,
                   help="resolution of task/session times (1000 = sqlite engine, default)")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    slots = [s.strip() for s in a.gpu_slots.split(",") if s.strip()] if a.gpu_slots else None
    cluster = StandinCluster(
        a.workdir,
        max_executors=a.max_executors,
        schedule_interval_ms=a.schedule_interval_ms,
        bind_retry_limit=a.bind_retry_limit,
        gpu_slots=slots,
        socket_timeout_s=a.socket_timeout_s,
        host=a.host,
        port=a.port,
        bind_delay_s=a.bind_delay_s,
        time_resolution_ms=a.time_resolution_ms,
    )
    done = threading.Event()
    # Explicit handlers: a shell starts background jobs with SIGINT ignored, and Ctrl-C must still work.
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    cluster.start()
    print(f"FLAME_ENDPOINT={cluster.endpoint}", flush=True)
    try:
        while not done.wait(0.5):
            pass
    finally:
        print("stopping flame stand-in ...", file=sys.stderr, flush=True)
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
