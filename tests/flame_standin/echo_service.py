"""A tiny Flame service for the stand-in tests, run as ``python echo_service.py`` via ``flamepy.run``.

Task input (bytes) selects the behaviour:
    b"sleep:S"   sleep S seconds, return a JSON info record (see b"info")
    b"fail:MSG"  raise RuntimeError(MSG)               -> task Failed, event message MSG
    b"crash"     os._exit(3) in the middle of the task -> the FEM sees a broken connection
    b"big:N"     return N bytes of b"x" (b"big:N:<padding>" too, to make the input big as well)
    b"none"      return None (task output unset)
    b"info"      return JSON {pid, pgid, task_id, session_id, cwd, slot, cuda, max_concurrency, invocations,
                 enter_count, common_data, tmpdir, endpoint}
    b"env:NAME"  return os.environ[NAME] (empty if unset)
    b"child"     start `sleep 600` (same process group) and return its pid
    anything else: echoed back unchanged

Session enter/leave behaviour, from the session's common_data (JSON object) or the environment:
    fail_enter / ECHO_FAIL_ENTER=msg      raise in on_session_enter (= bind failure)
    crash_enter / ECHO_CRASH_ENTER=1      os._exit(4) in on_session_enter
    enter_sleep / ECHO_ENTER_SLEEP=S      sleep S seconds in on_session_enter
    fail_leave / ECHO_FAIL_LEAVE=msg      raise in on_session_leave
    ECHO_IGNORE_SIGTERM=1                 ignore SIGTERM (to see the stand-in's SIGKILL escalation)
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import flamepy
from flamepy import FlameService


def _log(*args):
    print(time.strftime("%H:%M:%S"), *args, flush=True)


class EchoService(FlameService):
    def __init__(self):
        self._lock = threading.Lock()
        self._active = 0
        self.max_concurrency = 0
        self.invocations = 0
        self.enter_count = 0
        self.session_id = None
        self.common = {}
        self.common_raw = None

    def _opt(self, key, env):
        if key in self.common:
            return self.common[key]
        return os.environ.get(env)

    def on_session_enter(self, context):
        self.enter_count += 1
        self.session_id = context.session_id
        raw = context.common_data()
        self.common_raw = raw
        self.common = {}
        if raw and raw[:1] == b"{":
            try:
                self.common = json.loads(raw)
            except ValueError:
                self.common = {}
        _log("on_session_enter", context.session_id, context.application.name, raw[:64] if raw else raw)
        delay = self._opt("enter_sleep", "ECHO_ENTER_SLEEP")
        if delay:
            time.sleep(float(delay))
        if self._opt("crash_enter", "ECHO_CRASH_ENTER"):
            os._exit(4)
        msg = self._opt("fail_enter", "ECHO_FAIL_ENTER")
        if msg:
            raise RuntimeError(str(msg))

    def _info(self, context):
        return json.dumps(
            {
                "pid": os.getpid(),
                "pgid": os.getpgid(0),
                "task_id": context.task_id,
                "session_id": context.session_id,
                "cwd": os.getcwd(),
                "slot": os.environ.get("FLAME_STANDIN_SLOT"),
                "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "max_concurrency": self.max_concurrency,
                "invocations": self.invocations,
                "enter_count": self.enter_count,
                "common_data": self.common_raw.decode("utf-8", "replace") if self.common_raw else None,
                "tmpdir": os.environ.get("TMPDIR"),
                "endpoint": os.environ.get("FLAME_ENDPOINT"),
                "time": time.time(),
            }
        ).encode()

    def on_task_invoke(self, context):
        with self._lock:
            self._active += 1
            self.invocations += 1
            self.max_concurrency = max(self.max_concurrency, self._active)
        try:
            data = context.input or b""
            _log("on_task_invoke", context.task_id, data[:32])
            if data.startswith(b"sleep:"):
                time.sleep(float(data[6:]))
                return self._info(context)
            if data.startswith(b"fail:"):
                raise RuntimeError(data[5:].decode())
            if data == b"crash":
                os._exit(3)
            if data.startswith(b"big:"):
                # b"big:N" or b"big:N:<padding>" (padding makes the input big too)
                return b"x" * int(data[4:].split(b":", 1)[0])
            if data == b"none":
                return None
            if data == b"info":
                return self._info(context)
            if data.startswith(b"env:"):
                return os.environ.get(data[4:].decode(), "").encode()
            if data == b"child":
                child = subprocess.Popen(["sleep", "600"])
                return str(child.pid).encode()
            return data
        finally:
            with self._lock:
                self._active -= 1

    def on_session_leave(self):
        _log("on_session_leave", self.session_id)
        msg = self._opt("fail_leave", "ECHO_FAIL_LEAVE")
        if msg:
            raise RuntimeError(str(msg))


def main():
    if os.environ.get("ECHO_IGNORE_SIGTERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _log("echo service starting, pid", os.getpid(), "socket", os.environ.get("FLAME_INSTANCE_ENDPOINT"))
    flamepy.run(EchoService())


if __name__ == "__main__":
    sys.exit(main())
