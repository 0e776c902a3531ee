"""``prefix_affinity``: prefix hashing with sticky assignment and a saturation release:

    1. Key. Cut the first ``prefix_blocks x block_tokens`` prompt tokens into full blocks of
       ``block_tokens`` and hash them as a chain (block *i*'s hash covers blocks 0..i), so two
       prompts share the hash of block *i* exactly when their first ``(i + 1) x block_tokens``
       tokens are equal. A prompt shorter than one block has no key and goes to ``least_loaded``.
    2. Sticky owner. Look the chain up from the deepest block down in the affinity map (hash →
       replica). The first hit gives the owner and the matched depth.
    3. Stay sticky unless saturated. The owner's *pressure* is its estimated work in flight
       (``load``: uncached prefill plus ``decode_weight x max_tokens`` per request, as ``least_loaded``
       counts it) minus the least-loaded replica's, the owner included (``release_gate="excess"``,
       default; equal to ``absolute`` while some replica is idle), or the owner's own work
       (``release_gate="absolute"``). If the pressure is at most ``release_tokens``, the request goes
       to the owner (an affinity hit). ``release_gate="never"``: always the owner (the study's router
       kept every assignment: ``../shared/research/study.md`` §7). Decode work counts because a
       request whose prefix is cached books little prefill: with uncached prefill alone, a hot
       document's owner took hundreds of queued requests (each waiting for a sequence slot) before
       any release — 19x the mean outstanding work on 64 simulated replicas, 24x on 256
       (``scripts/bench/bench_routing.py``, docs/benchmarks.md). With the ``excess`` gate, affinity
       never adds work to an owner already more than ``release_tokens`` ahead of the least-loaded
       replica.
    4. Otherwise — a new prefix, or a saturated owner — choose the replica with the least estimated
       work after taking the request: ``load[r] + uncached(r)``, where ``uncached(r)`` is the prompt
       length minus the matched tokens if ``r`` is the owner, else the whole prompt. Ties go to the
       replica with fewer requests in flight, then the lower index. Only the owner's term differs
       from the others', so this is the owner or the least-loaded replica, read from the router's
       ``ArgMin`` tree (``base.py``) in O(1); no step scans the replicas. A saturated owner's request
       that lands elsewhere is a *release*; if the owner is still the best choice it counts as an
       affinity hit.
    5. Seed the map. Every block hash of the key not yet in the map is assigned to the chosen
       replica (so the first request of a document makes its replica the owner; a release does not
       move an existing owner).
    6. Lost owners. An owner marked down (``Router.mark_down``) counts as no owner: the request is
       a new prefix for the live replicas (step 4), and the chosen replica takes over every block
       hash of the key that the lost replica held (counted as ``reowned``).

    Memory bound and eviction: the map holds at most ``max_entries`` entries (16-byte hash -> replica
    index). A lookup hit moves the entry it hit to the most recent end; a new entry goes there too,
    and when the map then holds more than ``max_entries`` the least recently used entry is dropped
    (LRU; counted in ``evictions``). Each entry costs at most ``MAP_ENTRY_BYTES`` (280) bytes on
    CPython 3.11 (the 49-byte hash object, plus the ordered dict's table slot, entry and list node:
    up to ~200 bytes when its table has just grown; measured by ``map_bytes`` and by
    ``scripts/bench/bench_routing.py``), so the default map stays under 65,536 x 280 B = 18.4 MB
    (measured: ~12.6 MB, 193 B an entry, filled past its bound). Nothing else of the router grows
    with the run: the per-request costs it books live only while the request is in flight.

    Load accounting: routing adds the request's estimated uncached prompt tokens (prompt minus the
    tokens the chosen replica is expected to hold) plus ``decode_weight x max_tokens`` to the
    replica; completion subtracts the same amount. The estimate is the router's own (like
    SGLang's approximate tree or llm-d's approximate scorer): engine-side hits are reported
    afterwards and can differ, e.g. after the engine evicted the blocks.

Model revision: ``model_revision`` (the model's config hash, ``sut.core.routing.model_revision``) seeds
the hash chain, so two models never share an affinity map entry (as the study's router did:
``../shared/research/study.md`` §7).

Knobs (``AffinitySettings``): ``block_tokens`` (256), ``prefix_blocks`` (4, so the key covers the
first 1,024 tokens), ``release_tokens`` (65,536 tokens of estimated work ≈ eight 8K documents: set it to
peak tokens/s x the extra latency you tolerate), ``release_gate`` (``excess``: release only when the
owner is that much busier than the least-loaded replica, so a burst that loads every replica alike
keeps affinity; ``absolute``: release when the owner alone holds that much, i.e. a TTFT bound per
owner that also releases when every replica is as busy — measured on two H200s in docs/benchmarks.md;
``excess`` never releases where ``absolute`` would not; ``never``: no release at all, the study's router and
the default of the locality entry point's study trace presets),
``max_entries`` (65,536 map entries), ``decode_weight`` (1.0).

Design notes (``../shared/research/anchors.md`` §2): every affinity-first router with a fleet-wide
imbalance gate has had hot-spot bugs, so the gate here is per request (its owner against the least
busy replica, not the fleet's max against its min, which switches affinity off for everyone), new
prefixes go to the least-loaded replica, the map is seeded by every routed request, and the map is
LRU-bounded. Reported per run: affinity hits, releases, evictions,
requests and estimated load per replica.
"""

from __future__ import annotations

import hashlib
import sys
from collections import OrderedDict

import numpy as np

from sut.core.routing.base import AffinitySettings, Router

#: Upper bound of one map entry's memory in bytes (CPython 3.11; module docstring, "Memory bound").
MAP_ENTRY_BYTES = 280


class PrefixAffinityRouter(Router):
    name = "prefix_affinity"

    def __init__(self, replicas: int, max_tokens: int, settings: AffinitySettings = AffinitySettings()):
        super().__init__(replicas, max_tokens, settings)
        self.map: "OrderedDict[bytes, int]" = OrderedDict()
        self.hits = self.releases = self.new_prefixes = self.no_key = self.evictions = self.reowned = 0
        rev = settings.model_revision
        self._seed = hashlib.blake2b(rev.encode(), digest_size=16).digest() if rev else b""

    def keys(self, prompt: np.ndarray) -> list[bytes]:
        """Chain hashes of the full ``block_tokens`` blocks in the first ``prefix_blocks`` blocks
        (the chain starts from the model revision's hash)."""
        b = self.settings.block_tokens
        n = min(len(prompt) // b, self.settings.prefix_blocks)
        data = np.ascontiguousarray(prompt[: n * b], dtype="<i4").tobytes()
        out, h = [], self._seed
        for i in range(n):
            h = hashlib.blake2b(h + data[i * b * 4:(i + 1) * b * 4], digest_size=16).digest()
            out.append(h)
        return out

    def pressure(self, owner: int) -> float:
        """The owner's estimated work in flight (tokens: uncached prefill + decode), less the least-loaded
        replica's (``release_gate="excess"``) or as it is (``"absolute"``); 0 for ``"never"``. O(1)."""
        if self.settings.release_gate == "never":
            return 0.0
        if self.settings.release_gate == "excess":
            return self.load[owner] - self.load[self.least_loaded()]
        return self.load[owner]

    def _choose(self, rid, prompt):
        keys = self.keys(prompt)
        if not keys:
            self.no_key += 1
            return self.least_loaded(), len(prompt)
        owner, depth = None, 0
        for i in range(len(keys) - 1, -1, -1):
            if keys[i] in self.map:
                owner, depth = self.map[keys[i]], i + 1
                self.map.move_to_end(keys[i])
                break
        if owner in self.down:
            owner, depth = None, 0
            self.reowned += 1
        matched = depth * self.settings.block_tokens
        if owner is not None and self.pressure(owner) <= self.settings.release_tokens:
            self.hits += 1
            r = owner
        else:
            r = self.least_loaded_for(-1 if owner is None else owner, matched)
            if owner is None:
                self.new_prefixes += 1
            elif r == owner:  # saturated, but still the best choice
                self.hits += 1
            else:
                self.releases += 1
        for k in keys:
            if k not in self.map or self.map[k] in self.down:
                self.map[k] = r
                if len(self.map) > self.settings.max_entries:
                    self.map.popitem(last=False)
                    self.evictions += 1
        return r, len(prompt) - (matched if r == owner else 0)

    def map_bytes(self) -> int:
        """Bytes the affinity map holds now: the ordered dict (table, entries, list nodes) and its hash
        objects, and replica indexes above 256 (CPython shares the smaller ones). O(entries): for reports."""
        m = self.map
        big = sum(sys.getsizeof(v) for v in m.values() if v > 256)
        return sys.getsizeof(m) + sum(sys.getsizeof(k) for k in m) + big

    def stats(self) -> dict:
        return dict(super().stats(), affinity_hits=self.hits, releases=self.releases, new_prefixes=self.new_prefixes,
                    no_key=self.no_key, map_entries=len(self.map), evictions=self.evictions,
                    **({"reowned": self.reowned} if self.down else {}))
