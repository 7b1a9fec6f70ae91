"""Slots for connections still proving themselves, and the log of refused ones."""

from __future__ import annotations

import logging

from meshlm.transport.handshakes import HandshakeSlots, RefusalLog, host_key


def test_slots_are_bounded_per_host_and_in_all():
    slots = HandshakeSlots(per_host=2, total=3)
    assert slots.take("a") and slots.take("a") and not slots.take("a")  # a's share
    assert slots.take("b") and not slots.take("c")  # all taken
    slots.release("a")
    assert slots.take("c") and not slots.take("b")


def test_an_ipv4_peer_of_a_dual_stack_listener_is_the_same_host():
    assert host_key("::ffff:10.0.0.7") == host_key("10.0.0.7") == "10.0.0.7"
    assert host_key("::1") == "::1" and host_key("fe80::ffff:1") == "fe80::ffff:1"


def test_a_flood_of_refusals_is_a_few_lines_and_a_count(caplog):
    caplog.set_level(logging.WARNING)
    log = RefusalLog(logging.getLogger("test.refusals"), "dropped %s: %s", first=3, every=60.0)
    for i in range(1000):
        log.refused(f"10.0.0.{i % 250}:1", "silent")
    assert len(caplog.records) == 3 and log.count == 1000
    log.close()  # the flood stopped: what no line said is counted once
    assert len(caplog.records) == 4 and "997 more connection(s) refused" in caplog.records[-1].getMessage()
    log.close()
    assert len(caplog.records) == 4
