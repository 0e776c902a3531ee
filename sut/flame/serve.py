"""Entry point of the Flame service process: ``python -m sut.flame.serve`` (the app's command).

Kept import-light on purpose: the engine worker is a spawned process, and ``multiprocessing``
re-imports the main module in it; everything heavy (flamepy, grpc) is imported inside ``main``.
"""

if __name__ == "__main__":
    from sut.flame.service import main

    raise SystemExit(main())
