"""Transport implementations of the dispatch core (``sut.core.transport`` has the interface and the factory).

* ``local`` (``local.py``): in-process vLLM engine workers (``sut.engine``), one or several per device.
* ``http`` (``http.py``): running ``vllm serve`` OpenAI-compatible servers.

The ``flame`` transport lives with the rest of the Flame code (``sut.flame.transport``).
"""
