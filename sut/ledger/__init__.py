"""Answers on their way to LoadGen: the sample ledger that answers every issued sample exactly once
(``sample``), its streaming form with first tokens and per-token latencies (``streaming``), and the cutting of
an answer at its first EOS into LoadGen's response buffers (``response``)."""
