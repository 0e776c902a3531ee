"""Entry point of the Flame service process: ``python -m sut.flame.serve`` (the app's command).

Kept import-light on purpose: the engine worker is a spawned process, and ``multiprocessing``
re-imports the main module in it; everything heavy (flamepy, grpc) is imported inside ``main``.
The parent's pid (the executor manager) is read first, before the slow imports: a parent that dies
during them re-parents this process, and a later ``os.getppid()`` would name the new parent, so the
service would never notice (``sut.flame.service.watch_parent``).
"""

if __name__ == "__main__":
    import os

    parent = os.getppid()
    from sut.flame.service import main

    raise SystemExit(main(parent=parent))
