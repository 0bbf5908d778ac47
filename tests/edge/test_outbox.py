"""The node outbox keeps order, caps by priority with counted drops, and survives kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from edgehaul.edge.outbox import PRIO_ALERT_L1, PRIO_ALERT_L2, PRIO_STATS, Outbox
from tests.waiting import wait_for


def test_order_peek_ack(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "outbox.sqlite", "node-a")
    seqs = [ob.append("edgehaul.link.stats", {"i": i}) for i in range(5)]
    assert seqs == sorted(seqs) and len(set(seqs)) == 5
    got = ob.peek(3)
    assert [e.payload["i"] for e in got] == [0, 1, 2] and all(e.node_id == "node-a" for e in got)
    assert ob.ack(got[-1].seq) == 3
    assert [e.payload["i"] for e in ob.peek(10)] == [3, 4]
    # seq never reused after deletes, also across reopen
    ob.ack(seqs[-1])
    ob.close()
    ob2 = Outbox(tmp_path / "outbox.sqlite", "node-a")
    assert ob2.append("x", {}) > seqs[-1]


@settings(max_examples=30, deadline=None)
@given(prios=st.lists(st.sampled_from([PRIO_ALERT_L1, PRIO_ALERT_L2, PRIO_STATS]), min_size=1, max_size=40))
def test_cap_drops_stats_before_alerts(tmp_path_factory, prios: list[int]) -> None:
    ob = Outbox(tmp_path_factory.mktemp("ob") / "o.sqlite", "n", cap=5)
    for i, p in enumerate(prios):
        ob.append(f"e{p}", {"i": i}, priority=p)
    kept = ob.peek(100)
    assert len(kept) == min(5, len(prios))
    # nothing lost: every appended event is kept or counted as dropped
    assert len(kept) + sum(ob.dropped().values()) == len(prios)
    # an alert is never dropped while a stats entry older or newer remains
    if ob.dropped().get(f"e{PRIO_ALERT_L1}") or ob.dropped().get(f"e{PRIO_ALERT_L2}"):
        assert all(e.priority != PRIO_STATS for e in kept[:-1])
    ob.close()


_WRITER = """
import sys
from edgehaul.edge.outbox import Outbox
ob = Outbox(sys.argv[1], "node-k")
i = 0
while True:
    ob.append("edgehaul.link.stats", {"i": i})
    print(i, flush=True)
    i += 1
"""


def test_survives_kill_9(tmp_path: Path) -> None:
    db = tmp_path / "outbox.sqlite"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(db)], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    assert proc.stdout is not None
    lines = iter(proc.stdout.readline, "")
    last = wait_for(lambda: (n := int(next(lines))) >= 50 and n, 30, "50 appends reported by the writer", interval=0)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ob = Outbox(db, "node-k")
    got = [e.payload["i"] for e in ob.peek(100_000)]
    # every append reported as done is there, in order, no gaps
    assert got == list(range(len(got))) and len(got) - 1 >= last
