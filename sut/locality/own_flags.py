"""``python -m sut.locality``'s wording of messages that come from code it shares with ``python -m sut run``: those
name ``sut run``'s flags (``--flame-endpoint``, ``--sut vllm-http``), which ``sut.locality run`` does not have."""

from __future__ import annotations

from sut.errors import BadInput

#: How the shared code's messages name a setting with `python -m sut run`'s flags -> this command's way to give it.
OWN_FLAGS = (("--flame-endpoint / --option endpoint=", "--system-option flame.endpoint="),
             ("another --flame-endpoint / FLAME_ENDPOINT", "another --system-option flame.endpoint=URL / FLAME_ENDPOINT"),
             ("--sut vllm-http: ", ""))


def in_own_flags(e: Exception) -> None:
    """Rewrite ``e``'s message in place to name this command's flags instead of `python -m sut run`'s (a
    find: "pass --flame-endpoint", a flag `sut.locality run` does not have)."""

    def mend(text: str) -> str:
        for theirs, ours in OWN_FLAGS:
            text = text.replace(theirs, ours)
        return text

    if isinstance(e, BadInput):  # a SystemExit: its text is .message, its args the exit code
        e.message = mend(e.message)
    elif e.args and isinstance(e.args[0], str):
        e.args = (mend(e.args[0]), *e.args[1:])
