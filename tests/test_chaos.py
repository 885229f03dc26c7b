"""Chaos under load, the short version (benchmark/faults/chaos.py runs five minutes of every kind of kill, and the
pipelined plan): `opt-serving serve` (the embedded tiny model, its own Ray) with 16 streaming clients while the
model replica and then Serve's controller are SIGKILLed, each a few seconds into the load (after the last kill's
recovery): no clock to wait out, the run ends once the second kill has recovered and a client's request sent after
that has completed. Every request ends, as a completion or an error soon after the kill; nothing hangs; the server
serves again after each kill; nothing it started outlives it."""
import asyncio

import pytest

from benchmark import harness  # the server is started as benchmark/faults/chaos.py starts it
from opt_serving.testing import chaos

pytest.importorskip("ray.serve")
# the bound on a failed request: an error within 60 s of its component's death. The recovery limit
# only stops a server that never comes back from hanging the suite.
ERROR_BOUND_S, RECOVER_LIMIT_S = 60.0, 300.0
# seconds of load before each kill: streams are in flight (the tiny model's first tokens come in well under a
# second), and the kills' recoveries, not a run of fixed length, set how long the test takes
KILL_AFTER_S = (3.0, 6.0)


@pytest.mark.slow
def test_killing_the_replica_and_the_controller_under_load_fails_requests_cleanly_and_recovers():
    # each step compiled at its first use (--no-warmup): the kills and recoveries are tested, not warm-up's length
    with harness.serve(["--num-cpus", "2", "--drain-timeout", "2", "--no-warmup"], timeout=300) as server:
        targets = chaos.targets(server.processes, ["replica", "controller"])
        report = asyncio.run(chaos.run_chaos(server.url, targets, duration_s=0, clients=16,
                                             interval_s=KILL_AFTER_S,
                                             kill_order=["replica", "controller"], min_kills=2, max_kills=2,
                                             recover_limit_s=RECOVER_LIMIT_S))
    print("\n" + "\n".join(report.lines()))
    assert [k.target for k in report.kills] == ["replica", "controller"]
    for k in report.kills:
        assert k.served_again_s is not None and k.replaced_s is not None, report.kill_line(k)
    assert chaos.HUNG not in report.failed, report.lines()
    assert report.longest_time_to_error < ERROR_BOUND_S, report.lines()
    # the replica's death cut the streams it was serving; after each recovery the clients were served again
    replica_kill, controller_kill = report.kills
    assert any(o.kind != chaos.COMPLETED and o.start < replica_kill.at < o.end for o in report.outcomes)
    for k in report.kills:
        assert report.completed_after(k.at + k.served_again_s) > 0, report.kill_line(k)
    assert not server.left_over
