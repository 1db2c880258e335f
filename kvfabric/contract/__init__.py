"""The contract: what crosses a process boundary, the layouts both sides agree on.

engine (vLLM's scheduler thread) --records (:mod:`.records`)--> ring (:mod:`.ring`, shared memory) --> forwarder
process --event rows (:mod:`.schema`) over the wire protocol (:mod:`.protocol`)--> collector

* :mod:`.records`: the call records the engine makes, one tuple per vLLM call (written by the engine only);
* :mod:`.ring`: the single-producer, single-consumer byte ring; its header table says which side writes each word;
* :mod:`.schema`: the event table's columns, types and stream metadata keys (the collector's and queries' contract);
* :mod:`.protocol`: the sink <-> collector acknowledgements, the limits both sides enforce (label length, batch
  rows and bytes: the settings table checks against them) and where they meet by default (the socket path).

Nothing here runs on its own or owns state beyond one ring's memory; this package imports nothing else of
``kvfabric`` (``tests/test_import_graph.py``), so every other package may import it.
"""
