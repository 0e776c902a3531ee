"""``python -m sut.flame {render-app,register,close,cluster}``: the Flame application of the Flame-batched SUT,
closing sessions left open (``close``), and a one-host real Flame v0.6.0 cluster for tests and benchmarks
(``cluster``, see ``sut.flame.cluster``).

Exit codes (``sut.exits``): 0 done, 1 failed (e.g. Flame cannot be reached), 2 bad input, 130 stopped."""

from __future__ import annotations

if __name__ == "__main__":  # outside the project's environment: say how to enter it before the imports below fail
    from sut.exits import require_environment

    require_environment()

import logging
import sys

from sut.errors import BadInput
from sut.exits import ShortUsageParser, run_main
from sut.flame import app


def main(argv=None) -> int:
    """``python -m sut.flame``; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["cluster"]:
        from sut.flame import cluster

        return run_main(cluster.main, argv[1:])
    return run_main(_main, argv)


def _main(argv: list[str]) -> int:
    p = ShortUsageParser(prog="python -m sut.flame", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("render-app", "print app.yaml with this machine's paths (for flmctl register -f)"),
                        ("register", "register the application through flamepy (FLAME_ENDPOINT or --endpoint)")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--name", default=app.DEFAULT_APP_NAME)
        s.add_argument("--python", help="absolute path of the service's python (default: this one)")
        s.add_argument("--repo", help="absolute path of this repository on the executor hosts")
        s.add_argument("--workdir", help="absolute working directory of the service (its logs go there)")
        s.add_argument("--env", action="append", default=[], metavar="K=V", help="extra service environment")
        if name == "register":
            s.add_argument("--endpoint", help="Flame endpoint (default: FLAME_ENDPOINT or ~/.flame/flame.yaml)")
            s.add_argument("--replace", action="store_true", help="unregister an application of that name first "
                           "(a Flame with sqlite storage refuses a second registration); refused while sessions of "
                           "it are open")
    c = sub.add_parser("close", help="close Flame sessions left open (e.g. by a run killed with SIGKILL), waiting "
                                     "while their running tasks finish")
    c.add_argument("session_ids", nargs="+", metavar="SESSION_ID")
    c.add_argument("--endpoint", help="Flame endpoint (default: FLAME_ENDPOINT or ~/.flame/flame.yaml)")
    c.add_argument("--wait-s", type=float, default=300.0, help="how long to retry while Flame refuses because tasks "
                                                               "still run (default 300)")
    sub.add_parser("cluster", add_help=False, help="run a one-host real Flame v0.6.0 cluster (one node, or --nodes N "
                   "emulated nodes) until Ctrl-C (python -m sut.flame cluster --help)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if a.cmd == "close":
        if not 0 <= a.wait_s <= 86400:  # also NaN
            raise BadInput(f"error: --wait-s {a.wait_s}: expected seconds in 0..86400")
        return _close(a.endpoint, a.session_ids, a.wait_s)
    bad = [e for e in a.env if "=" not in e]
    if bad:
        raise BadInput(f"error: --env {bad[0]!r}: expected K=V")
    envs = dict(e.split("=", 1) for e in a.env)
    try:
        doc = app.render(a.python, a.repo, a.workdir, app.check_app_name(a.name), envs)
    except ValueError as e:  # a --name Flame refuses; a relative --python, --repo or --workdir
        raise BadInput(f"error: {e}") from None
    if a.cmd == "render-app":
        sys.stdout.write(app.to_yaml(doc))
        return 0
    return _register(a.endpoint, doc, a.replace)


def _connect_checked(endpoint_arg):
    """``(connection, endpoint)``; ``BadInput`` for a malformed endpoint or one where nothing answers."""
    from sut.errors import RunFailed
    from sut.flame.endpoint import check_control_plane, connect

    try:
        check_control_plane(endpoint_arg)
    except RunFailed as e:
        raise BadInput(f"error: {e}") from None
    return connect(endpoint_arg)


def _closed_already(conn, endpoint: str, session_ids: list[str]) -> set[str]:
    """The ids of ``session_ids`` whose session Flame lists as closed (closing one again changes nothing).

    Raises:
        BadInput: an id Flame does not know at ``endpoint`` (a typo, another cluster's session): naming each such id
            and the sessions open there; checked for every id before any is closed.
        RunFailed: Flame cannot list its sessions (its words).
    """
    import flamepy

    from sut.errors import RunFailed

    try:
        known = {x.id: x.state for x in conn.list_sessions()}
    except flamepy.FlameError as e:
        raise RunFailed(f"cannot list the sessions at {endpoint}: {e.message}") from None
    unknown = [sid for sid in session_ids if sid not in known]
    if unknown:
        open_ = sorted(sid for sid, state in known.items() if state == flamepy.SessionState.OPEN)
        listed = (f"open there: {', '.join(open_[:10])}{' ...' if len(open_) > 10 else ''}" if open_
                  else "none is open there")
        raise BadInput(f"error: Flame at {endpoint} has no session {', '.join(unknown)} ({listed}); nothing was "
                       "closed")
    return {sid for sid in session_ids if known[sid] == flamepy.SessionState.CLOSED}


def _close(endpoint_arg, session_ids: list[str], wait_s: float) -> int:
    """Close each session, retrying every second for ``wait_s`` while Flame refuses because tasks still run;
    0 when all closed (one closed already included), else 1 (each failure logged with Flame's words).

    Raises:
        BadInput: a malformed endpoint, none answering there, or a session id Flame does not know there
            (``_closed_already``: exit 2 before any session is closed).
    """
    import time

    import flamepy

    log = logging.getLogger("sut.flame")
    conn, endpoint = _connect_checked(endpoint_arg)
    closed = _closed_already(conn, endpoint, session_ids)
    failed = 0
    for sid in session_ids:
        if sid in closed:
            print(f"session {sid} at {endpoint} was closed already")
            continue
        t0, said = time.monotonic(), 0.0
        while True:
            try:
                conn.close_session(sid)
                print(f"closed session {sid} at {endpoint}")
                break
            except flamepy.FlameError as e:
                waited = time.monotonic() - t0
                if "running tasks" in (e.message or "") and waited < wait_s:
                    if waited - said >= 10.0 or not said:
                        said = waited or 1e-9
                        log.info("session %s still has running tasks; waiting for them to finish (%.0f of %.0f s)",
                                 sid, waited, wait_s)
                    time.sleep(1.0)
                    continue
                why = e.message
                if "running tasks" in (e.message or ""):
                    why += (f" (for {wait_s:.0f} s): if the executor manager that ran them died, Flame v0.6.0 keeps "
                            "them Running for good and the session cannot be closed; restart the session manager "
                            "(the cluster)")
                log.error("session %s not closed: %s", sid, why)
                failed += 1
                break
    return 1 if failed else 0


def _check_local_paths(doc: dict, endpoint: str) -> None:
    """The service's command and working directory, as far as this host can tell: the working directory must be
    creatable here (``app.register`` makes it); a command that is not an executable file here is bad input when the
    session manager is on this host (a one-host cluster: its executors run here), else a warning (the executor
    hosts may have it)."""
    import os
    from pathlib import Path
    from urllib.parse import urlparse

    spec = doc["spec"]
    if spec.get("working_directory"):
        try:
            Path(spec["working_directory"]).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BadInput(f"error: --workdir {spec['working_directory']}: cannot create it ({e.strerror or e})") from None
    command = spec.get("command") or ""
    if not (os.path.isfile(command) and os.access(command, os.X_OK)):
        what = f"--python {command}: not an executable file on this host"
        if urlparse(endpoint).hostname in ("127.0.0.1", "localhost", "::1"):
            raise BadInput(f"error: {what} (a one-host cluster runs its services here)")
        logging.getLogger("sut.flame").warning("%s: the executor hosts must have it", what)


def _register(endpoint_arg, doc: dict, replace: bool = False) -> int:
    """Register ``doc`` at the Flame endpoint (with ``replace``, unregister an application of its name first):
    ``BadInput`` (exit 2) for a malformed endpoint or one where nothing answers (the checks of ``python -m sut run
    --sut flame``); ``RunFailed`` (exit 1) when Flame refuses."""
    import flamepy

    from sut.errors import RunFailed
    from sut.flame.session import backend_port_hint

    conn, endpoint = _connect_checked(endpoint_arg)
    _check_local_paths(doc, endpoint)
    name = doc["metadata"]["name"]
    try:
        if replace and conn.get_application(name) is not None:
            # Flame v0.6.0 (storage none) unregisters under open sessions and drops them: a run would lose its own
            open_ = [x.id for x in conn.list_sessions()
                     if x.application == name and x.state == flamepy.SessionState.OPEN]
            if open_:
                raise RunFailed(f"cannot replace application {name} at {endpoint}: sessions of it are open "
                                f"({', '.join(open_)}): a run uses them; when none does, python -m sut.flame close "
                                f"{' '.join(open_)}")
            conn.unregister_application(name)
            print(f"unregistered application {name} at {endpoint}")
    except flamepy.FlameError as e:
        raise RunFailed(f"cannot unregister application {name} at {endpoint}: {e.message} (Flame refuses while "
                        "sessions of it are open: python -m sut.flame close SESSION_ID)") from None
    try:
        app.register(conn, doc)
    except flamepy.FlameError as e:
        raise RunFailed(f"cannot register application {name} at {endpoint}: {e.message}"
                        f"{backend_port_hint(e.message, 'failed to register application')}") from None
    print(f"registered application {name} at {endpoint}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
