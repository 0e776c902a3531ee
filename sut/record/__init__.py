"""The run record: ``run.json`` written (``write``) and read back (``read``), LoadGen's detail log parsed
(``loadgen_log``), TEST06 (``test06``), and the latency figure and TTFT trend (``latency_figure``,
``latency_trend``)."""
