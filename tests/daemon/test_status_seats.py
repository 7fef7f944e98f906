"""The status port's admission rules (``peerd/status_seats.py``), driven without sockets: remote
hosts are capped per address and never take the places kept for this machine, a newcomer displaces
the connection that has waited longest, and connections being answered are never displaced."""

from __future__ import annotations

from peerd.status_seats import StatusSeats


class Ticket:
    def __init__(self, name: str) -> None:
        self.name = name
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def seat(seats: StatusSeats, host: str, name: str):
    ticket = Ticket(name)
    return seats.admit(host, ticket), ticket


def test_a_remote_flood_leaves_the_local_reserve_and_displaces_only_remote_waiters():
    seats = StatusSeats(max_connections=4, local_reserved=2, max_per_address=8)
    local, local_ticket = seat(seats, "127.0.0.1", "operator's dashboard")
    remote = [seat(seats, f"10.0.0.{i}", f"remote {i}") for i in range(1, 10)]
    # Two remote places in all (4 - 2 reserved): each remote newcomer displaced the oldest remote one.
    assert [ticket.cancelled for _, ticket in remote] == [True] * 7 + [False] * 2
    assert not local_ticket.cancelled and seats.open == 3
    # The operator still gets in, without displacing anyone: the reserve is there.
    status, status_ticket = seat(seats, "127.0.0.1", "peerd status")
    assert status is not None and seats.open == 4
    assert not any(ticket.cancelled for _, ticket in remote[-2:])
    # Full now: another remote host displaces a remote waiter, never a local one within the reserve.
    _, late = seat(seats, "10.0.0.99", "late remote")
    assert remote[-2][1].cancelled and not local_ticket.cancelled and not status_ticket.cancelled
    assert not late.cancelled and seats.open == 4


def test_one_remote_address_holds_at_most_its_cap_and_an_ipv6_64_is_one_address():
    seats = StatusSeats(max_connections=32, local_reserved=8, max_per_address=2)
    _, other = seat(seats, "192.0.2.7", "another host")
    first = [seat(seats, "2001:db8:1:2::1", "a"), seat(seats, "2001:db8:1:2::2", "b")]
    _, third = seat(seats, "2001:db8:1:2:ffff::3", "c")  # same /64: displaces that /64's oldest
    assert [ticket.cancelled for _, ticket in first] == [True, False]
    assert not third.cancelled and not other.cancelled and seats.open == 3
    _, elsewhere = seat(seats, "2001:db8:1:3::1", "another /64")
    assert not elsewhere.cancelled and seats.open == 4


def test_connections_being_answered_are_never_displaced_and_a_newcomer_is_then_refused():
    seats = StatusSeats(max_connections=2, local_reserved=1, max_per_address=8)
    a, a_ticket = seat(seats, "127.0.0.1", "a")
    b, b_ticket = seat(seats, "127.0.0.1", "b")
    seats.answering(a)
    seats.answering(b)
    refused, _ = seat(seats, "127.0.0.1", "c")
    assert refused is None and seats.open == 2
    seats.waiting(b)  # b was answered and idles on keep-alive: it may now make room
    c, c_ticket = seat(seats, "127.0.0.1", "c")
    assert c is not None and b_ticket.cancelled and not a_ticket.cancelled
    seats.release(b)  # the displaced connection's own ending changes nothing more
    assert seats.open == 2
    seats.release(a)
    d, d_ticket = seat(seats, "127.0.0.1", "d")
    assert d is not None and not c_ticket.cancelled and not d_ticket.cancelled


def test_the_longest_waiter_goes_first_counting_from_its_last_answer():
    seats = StatusSeats(max_connections=2, local_reserved=1, max_per_address=8)
    a, a_ticket = seat(seats, "127.0.0.1", "a")
    _, b_ticket = seat(seats, "127.0.0.1", "b")
    seats.answering(a)
    seats.waiting(a)  # a was just answered: b has now waited longer
    seat(seats, "127.0.0.1", "c")
    assert b_ticket.cancelled and not a_ticket.cancelled


def test_a_remote_newcomer_displaces_local_waiters_only_beyond_the_reserve():
    seats = StatusSeats(max_connections=3, local_reserved=1, max_per_address=8)
    local = [seat(seats, "127.0.0.1", f"local {i}") for i in range(3)]
    remote, _ = seat(seats, "10.0.0.1", "remote")
    assert remote is not None and local[0][1].cancelled
    remote_2, _ = seat(seats, "10.0.0.2", "remote 2")
    assert remote_2 is not None and local[1][1].cancelled
    # One local connection left, the reserve: a third remote one displaces a remote waiter instead.
    _, remote_3 = seat(seats, "10.0.0.3", "remote 3")
    assert not local[2][1].cancelled and not remote_3.cancelled and seats.open == 3
