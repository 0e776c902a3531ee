"""The wire format of vLLM's OpenAI-compatible server as the ``http`` transport uses it (vLLM 0.32).

Requests (``POST /v1/completions``): the prompt as token ids, sampling equal to ``GenerationSettings``
and to the ``local`` transport's ``SamplingParams`` (greedy: temperature 0, top_p 1, top_k 0, min_p 0,
no penalties; ``max_tokens``, ``min_tokens`` (= ``max_tokens`` with ``ignore_eos``), ``ignore_eos``,
``stop_token_ids`` = the model's EOS ids), each set explicitly so that a server's own defaults (its
``--generation-config``) cannot change them, and ``return_token_ids: true``: without it a server
started with ``--skip-tokenizer-init`` answers ``text: ""`` and ``token_ids: null``
(``../shared/research/env_cpu.md`` §3). Streamed requests add ``stream_options.include_usage`` (the
final chunk carries ``usage``) and ``stream_interval`` (tokens per chunk after the first, which vLLM
always sends at once).

Responses: ``choices[0].token_ids`` (the generated ids; streamed: each chunk's new ids),
``choices[0].finish_reason`` (streamed: on the last chunk with ids) and
``usage.prompt_tokens_details.cached_tokens`` where the server reports it (``--enable-prompt-tokens-
details``). A finished answer ends with ``finish_reason`` ``stop`` (an EOS / stop id) or ``length``
(``max_tokens``, so exactly that many ids); anything else (``abort``, none at all before ``[DONE]``,
``length`` early) is an answer the server cut short (``check_finished``). ``ReplyError`` names what is wrong with a reply; ``NoTokenIds`` is the
server that returns text instead of ids.

What a server reports about itself: ``sut.core.transports.http_readback``.
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

from sut.engine import GenerationSettings

#: Generated ids per streamed chunk after the first (the first chunk is always sent at once).
STREAM_INTERVAL = 16


class ReplyError(Exception):
    """A server reply the transport cannot use (the message says why)."""


class NoTokenIds(ReplyError):
    """The server returns text instead of generated token ids."""


def sampling_body(gen: GenerationSettings) -> dict:
    """The request fields every completion request carries (module docstring)."""
    return {
        "max_tokens": gen.max_tokens,
        "min_tokens": gen.effective_min_tokens,
        "ignore_eos": gen.ignore_eos,
        "stop_token_ids": list(gen.eos_token_ids),
        "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "n": 1,
        "return_token_ids": True,
    }


def request_body(base: dict, prompt: Sequence[int], stream: bool) -> bytes:
    """The JSON body of one completion request: ``base`` (model + ``sampling_body``) and the prompt ids."""
    body = dict(base, prompt=prompt.tolist() if hasattr(prompt, "tolist") else [int(t) for t in prompt])
    if stream:
        body.update(stream=True, stream_options={"include_usage": True}, stream_interval=STREAM_INTERVAL)
    return json.dumps(body, separators=(",", ":")).encode()


def _cached(usage) -> Optional[int]:
    details = (usage or {}).get("prompt_tokens_details") or {}
    val = details.get("cached_tokens")
    return None if val is None else int(val)


#: Bytes a non-streamed reply may hold: one answer of a few hundred ids (``return_token_ids``) and its text is a few
#: KB; 16 MiB leaves room for any ``max_tokens`` this harness asks and stops a server that never ends its body.
MAX_REPLY_BYTES = 16 << 20


#: The largest id a reply may hold: answers are kept as int32, and numpy before 2.0 narrows a larger Python int
#: silently (2**32 + 20 becomes 20, an id inside the vocabulary that passes the answer check).
MAX_ID = 2**31 - 1


def _choice_ids(choice: dict, streamed: bool) -> list[int]:
    if not isinstance(choice, dict) or choice.get("index", 0) != 0:
        raise ReplyError(f"a choice other than the one answer asked for (n=1): {str(choice)[:200]}")
    ids = choice.get("token_ids")
    if ids is None:
        if streamed and not choice.get("text"):
            return []  # a chunk without new ids (e.g. the last one, with only its finish_reason)
        raise NoTokenIds("the server returns text instead of token ids (choices[0].token_ids is missing: it needs "
                         "vLLM >= 0.10.2, which honours return_token_ids)")
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t <= MAX_ID for t in ids):
        raise ReplyError(f"choices[0].token_ids is not a list of token ids (integers >= 0 that fit int32): "
                         f"{str(ids)[:200]}")
    return ids


def _error_of(data: dict) -> Optional[str]:
    err = data.get("error")
    if err is None:
        return None
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


#: ``finish_reason`` values of a finished answer (vLLM's OpenAI server: EOS / stop id, max_tokens).
FINISHED = ("stop", "length")


def check_finished(finish_reason: Optional[str], n_ids: int, max_tokens: int) -> None:
    """``ReplyError`` unless ``finish_reason`` says the answer (``n_ids`` generated ids) ended normally:
    ``stop``, or ``length`` at exactly ``max_tokens`` ids (a server whose own limit is lower, e.g. a
    ``--override-generation-config`` ``max_new_tokens``, answers ``length`` early: cut short)."""
    if finish_reason not in FINISHED:
        why = "no finish_reason" if not finish_reason else f"finish_reason {finish_reason!r}"
        raise ReplyError(f"the answer ended with {why} after {n_ids} ids (a finished one says 'stop' or 'length')")
    if n_ids > max_tokens:
        raise ReplyError(f"the answer has {n_ids} ids, more than max_tokens {max_tokens} (finish_reason "
                         f"{finish_reason!r}): the server sent ids twice or did not keep to max_tokens")
    if finish_reason == "length" and n_ids != max_tokens:
        raise ReplyError(f"the answer ended with finish_reason 'length' after {n_ids} ids, but max_tokens is "
                         f"{max_tokens} (the server's own token limit is lower: its answers are cut short)")


def completion_tokens(data) -> Optional[int]:
    """``usage.completion_tokens`` of a reply or streamed chunk; None when it carries no ``usage`` (streamed, only
    the last chunk has it). ``ReplyError`` when ``usage`` holds a count that is not an integer >= 0."""
    usage = data.get("usage") if isinstance(data, dict) else None
    if usage is None:
        return None
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if type(n) is not int or n < 0:
        raise ReplyError(f"usage.completion_tokens is not a count of tokens (an integer >= 0): {str(usage)[:200]}")
    return n


def check_count(counted: Optional[int], n_ids: int) -> None:
    """``ReplyError`` when the server's own count of generated tokens (``usage.completion_tokens``) is missing
    (vLLM sends it in every reply, and in a stream's last chunk when ``stream_options.include_usage`` is asked, as
    here) or differs from the ``n_ids`` ids received: ids lost, or sent twice (a chunk repeated by a proxy), which
    length, EOS and vocabulary checks cannot see."""
    if counted is None:
        raise ReplyError(f"the reply carries no usage.completion_tokens (vLLM sends it; without it {n_ids} ids cannot "
                         "be checked for ids lost or sent twice on the way)")
    if counted != n_ids:
        raise ReplyError(f"the server counted {counted} generated tokens (usage.completion_tokens) but {n_ids} ids "
                         f"came: ids were lost or sent twice on the way")


def reply_prompt(data) -> Optional[list]:
    """``choices[0].prompt_token_ids`` of a reply or streamed chunk (vLLM returns it with ``return_token_ids``: in a
    reply, and in the first chunk of a stream that carries ids); None when absent."""
    choices = data.get("choices") if isinstance(data, dict) else None
    first = choices[0] if isinstance(choices, list) and choices else None
    return first.get("prompt_token_ids") if isinstance(first, dict) else None


def check_prompt(returned, sent: Sequence[int], required: bool) -> None:
    """``ReplyError`` when the prompt ids a reply says it answered (``reply_prompt``) are not the ``sent`` ones: a
    proxy or load balancer that mixed up replies between requests (every other check passes such an answer).
    ``required``: a non-streamed reply must carry them (vLLM always does with ``return_token_ids``); a stream may
    lack them (vLLM skips its first chunk when that chunk has no new token), and is then not compared."""
    if returned is None:
        if required:
            raise ReplyError("the reply carries no choices[0].prompt_token_ids (vLLM returns them with "
                             "return_token_ids): it cannot be told to answer this request's prompt")
        return
    want = sent.tolist() if hasattr(sent, "tolist") else list(sent)
    if returned != want:
        said = f"{len(returned)} ids" if isinstance(returned, list) else type(returned).__name__
        raise ReplyError(f"the reply answers another prompt: its prompt_token_ids ({said}: {str(returned)[:60]}) are "
                         f"not the {len(want)} ids sent: replies were mixed up on the way")


def check_stream_id(seen: Optional[str], data) -> Optional[str]:
    """The reply ``id`` of a stream so far: ``seen`` (None until a chunk carried one), else ``data``'s. ``ReplyError``
    when the chunk ``data`` carries another: vLLM sends its request id in every chunk of a stream, so a chunk of
    another id is another request's reply spliced in on the way (only the first chunk carries the prompt ids that
    ``check_prompt`` compares)."""
    got = data.get("id") if isinstance(data, dict) else None
    if got is None or seen is None:
        return seen if got is None else got
    if got != seen:
        raise ReplyError(f"a stream chunk of reply {str(got)[:80]!r} came in the stream of reply {str(seen)[:80]!r}: "
                         "replies were mixed up on the way")
    return seen


def parse_completion(data) -> tuple[list[int], Optional[int], Optional[str]]:
    """``(generated ids, cached prompt tokens or None, finish_reason or None)`` of a non-streamed
    reply; ``ReplyError`` / ``NoTokenIds`` when it has no usable ids."""
    if not isinstance(data, dict):
        raise ReplyError(f"reply is not a JSON object: {str(data)[:200]}")
    if (err := _error_of(data)) is not None:
        raise ReplyError(f"server error: {err}")
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        raise ReplyError(f"expected one choice, got {str(choices)[:200]}")
    return _choice_ids(choices[0], streamed=False), _cached(data.get("usage")), _finish(choices[0])


def _finish(choice) -> Optional[str]:
    reason = choice.get("finish_reason") if isinstance(choice, dict) else None
    return None if reason is None else str(reason)


def parse_chunk(data) -> tuple[list[int], Optional[int], Optional[str]]:
    """``(new ids, cached prompt tokens or None, finish_reason or None)`` of one streamed chunk
    (``data: {...}``)."""
    if not isinstance(data, dict):
        raise ReplyError(f"stream chunk is not a JSON object: {str(data)[:200]}")
    if (err := _error_of(data)) is not None:
        raise ReplyError(f"server error: {err}")
    ids: list[int] = []
    reason = None
    if len(data.get("choices") or []) > 1:
        raise ReplyError(f"stream chunk with {len(data['choices'])} choices, one answer was asked for (n=1): "
                         f"{str(data)[:200]}")
    for choice in data.get("choices") or []:
        ids += _choice_ids(choice, streamed=True)
        reason = _finish(choice) or reason
    return ids, _cached(data.get("usage")), reason
