"""The Flame-batched SUT: LoadGen samples -> batches -> Flame tasks -> vLLM engines in Flame services.

Modules: ``client`` (the LoadGen SUT, registered as ``--sut flame``), ``service`` (the Flame
service; entry point ``python -m sut.flame.serve``), ``payload`` (the task/result format),
``app`` + ``app.yaml`` (the Flame application), ``fake_engine`` (test double). See docs/flame.md.
"""
