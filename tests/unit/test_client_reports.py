"""A client's hit reports: gathered per node and fingerprint, capped, sent from a timer, and never
sent once close() has returned."""
from __future__ import annotations

import threading
import time

from kvstore.client import reports as client_reports
from kvstore.client.reports import TOUCH_BACKLOG, TOUCH_INTERVAL, HitReports


def test_reads_gather_into_one_report_per_node_and_fingerprint(monkeypatch):
    monkeypatch.setattr(client_reports, "TOUCH_INTERVAL", 60.0)  # flushed by hand below
    sent = []
    reports = HitReports(lambda *report: sent.append(report))
    reports.add("fp1", {"a": [b"1"], "b": [b"2"]}, {})
    reports.add("fp1", {"a": [b"3"]}, {"a": [b"9"]})
    reports.add("fp2", {"a": [b"4"]}, {})
    reports.flush()
    assert sorted(sent) == [("a", "fp1", [b"1", b"3"], [b"9"]), ("a", "fp2", [b"4"], []), ("b", "fp1", [b"2"], [])]
    reports.close()


def test_reports_go_out_from_a_timer():
    done = threading.Event()
    reports = HitReports(lambda *report: done.set())
    reports.add("fp", {"a": [b"1"]}, {})
    assert done.wait(5 + TOUCH_INTERVAL)
    reports.close()


def test_a_backlog_between_reports_is_capped(monkeypatch):
    monkeypatch.setattr(client_reports, "TOUCH_INTERVAL", 60.0)
    sent = []
    reports = HitReports(lambda *report: sent.append(report))
    reports.add("fp", {"a": [b"x"] * (TOUCH_BACKLOG + 5)}, {})
    reports.add("fp", {"a": [b"y"]}, {})
    reports.close()
    assert len(sent) == 1 and len(sent[0][2]) == TOUCH_BACKLOG


def test_close_sends_what_is_queued_waits_for_a_report_in_flight_and_then_nothing_more():
    sent, sending = [], threading.Event()

    def slow(*report):
        sending.set()
        time.sleep(0.3)
        sent.append(report)

    reports = HitReports(slow)
    reports.add("fp", {"a": [b"1"]}, {})
    assert sending.wait(5)  # the timer's flush is mid-send
    reports.add("fp", {"b": [b"2"]}, {})
    reports.close()
    assert [r[0] for r in sent] == ["a", "b"]  # the one in flight finished; the queued one went out
    reports.add("fp", {"c": [b"3"]}, {})
    reports.flush()
    time.sleep(2 * TOUCH_INTERVAL)
    assert [r[0] for r in sent] == ["a", "b"]
