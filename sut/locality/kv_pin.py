"""Every case's KV cache the size of the first case's (``--kv-sizing first-case``, the default).

The first case with freshly started engines (``eviction``: its KV probe; ``arrivals``: its capacity
calibration) sizes its KV cache by vLLM's memory profiling, as any engine does. Every later case gets that
size given: ``num_gpu_blocks_override`` = the first case's blocks and ``kv_cache_memory_bytes`` = blocks x the
engine's bytes per block
(``sut.engine.readback.kv_bytes_per_block``). Nothing is profiled then, so engines that share one GPU
(``--engines-per-device`` > 1) start together instead of one after the other (``EnginePool._waves``, the
Flame transport's ``_start_groups``): on one H100 two engines took ~43 s to start one after the other
(2026-12-06, ``docs/results/h100_2026-12-06c``), most of it each engine's own start-up before the GPU is
touched. Every case has the same cache, which the pair ratios assume anyway.

The pin is taken only when every replica of the first case reports the same blocks and bytes per
block (one ``EngineSettings`` serves all engines); otherwise (replicas on different cards, a record
without them: ``vllm serve`` fleets, running servers) each case profiles, as with ``--kv-sizing
each-case``. A pinned case whose replicas report other blocks fails (``RunFailed``); replicas that report
no blocks at all (a ``vllm serve`` fleet after another system's first case) are given the pin unconfirmed
(the case's ``kv_pin_unconfirmed`` lists them).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

from sut.engine import EngineSettings
from sut.errors import RunFailed

log = logging.getLogger(__name__)

#: ``PairSettings.kv_sizing`` values.
KV_SIZINGS = ("first-case", "each-case")


@dataclass
class KvPinState:
    """The run's pin (``pin``, None: none) and whether it is settled (``decided``: the first start with fresh
    engines has been seen). One object per run: ``StudyContext.kv`` holds it, and the context's copies
    (``dataclasses.replace``: the arrivals calibration's, the eviction sizing's) share it."""

    pin: Optional[dict] = None
    decided: bool = False

    def for_case(self, fresh: bool, kv_sizing: str) -> Optional[dict]:
        """The pin a case's engines get: the run's, for fresh engines under ``first-case``; else None."""
        return self.pin if fresh and kv_sizing == "first-case" else None

    def decide(self, infos: Sequence[dict], name: str, fresh: bool, kv_sizing: str) -> None:
        """Settle the pin from the first start with fresh engines under ``first-case`` (``pin_from`` of its replica
        records ``infos``; ``name``: that start's, for the record); later calls change nothing."""
        if fresh and kv_sizing == "first-case" and not self.decided:
            self.pin, self.decided = pin_from(infos, name), True


def pin_from(infos: Sequence[dict], case_name: str) -> Optional[dict]:
    """The pin the first case's replica records give: ``{"blocks", "bytes_per_block", "bytes", "case"}``,
    or None (logged) when they do not all report the same blocks and bytes per block."""
    kvs = [(i.get("kv_cache") or {}) for i in infos]
    sizes = {(kv.get("blocks"), kv.get("bytes_per_block")) for kv in kvs}
    if not kvs or len(sizes) != 1 or None in next(iter(sizes)):
        log.info("%s: replicas report KV caches %s: every case sizes its own (memory profiling)", case_name,
                 sorted(sizes, key=str))
        return None
    blocks, per_block = next(iter(sizes))
    pin = {"blocks": int(blocks), "bytes_per_block": int(per_block), "bytes": int(blocks) * int(per_block),
           "case": case_name}
    log.info("%s: the later cases' engines get its KV cache: %d blocks, %.2f GiB each (no memory profiling; "
             "engines sharing a device start together)", case_name, pin["blocks"], pin["bytes"] / 2**30)
    return pin


def pinned_engine(engine: EngineSettings, pin: Optional[dict]) -> EngineSettings:
    """``engine`` with the pinned KV cache (unchanged when ``pin`` is None)."""
    if pin is None:
        return engine
    return dataclasses.replace(engine, kv_cache_memory_bytes=pin["bytes"], num_gpu_blocks_override=pin["blocks"])


def check_pinned(infos: Sequence[dict], pin: dict, case_name: str) -> list[int]:
    """The replicas of a pinned case that report no KV-cache blocks (a ``vllm serve`` fleet started with
    ``--disable-log-stats`` has none in its record: given the pin, not confirmed; logged). ``RunFailed`` naming
    the replica when one reports other blocks than the pin (the caller names the case)."""
    unconfirmed = []
    for r, info in enumerate(infos):
        blocks = (info.get("kv_cache") or {}).get("blocks")
        if blocks is None:
            unconfirmed.append(r)
        elif blocks != pin["blocks"]:
            raise RunFailed(f"replica {r} reports {blocks} KV-cache blocks, but its engine was given {pin['case']}'s "
                            f"{pin['blocks']} (--kv-sizing first-case); run with --kv-sizing each-case")
    if unconfirmed:
        log.warning("%s: replica%s %s report no KV-cache blocks: the pinned cache (%d blocks) is not confirmed",
                    case_name, "s" if len(unconfirmed) > 1 else "", ", ".join(map(str, unconfirmed)), pin["blocks"])
    return unconfirmed
