"""The server's messages to a worker process (issue 30): written at once when the pipe takes them, never waiting
on a worker that does not read, always whole and in order.

The :class:`~asyncinterp.serve.workers.channel.Outbox` writes a message from the sending thread (the server's
event loop) when nothing is queued before it and the pipe takes it without waiting; everything else, and the
rest of a message the pipe took only part of, goes to the sender thread. Here the reading end stays unread
while megabytes are sent: no ``put`` may block, and once the end is read every message arrives, whole, in order.
"""

import multiprocessing
import threading
import time

import pytest

from asyncinterp.serve.workers.channel import DIRECT_MAX, PIPE_BUFFER, Channel, Outbox, widen


def pipe():
    ours, theirs = multiprocessing.get_context("fork").Pipe(duplex=True)
    return Channel(ours), theirs


def start_sender(outbox):
    sender = threading.Thread(target=outbox.run, daemon=True)
    sender.start()
    return sender


def close(outbox, sender, channel):
    outbox.put(None)
    sender.join(5)
    assert not sender.is_alive(), "the sender thread did not end when the outbox closed"
    channel.close()


def received(conn, n, timeout=30.0):
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        assert conn.poll(max(0.0, deadline - time.monotonic())), f"only {len(out)} of {n} messages arrived"
        out.append(conn.recv_bytes())
    return out


def test_a_lone_small_message_is_written_by_its_sender_without_the_thread():
    channel, theirs = pipe()
    outbox = Outbox(channel)            # no sender thread runs
    outbox.put(b"run job 1")
    assert theirs.poll(5) and theirs.recv_bytes() == b"run job 1"
    big = bytes(range(256)) * (DIRECT_MAX // 256 + 1)
    outbox.put(big)                     # too large to write from the caller: queued for the thread
    assert not theirs.poll(0.2)
    sender = start_sender(outbox)
    assert received(theirs, 1) == [big]
    close(outbox, sender, channel)


def test_sending_never_waits_on_a_worker_that_does_not_read_and_nothing_is_lost_or_reordered():
    channel, theirs = pipe()
    outbox = Outbox(channel)
    messages = [(b"%06d" % i) + bytes([i % 251]) * (7000 + 997 * (i % 17)) for i in range(400)]   # ~5 MB
    t0 = time.monotonic()
    for m in messages:                  # nobody reads and no sender thread runs yet: the pipe fills up
        outbox.put(m)
    assert time.monotonic() - t0 < 5.0, "put waited on the pipe"
    assert outbox.queue, "the pipe took 5 MB without anybody reading: the test did not fill it"
    sender = start_sender(outbox)
    got = received(theirs, len(messages))
    assert got == messages              # whole and in order
    outbox.put(b"after")                # the queue drained: written at once again
    assert received(theirs, 1) == [b"after"]
    close(outbox, sender, channel)


def test_a_broken_pipe_is_reported_by_the_sender_thread():
    channel, theirs = pipe()
    outbox = Outbox(channel)
    theirs.close()                      # the worker died
    errors = []

    def run():
        try:
            outbox.run()
        except (OSError, ValueError) as exc:
            errors.append(exc)
    sender = threading.Thread(target=run, daemon=True)
    sender.start()
    for _ in range(3):
        outbox.put(b"x" * 100)          # never raises in the caller
    sender.join(5)
    assert errors and isinstance(errors[0], OSError), errors
    channel.close()


class _TakesHalf(Channel):
    """A pipe that takes only the first half of what is written at once (as a full TCP or pipe buffer may)."""

    def try_send(self, frame):
        return super().try_send(frame[:max(1, len(frame) // 2)])


def test_the_rest_of_a_message_the_pipe_took_in_part_goes_first():
    ours, theirs = multiprocessing.get_context("fork").Pipe(duplex=True)
    channel = _TakesHalf(ours)
    outbox = Outbox(channel)
    outbox.put(b"first message, written in part")
    outbox.put(b"second")             # queued behind the rest of the first
    assert [raw for raw, _ in outbox.queue] == [True, False]
    sender = start_sender(outbox)
    assert received(theirs, 2) == [b"first message, written in part", b"second"]
    close(outbox, sender, channel)


def test_a_message_in_parts_arrives_whole_and_in_order_with_the_others():
    """``send_parts`` (a worker's large answer) writes its parts without joining them; the pipe takes a few
    megabytes only as the reader reads, so the writes are partial. The reader (``recv``, the server) gets each
    message whole, in order, among plain ones sent from another thread."""
    from asyncinterp.client import wire
    ours, theirs = multiprocessing.get_context("fork").Pipe(duplex=True)
    writer, reader = Channel(ours), Channel(theirs)
    blob = bytes(range(256)) * (3 << 12)            # 3 MiB: more than the pipe holds
    parts = [wire.array_header(2), wire.packb({"ok": True}), wire.packb({"ok": True, "value": blob})]
    size = sum(len(p) for p in parts)
    head = wire.packb_with({"t": "done", "id": 1, "ok": True}, "value", wire.bin_header(size))

    def send():
        for i in range(3):
            writer.send_parts([head, *parts])
            writer.send({"t": "event", "id": i})
    t = threading.Thread(target=send)
    t.start()
    got = [reader.recv(True) for _ in range(6)]
    t.join(10)
    for i in range(3):
        assert got[2 * i]["value"] == b"".join(parts)
        assert wire.unpackb(got[2 * i]["value"]) == [{"ok": True}, {"ok": True, "value": blob}]
        assert got[2 * i + 1] == {"t": "event", "id": i}
    writer.close()
    try:
        reader.recv()
        raise AssertionError("a closed pipe must end the reader")
    except EOFError:
        pass
    reader.close()


def test_a_widened_pipe_takes_a_large_answer_whole_before_its_reader_reads():
    """A worker's answer (a [1, vocab] tensor is 200 KB) goes into its pipe in one write, without waiting for
    the server's reader thread to drain it piece by piece."""
    wmem_max = int(open("/proc/sys/net/core/wmem_max").read())
    if wmem_max < 2 << 20:
        pytest.skip(f"this system caps socket buffers at {wmem_max} bytes (net.core.wmem_max)")
    ours, theirs = multiprocessing.get_context("fork").Pipe(duplex=True)
    for end in (ours, theirs):
        widen(end)
    writer = Channel(theirs)
    answer = bytes(range(256)) * (4096 if PIPE_BUFFER >= 2 << 20 else 1024)   # 1 MiB (or 256 KiB)
    done = threading.Event()
    threading.Thread(target=lambda: (writer.send_parts([answer[:1000], answer[1000:]]), done.set()),
                     daemon=True).start()
    assert done.wait(5), "the write waited for the reader"
    assert Channel(ours)._recv_frame() == answer
    ours.close()
    theirs.close()


def test_widening_a_one_way_pipe_changes_nothing():
    reader, writer = multiprocessing.get_context("fork").Pipe(duplex=False)
    for end in (reader, writer):
        widen(end)
    writer.send_bytes(b"still works")
    assert reader.recv_bytes() == b"still works"
