"""Engine occupancy when serial Flame executors feed one engine whole batches (a step-level model).

``python scripts/bench/bench_flame.py --simulate-fill`` prints :func:`simulate_fill`'s table: the
model behind the executors-per-engine rule (fill 1.0 = ``ceil(max_num_seqs / batch) + 1``
executors).
"""

from __future__ import annotations


def simulate_fill(n: int = 13368, max_num_seqs: int = 256, seed: int = 0) -> None:
    """How busy one engine stays when serial executors feed it whole batches (step-level model).

    Model: every engine step advances each running sequence by one token; the engine admits
    waiting sequences FIFO up to ``max_num_seqs``; an executor hands its batch to the engine, and
    takes the next batch only when the last sequence of its batch is done. Occupancy = mean
    running sequences per step, relative to the standalone SUT (all samples queued at once).
    """
    import collections
    import math
    import random

    def steps(lens, b, k):
        waiting, running, left, free, nxt, step, done, busy = collections.deque(), {}, {}, k, 0, 0, 0, 0
        batches = [range(i, min(i + b, n)) for i in range(0, n, b)]
        if k is None:
            for j, bt in enumerate(batches):
                waiting.extend((x, j) for x in bt)
                left[j] = len(bt)
        while done < n:
            while k is not None and free > 0 and nxt < len(batches):
                waiting.extend((x, nxt) for x in batches[nxt])
                left[nxt], nxt, free = len(batches[nxt]), nxt + 1, free - 1
            while len(running) < max_num_seqs and waiting:
                x, j = waiting.popleft()
                running[x] = [lens[x], j]
            step, busy = step + 1, busy + len(running)
            for x in [x for x, v in running.items() if v[0] == 1]:
                j = running.pop(x)[1]
                done, left[j] = done + 1, left[j] - 1
                if left[j] == 0 and k is not None:
                    free += 1
            for v in running.values():
                v[0] -= 1
        return step

    rng = random.Random(seed)
    dists = {"128 fixed (ignore_eos)": [128] * n, "uniform 20..128": [rng.randint(20, 128) for _ in range(n)],
             "normal(95, 30) in 2..128": [min(128, max(2, int(rng.gauss(95, 30)))) for _ in range(n)]}
    print(f"{n} samples, max_num_seqs {max_num_seqs}: engine occupancy relative to the standalone SUT")
    print(f"{'output lengths':<26} {'batch':>5} " + " ".join(f"{f'fill {f}':>14}" for f in (1.0, 1.5, 2.0)))
    for name, lens in dists.items():
        base = steps(lens, 64, None)
        for b in (32, 64):
            cells = []
            for f in (1.0, 1.5, 2.0):
                k = math.ceil(f * max_num_seqs / b) + (1 if f == 1.0 else 0)
                cells.append(f"{base / steps(lens, b, k):.4f} (K={k:2d})")
            print(f"{name:<26} {b:>5} " + " ".join(f"{c:>14}" for c in cells))
    print("fill 1.0 = ceil(max_num_seqs / batch) + 1 executors; fill f = ceil(f x max_num_seqs / batch)")
