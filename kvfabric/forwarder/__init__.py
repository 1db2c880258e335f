"""The forwarder: its own process (``python -m kvfabric.forwarder``), which turns the engine's call records into
events and ships them.

ring (:mod:`kvfabric.contract.ring`) -> :mod:`.loop` (main thread: read, expand with the lifecycle expander)
-> :class:`~.buffer.EventBuffer` -> :mod:`.sinks` (sink thread: Arrow batches to the collector's socket, or JSONL)

vLLM's scheduler thread only copies each step's records (``marshal``, one C call) into a shared-memory ring
(:mod:`kvfabric.contract.ring`). This process, on another core and with its own GIL, reads the ring, expands records
into per-block event rows with the side table (:class:`~kvfabric.lifecycle.expander.Expander`), converts them to
Arrow and streams them to the collector over its Unix socket (or appends JSONL), with reconnects and backoff
(:mod:`.sinks`).

Start-up: ``--ring-fd`` is the ring's memfd, inherited from the parent; ``--metadata`` the stream metadata. A
``unix://`` sink connects at once and says who it is (schema metadata, answered by the collector's HELLO) before
the engine has any request: that is how ``kvfabric status`` lists an engine that is on but idle.
Shutdown: when the parent sets the ring's closing word (or dies), drain the ring, flush the sink, exit.

Loss stays counted end to end: the parent reports what it could not hand over (a full ring) as ``LOST`` records,
this process reports what it cannot deliver as ``sink_dropped`` rows, and it publishes in the ring's header how
many events it expanded and how many are accounted for (delivered, or lost and reported), so that if it dies the
parent counts the difference.

Who owns what: the main thread owns the expander (and its side table) and the ring's consumer words; the sink
thread owns the connection and its replay buffer; the buffer is the one thing both touch (lock-free, see
:mod:`.buffer`). The engine's ``RingOutlet`` (:mod:`kvfabric.engine.handover`) starts this process by name; this
package imports :mod:`kvfabric.contract` and :mod:`kvfabric.lifecycle`, never :mod:`kvfabric.engine`.
"""
