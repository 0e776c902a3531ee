"""The Flame application of the Flame-batched SUT: one description (``app.yaml``), two ways to register.

``render`` fills the machine-specific values (python, repository, working directory) into the
YAML document that ``flmctl register -f`` takes; ``attributes`` turns the same document into
flamepy's ``ApplicationAttributes`` for ``register_application``.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Optional

import yaml

from sut.constants import REPO

APP_YAML = Path(__file__).resolve().with_name("app.yaml")
DEFAULT_APP_NAME = "sut-vllm"


#: An application name Flame v0.6.0 registers: ASCII letters, digits, '_', '.', '-', not starting with '.' or '-',
#: no '..', at most 253 characters (its session manager refuses anything else).
APP_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,252}")


def check_app_name(name: str) -> str:
    """``name`` when Flame would register it; ``ValueError`` naming the rule otherwise (found before any connection)."""
    if not APP_NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"--name {name[:80]!r}{'...' if len(name) > 80 else ''}: Flame takes 1-253 characters of "
                         "ASCII letters, digits, '_', '.' and '-', not starting with '.' or '-', without '..'")
    return name


def render(python: Optional[str] = None, repo: Optional[str] = None, workdir: Optional[str] = None,
           name: Optional[str] = None, environments: Optional[dict] = None) -> dict:
    """The app document with ``${SUT_PYTHON}``, ``${SUT_REPO}``, ``${SUT_WORKDIR}`` filled in.

    When ``python`` is not given (the service runs this machine's interpreter), the service's
    ``PYTHONPATH`` is the repository followed by this process's ``PYTHONPATH`` entries, so the service
    imports the same packages as the client. Raises ``ValueError`` for a relative path.
    """
    values = {"SUT_PYTHON": python or sys.executable, "SUT_REPO": str(repo or REPO),
              "SUT_WORKDIR": str(workdir or (Path(repo or REPO) / "results" / "flame-service"))}
    flags = {"SUT_PYTHON": "--python", "SUT_REPO": "--repo", "SUT_WORKDIR": "--workdir"}
    for k, v in values.items():
        if not os.path.isabs(v):
            raise ValueError(f"{flags[k]} ({k}) must be an absolute path, got {v!r} (Flame runs the command without "
                             "a shell)")
    text = APP_YAML.read_text()
    for k, v in values.items():
        text = text.replace("${" + k + "}", v)
    doc = yaml.safe_load(text)
    if name:
        doc["metadata"]["name"] = name
    if python is None and os.environ.get("PYTHONPATH"):
        # This machine's interpreter: give the service the client's import path too (e.g. packages
        # installed with pip --target), after the repository.
        envs = doc["spec"].setdefault("environments", {})
        parts = [str(envs.get("PYTHONPATH") or values["SUT_REPO"])]
        parts += [x for x in os.environ["PYTHONPATH"].split(os.pathsep) if x and x not in parts]
        envs["PYTHONPATH"] = os.pathsep.join(parts)
    if environments:
        doc["spec"].setdefault("environments", {}).update({k: str(v) for k, v in environments.items()})
    return doc


def to_yaml(doc: dict) -> str:
    return yaml.safe_dump(doc, sort_keys=False)


def attributes(doc: dict):
    """flamepy ``ApplicationAttributes`` of a rendered document."""
    import flamepy

    spec = dict(doc["spec"])
    shim = spec.pop("shim", "host")
    envs = {k: str(v) for k, v in (spec.pop("environments", None) or {}).items()}
    return flamepy.ApplicationAttributes(
        shim=flamepy.Shim.HOST if str(shim).lower() == "host" else flamepy.Shim.WASM,
        description=spec.get("description"), labels=list(spec.get("labels") or []), command=spec["command"],
        arguments=[str(a) for a in spec.get("arguments") or []], environments=envs,
        working_directory=spec.get("working_directory"), max_instances=spec.get("max_instances"),
        delay_release=spec.get("delay_release"))


def register(conn, doc: dict) -> None:
    """Register the rendered application through a flamepy ``Connection``."""
    if doc["spec"].get("working_directory"):
        Path(doc["spec"]["working_directory"]).mkdir(parents=True, exist_ok=True)
    conn.register_application(doc["metadata"]["name"], attributes(doc))
