"""opt_serving/service/ports.py: a free port comes from outside the kernel's ephemeral range, where outgoing
connections could take it before its server binds it, and is one nothing is bound to."""
import socket

from opt_serving.service import ports


def test_a_free_port_is_bindable_and_below_the_ephemeral_range():
    low, high = ports.ephemeral_ports()
    assert 0 < low <= high < 65536
    chosen = {ports.free_port() for _ in range(20)}
    if low - ports.ABOVE_RAY_WORKERS >= 1000:
        assert all(ports.ABOVE_RAY_WORKERS <= p < low for p in chosen), chosen
    assert len(chosen) > 1  # chosen at random, not one port for every caller
    with socket.socket() as s:
        s.bind(("127.0.0.1", min(chosen)))


def test_a_port_something_is_bound_to_is_never_chosen(monkeypatch):
    with socket.socket() as held, socket.socket() as other:
        held.bind(("127.0.0.1", 0))
        other.bind(("127.0.0.1", 0))
        taken, free = held.getsockname()[1], other.getsockname()[1]
        other.close()
        assert not ports.bindable(taken) and ports.bindable(free)
        choices = iter([taken, taken, free])  # the random choices: the taken port twice, then a free one
        monkeypatch.setattr(ports.random.Random, "randrange", lambda self, a, b: next(choices))
        monkeypatch.setattr(ports, "ephemeral_ports", lambda: (ports.ABOVE_RAY_WORKERS + 5000, 60999))
        assert ports.free_port() == free
