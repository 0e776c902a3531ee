"""Running LoadGen tests: one run (``harness``), several over one engine start (``series``), LoadGen's thread
watched from the main thread (``loadgen_watch``), ``python -m sut run`` in a child process (``child``), the
target-QPS search (``find_qps`` and its modules) and the CPU demo (``demo``)."""
