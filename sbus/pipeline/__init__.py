"""Persistence and analytics for sbus traffic.

* `sbus.pipeline.schema`  the recording format (Parquet files, one schema)
* `sbus.pipeline.writer`  the recorder's file writer (used by ``twistd sbus-record``)
* `sbus.pipeline.replay`  ``sbus-replay``: publish a recording again
* `sbus.pipeline.report`  ``sbus-pipeline report``: batch analytics, HTML + PNG report
* `sbus.pipeline.source`  ``format("sbus")``: the Spark data source (files + live journal, seq offsets)
* `sbus.pipeline.stream`  ``sbus-pipeline stream``: Structured Streaming window aggregates
* `sbus.pipeline.cli`     the ``sbus-pipeline`` command (``python -m sbus.pipeline``)

Importing this package imports neither pyspark nor matplotlib.
"""
