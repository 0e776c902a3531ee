"""The flame.v1.Frontend gRPC service of the stand-in, on top of flamepy's own generated stubs."""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING

import grpc
from flamepy.proto import frontend_pb2, frontend_pb2_grpc, types_pb2

from ._store import (
    FALLBACK_RESREQ,
    TERMINAL,
    StoreError,
)

if TYPE_CHECKING:  # pragma: no cover
    from ._cluster import StandinCluster

log = logging.getLogger("flame_standin.frontend")

_STATUS = {
    # Rust FlameError -> tonic Status mapping of v0.6.0 (common/src/lib.rs).
    "not_found": grpc.StatusCode.NOT_FOUND,
    "invalid_config": grpc.StatusCode.INVALID_ARGUMENT,
    "invalid_state": grpc.StatusCode.INVALID_ARGUMENT,
    "storage": grpc.StatusCode.INTERNAL,
    "internal": grpc.StatusCode.INTERNAL,
}

_APP_NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")


def _abort(context: grpc.ServicerContext, err: StoreError):
    context.abort(_STATUS.get(err.kind, grpc.StatusCode.INTERNAL), err.message)


def _validate_app_name(name: str) -> None:
    if not name:
        raise StoreError("invalid_config", "application name cannot be empty")
    if len(name) > 253:
        raise StoreError("invalid_config", "application name exceeds maximum length of 253 characters")
    if ".." in name or "/" in name or "\\" in name:
        raise StoreError("invalid_config", f"application name contains invalid characters (path traversal): {name}")
    if name.startswith(".") or name.startswith("-"):
        raise StoreError("invalid_config", f"application name cannot start with '.' or '-': {name}")
    if not _APP_NAME_RE.match(name):
        raise StoreError("invalid_config", f"application name contains invalid characters: {name}")


def _validate_spec_fields(spec: types_pb2.ApplicationSpec) -> None:
    """Checks done before the controller is called; failures are gRPC errors, not Result codes."""
    if spec.HasField("schema"):
        for fld, label in (("input", "input"), ("output", "output"), ("common_data", "common data")):
            if spec.schema.HasField(fld):
                try:
                    json.loads(getattr(spec.schema, fld))
                except ValueError as e:
                    raise StoreError("invalid_config", f"invalid {label} schema: {e}")
    if spec.HasField("working_directory") and spec.working_directory and not spec.working_directory.startswith("/"):
        raise StoreError(
            "invalid_config", f"working_directory must be an absolute path, got: {spec.working_directory}"
        )


def _validate_batch_alignment(spec: types_pb2.SessionSpec) -> None:
    b = max(1, spec.batch_size)
    if b == 1:
        return
    if spec.min_instances != 0 and spec.min_instances % b:
        raise StoreError("invalid_config", f"min_instances ({spec.min_instances}) must be 0 or a multiple of batch_size ({b})")
    if spec.HasField("max_instances") and spec.max_instances % b:
        raise StoreError("invalid_config", f"max_instances ({spec.max_instances}) must be a multiple of batch_size ({b})")


def _resolve_resreq(spec: types_pb2.SessionSpec) -> tuple:
    if spec.HasField("resreq"):
        return (spec.resreq.cpu, spec.resreq.memory, spec.resreq.gpu)
    return FALLBACK_RESREQ


class FrontendServicer(frontend_pb2_grpc.FrontendServicer):
    def __init__(self, cluster: "StandinCluster"):
        self.cluster = cluster
        self.store = cluster._store

    # -------------------------------------------------------------- applications
    def RegisterApplication(self, request, context):  # noqa: N802
        if not request.HasField("application"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "applilcation spec is missed")
        try:
            _validate_spec_fields(request.application)
        except StoreError as e:
            _abort(context, e)
        try:
            _validate_app_name(request.name)
            self.store.register_application(request.name, request.application)
        except StoreError as e:
            return types_pb2.Result(return_code=-1, message=e.message)
        return types_pb2.Result(return_code=0)

    def UpdateApplication(self, request, context):  # noqa: N802
        if not request.HasField("application"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "applilcation spec is missed")
        try:
            _validate_spec_fields(request.application)
        except StoreError as e:
            _abort(context, e)
        try:
            _validate_app_name(request.name)
            self.store.update_application(request.name, request.application)
        except StoreError as e:
            return types_pb2.Result(return_code=-1, message=e.message)
        return types_pb2.Result(return_code=0)

    def UnregisterApplication(self, request, context):  # noqa: N802
        try:
            self.store.unregister_application(request.name)
        except StoreError as e:
            return types_pb2.Result(return_code=-1, message=e.message)
        return types_pb2.Result(return_code=0)

    def GetApplication(self, request, context):  # noqa: N802
        try:
            return self.store.get_application(request.name).to_proto()
        except StoreError as e:
            _abort(context, e)

    def ListApplication(self, request, context):  # noqa: N802
        with self.store.lock:
            apps = [a.to_proto() for a in self.store.apps.values()]
        return types_pb2.ApplicationList(applications=apps)

    # ------------------------------------------------------------ nodes/executors
    def ListExecutor(self, request, context):  # noqa: N802
        return types_pb2.ExecutorList(executors=self.cluster._executor_protos())

    def ListNodes(self, request, context):  # noqa: N802
        return types_pb2.NodeList(nodes=self.cluster._node_protos())

    def GetNode(self, request, context):  # noqa: N802
        for n in self.cluster._node_protos():
            if n.metadata.name == request.name:
                return frontend_pb2.GetNodeResponse(node=n)
        context.abort(grpc.StatusCode.NOT_FOUND, f"node <{request.name}> not found")

    # ------------------------------------------------------------------ sessions
    def CreateSession(self, request, context):  # noqa: N802
        if not request.HasField("session"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session spec")
        try:
            _validate_batch_alignment(request.session)
            ssn = self.store.create_session(request.session_id, request.session, _resolve_resreq(request.session))
            with self.store.lock:
                return ssn.to_proto(with_events=False)
        except StoreError as e:
            _abort(context, e)

    def OpenSession(self, request, context):  # noqa: N802
        spec = request.session if request.HasField("session") else None
        try:
            if spec is not None:
                _validate_batch_alignment(spec)
            with self.store.cond:
                ssn = self.store.sessions.get(request.session_id)
                if ssn is not None:
                    if ssn.state != 0:
                        raise StoreError("invalid_state", f"session <{request.session_id}> is not open")
                    if spec is not None:
                        self._validate_open_spec(ssn, spec)
                    return ssn.to_proto(with_events=False)
                if spec is None:
                    raise StoreError("not_found", f"session <{request.session_id}> not found")
                ssn = self.store.create_session(request.session_id, spec, _resolve_resreq(spec))
                return ssn.to_proto(with_events=False)
        except StoreError as e:
            _abort(context, e)

    @staticmethod
    def _validate_open_spec(ssn, spec: types_pb2.SessionSpec) -> None:
        sid = ssn.id
        max_i = spec.max_instances if spec.HasField("max_instances") else None
        checks = [
            ("application", ssn.application, spec.application),
            ("resreq", ssn.resreq, _resolve_resreq(spec)),
            ("min_instances", ssn.min_instances, spec.min_instances),
            ("max_instances", ssn.max_instances, max_i),
            ("batch_size", ssn.batch_size, max(1, spec.batch_size)),
            ("priority", ssn.priority, spec.priority),
        ]
        for name, have, got in checks:
            if have != got:
                raise StoreError(
                    "invalid_config", f"session <{sid}> spec mismatch: {name} differs (expected {have!r}, got {got!r})"
                )

    def CloseSession(self, request, context):  # noqa: N802
        try:
            ssn = self.store.close_session(request.session_id)
            with self.store.lock:
                return ssn.to_proto(with_events=False)
        except StoreError as e:
            _abort(context, e)

    def DeleteSession(self, request, context):  # noqa: N802
        try:
            ssn = self.store.delete_session(request.session_id)
            with self.store.lock:
                return ssn.to_proto(with_events=False)
        except StoreError as e:
            _abort(context, e)

    def GetSession(self, request, context):  # noqa: N802
        try:
            with self.store.lock:
                return self.store.get_session(request.session_id).to_proto(with_events=True)
        except StoreError as e:
            _abort(context, e)

    def ListSession(self, request, context):  # noqa: N802
        with self.store.lock:
            sessions = sorted(self.store.sessions.values(), key=lambda s: s.seq)
            return types_pb2.SessionList(sessions=[s.to_proto(with_events=True) for s in sessions])

    # --------------------------------------------------------------------- tasks
    def CreateTask(self, request, context):  # noqa: N802
        if not request.HasField("task"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session spec")
        spec = request.task
        try:
            t = self.store.create_task(spec.session_id, spec.input if spec.HasField("input") else None)
            with self.store.lock:
                # The response echoes the whole input (events are not included).
                return t.to_proto(with_events=False)
        except StoreError as e:
            _abort(context, e)

    @staticmethod
    def _task_id(context, raw: str) -> int:
        try:
            tid = int(raw)
            if tid < 0:
                raise ValueError
            return tid
        except ValueError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "invalid task id")

    def GetTask(self, request, context):  # noqa: N802
        tid = self._task_id(context, request.task_id)
        try:
            with self.store.lock:
                return self.store.get_task(request.session_id, tid).to_proto(with_events=True)
        except StoreError as e:
            _abort(context, e)

    def ListTask(self, request, context):  # noqa: N802
        try:
            with self.store.lock:
                ssn = self.store.get_session(request.session_id)
                snapshot = [t.to_proto(with_events=False) for _, t in sorted(ssn.tasks.items())]
        except StoreError as e:
            _abort(context, e)
        for msg in snapshot:
            if not context.is_active():
                return
            yield msg

    def WatchTask(self, request, context):  # noqa: N802
        """Faithful to v0.6.0: each round remembers the state at its start and waits until the state differs
        or the task is terminal; no initial snapshot for a non-terminal task; ends after a terminal message;
        ends silently (no error, no message) when the task or session disappears; no events in messages."""
        sid = request.session_id
        tid = self._task_id(context, request.task_id)
        store = self.store
        while True:
            with store.cond:
                t = store.find_task(sid, tid)
                if t is None:
                    return
                msg = self._watch_round(store, sid, tid, t.state, context)
                if msg is None:
                    return
            yield msg
            if msg.status.state in TERMINAL:
                return

    @staticmethod
    def _watch_round(store, sid: str, tid: int, initial: int, context):
        """One WatchTask round (``store.cond`` held): the task's next message, or None when the stream ends
        silently (task or session gone, server stopping, client gone). Counted in ``store.watching`` while
        it waits (``StandinCluster.watchers``)."""
        key = (sid, tid)
        store.watching[key] = store.watching.get(key, 0) + 1
        try:
            while True:
                t = store.find_task(sid, tid)
                if t is None or store.stopping:
                    return None
                if t.state != initial or t.state in TERMINAL:
                    return t.to_proto(with_events=False)
                store.cond.wait(timeout=0.5)
                if not context.is_active():
                    return None
        finally:
            store.watching[key] -= 1
            if not store.watching[key]:
                del store.watching[key]
