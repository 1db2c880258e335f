"""The client of a publisher's replay socket (vLLM's ``ZmqEventPublisher``: a ROUTER that resends its buffer).

Protocol: send the start seq as 8 bytes big-endian (after an empty delimiter frame: this is a DEALER, since a
REQ socket would take only the first of the many replies); the publisher answers ``("", topic, seq, payload)``
for every buffered batch with ``seq >= start``, in order, then ``("", "", -1, "")``. Its buffer holds the last
``buffer_steps`` batches: what is older is gone.

Each request gets a fresh DEALER, closed at once (linger 0) when the request ends, so the frames of a request
given up (timed out, or abandoned by the caller) can never be read as the answer to the next one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import zmq

from kvfabric.kvevents.wire import END_SEQ, Message, WireError, split_message


class ReplayTimeout(Exception):
    """The replay socket sent nothing for ``timeout_s`` (no publisher there, or it stopped mid-answer)."""


def replay(context: zmq.Context, endpoint: str, start: int, timeout_s: float,
           on_bad_frame: Callable[[WireError], None] | None = None) -> Iterator[Message]:
    """The publisher's buffered messages with ``seq >= start``, in its order, until its end marker.

    Raises :class:`ReplayTimeout` when a frame takes longer than ``timeout_s``. A malformed reply is passed to
    ``on_bad_frame`` (a :class:`~kvfabric.kvevents.wire.WireError`) and skipped. Closing the generator early
    closes the socket."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        wait_ms = max(1, int(timeout_s * 1000))
        while True:
            if not sock.poll(wait_ms, zmq.POLLIN):
                raise ReplayTimeout(f"no answer from {endpoint} within {timeout_s:g} s")
            frames = sock.recv_multipart()
            if len(frames) != 4 or frames[0] != b"":
                if on_bad_frame is not None:
                    on_bad_frame(WireError("frames", f"a replay reply of {len(frames)} frames"))
                continue
            try:
                msg = split_message(frames[1:])
            except WireError as e:
                if on_bad_frame is not None:
                    on_bad_frame(e)
                continue
            if msg.seq == END_SEQ:
                return
            yield msg
    finally:
        sock.close(linger=0)
