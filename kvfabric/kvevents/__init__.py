"""vLLM's standard KV-event stream as a second source of events: engines that run without the plugin.

vLLM (``--kv-events-config``, and SGLang, llm-d, Dynamo, which speak the same format) publishes ZMQ PUB multipart
messages ``(topic, seq, msgpack KVEventBatch)`` and answers replay requests on a ROUTER socket. Per ``--kv-events``
spec, in the collector process:

  publisher --ZMQ--> :mod:`.subscriber` (one thread: SUB socket, gap and restart detection, :mod:`.replay` client)
      -> :mod:`.wire` (msgspec decoding of both encodings) -> :mod:`.convert` (block life state machine: rows in
      the plugin's event schema) -> :mod:`.stream` (stream identity, seq and loss accounting) -> the collector's
      bounded ``BatchQueue`` -> the one writer, exactly as a plugin stream's batches go.
  engine /metrics --HTTP--> :mod:`.metrics` (one thread per URL: ``prefix_cache_counters`` rows).

:mod:`.spec` parses the ``--kv-events`` and ``--engine-metrics`` values. The subscriber is the only writer of its
stream's state; nothing here touches DuckDB (the pipeline hands in lookups of the committed state).
"""
