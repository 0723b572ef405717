"""HostControl over real sockets: an owner process and follower processes.

Followers run in processes started with the ``spawn`` context, so they share nothing
with the owner but the address and token, as on separate hosts.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from typing import Any

import pytest

from zkdv.driver.control import HostControl
from zkdv.errors import ZKDVError

LOOPBACK = ("127.0.0.1", 0)
TIMEOUT = 20.0
SPAWN = multiprocessing.get_context("spawn")

THREAD_KEYS = [[f"thread{t}-round{r}" for r in range(5)] for t in range(3)]


def decision(key: str) -> Any:
    return {"key": key, "sampled": key.endswith("3"), "index": [len(key), 2**40], "note": "é"}


# -- follower processes (module level so that spawn can import them) ------------------


def follower_rounds(address: tuple[str, int], token: str, rank: int, results: Any) -> None:
    """Receive every round of THREAD_KEYS plus an out-of-order pair, on 4 threads."""
    received: dict[str, Any] = {}
    errors: list[str] = []
    with HostControl(rank, 3, address=address, token=token, timeout=TIMEOUT) as control:

        def run(keys: list[str]) -> None:
            try:
                for key in keys:
                    received[key] = control.exchange(key, "ignored on followers")
            except Exception as error:  # noqa: BLE001 - reported to the parent
                errors.append(repr(error))

        # "late" is requested first and published last: it must not hold up "early",
        # which the owner only publishes after its previous rounds completed.
        late = threading.Thread(target=run, args=(["late"],))
        late.start()
        threads = [threading.Thread(target=run, args=(keys,)) for keys in [*THREAD_KEYS, ["early"]]]
        for thread in threads:
            thread.start()
        for thread in [late, *threads]:
            thread.join(TIMEOUT)
    results.put((rank, received, errors))


def follower_once(
    address: tuple[str, int],
    token: str,
    rank: int,
    size: int,
    keys: list[str],
    timeout: float,
    results: Any,
) -> None:
    """Exchange ``keys`` in order and report each value or the exception raised."""
    outcomes: list[tuple[str, str]] = []
    with HostControl(rank, size, address=address, token=token, timeout=timeout) as control:
        for key in keys:
            try:
                outcomes.append(("value", json.dumps(control.exchange(key))))
            except Exception as error:  # noqa: BLE001 - reported to the parent
                outcomes.append((type(error).__name__, str(error)))
    results.put(outcomes)


# -- fixtures and helpers -------------------------------------------------------------


@pytest.fixture
def processes() -> Iterator[Callable[..., BaseProcess]]:
    started: list[BaseProcess] = []

    def start(target: Callable[..., None], *args: Any) -> BaseProcess:
        process = SPAWN.Process(target=target, args=args, daemon=True)
        process.start()
        started.append(process)
        return process

    yield start
    for process in started:
        process.join(TIMEOUT)
        if process.is_alive():
            process.terminate()
        assert process.exitcode == 0


@pytest.fixture
def owner() -> Iterator[HostControl]:
    control = HostControl(0, 2, address=LOOPBACK, timeout=TIMEOUT)
    yield control
    control.close()


class Blocked:
    """Runs one exchange on its own thread and keeps its outcome."""

    def __init__(self, control: HostControl, key: str, value: Any = None) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(control, key, value), daemon=True)
        self._thread.start()

    def _run(self, control: HostControl, key: str, value: Any) -> None:
        try:
            self.value = control.exchange(key, value)
        except Exception as error:  # noqa: BLE001 - inspected by the test
            self.error = error
        self.done.set()

    def result(self) -> Any:
        assert self.done.wait(TIMEOUT)
        if self.error is not None:
            raise self.error
        return self.value


def wait_for_connections(owner: HostControl, count: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while len(owner._connections) < count:
        assert time.monotonic() < deadline, "followers did not connect"
        time.sleep(0.001)


def raw_request(address: tuple[str, int], line: bytes) -> dict[str, Any]:
    """Send one raw line and return the owner's JSON answer; the owner then hangs up."""
    with socket.create_connection(address, timeout=TIMEOUT) as connection:
        connection.sendall(line)
        stream = connection.makefile("rb")
        answer = json.loads(stream.readline())
        assert stream.readline() == b""  # the owner closed the connection
        return answer  # type: ignore[no-any-return]


# -- across processes -----------------------------------------------------------------


def test_it_broadcasts_rounds_to_two_follower_processes_on_many_threads(
    processes: Callable[..., BaseProcess],
) -> None:
    results = SPAWN.Queue()
    with HostControl(0, 3, address=LOOPBACK, timeout=TIMEOUT) as owner:
        for rank in (1, 2):
            processes(follower_rounds, owner.address, owner.token, rank, results)

        published: dict[str, Any] = {}

        def publish(keys: list[str]) -> None:
            for key in keys:
                published[key] = owner.exchange(key, decision(key))

        threads = [threading.Thread(target=publish, args=(keys,)) for keys in THREAD_KEYS]
        threads.append(threading.Thread(target=publish, args=(["early", "late"],)))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        reports = sorted(results.get(timeout=TIMEOUT) for _ in (1, 2))

    expected = {key: decision(key) for keys in [*THREAD_KEYS, ["early", "late"]] for key in keys}
    assert published == expected
    assert reports == [(1, expected, []), (2, expected, [])]


def test_a_missing_follower_times_out_the_owner_and_a_waiting_one_times_out_itself(
    processes: Callable[..., BaseProcess],
) -> None:
    results = SPAWN.Queue()
    with HostControl(0, 3, address=LOOPBACK, timeout=1.0) as owner:
        processes(
            follower_once, owner.address, owner.token, 1, 3, ["decision", "never"], 0.5, results
        )
        # Spawning is slow under load: publish only once rank 1 is asking.
        wait_for_connections(owner, 1)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"followers \[2\] did not receive 'decision'"):
            owner.exchange("decision", 7)
        assert 0.9 <= time.monotonic() - started < 5
        outcomes = results.get(timeout=TIMEOUT)
    assert outcomes[0] == ("value", "7")  # rank 1 was there and got it
    kind, message = outcomes[1]
    assert kind == "TimeoutError"
    assert "'never'" in message


def test_a_wrong_token_is_refused_and_never_sees_the_decision(
    processes: Callable[..., BaseProcess],
) -> None:
    results = SPAWN.Queue()
    secret = "sampled-coordinate-31337"
    with HostControl(0, 2, address=LOOPBACK, timeout=1.0) as owner:
        processes(follower_once, owner.address, "0" * 64, 1, 2, ["decision"], TIMEOUT, results)
        with pytest.raises(TimeoutError, match=r"followers \[1\]"):
            owner.exchange("decision", secret)
        outcomes = results.get(timeout=TIMEOUT)
    assert outcomes == [("PermissionError", "ZKDV host control rejected the follower's token")]
    assert secret not in repr(outcomes)


# -- one process, real sockets --------------------------------------------------------


def follower(
    owner: HostControl, *, token: str | None = None, timeout: float = TIMEOUT
) -> HostControl:
    return HostControl(
        1, owner.size, address=owner.address, token=token or owner.token, timeout=timeout
    )


def test_every_rank_returns_the_decoded_decision(owner: HostControl) -> None:
    with follower(owner) as control:
        received = Blocked(control, "round")
        assert owner.exchange("round", (1, 2.5, None)) == [1, 2.5, None]
        assert received.result() == [1, 2.5, None]


def test_each_calling_thread_keeps_one_connection_across_rounds(owner: HostControl) -> None:
    with follower(owner) as control:
        for index in range(3):
            publisher = Blocked(owner, "step", index)
            assert control.exchange("step") == index
            assert publisher.result() == index
        assert len(owner._connections) == 1
        other = Blocked(control, "other-thread")
        assert owner.exchange("other-thread", "x") == "x"
        assert other.result() == "x"
        assert len(owner._connections) == 2


def test_a_duplicate_round_in_flight_is_rejected(owner: HostControl) -> None:
    first = Blocked(owner, "round", 1)
    with follower(owner) as control:
        # Wait until the round is visible by receiving it, then publish a duplicate.
        deadline = time.monotonic() + TIMEOUT
        while "round" not in owner._rounds:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        with pytest.raises(RuntimeError, match="duplicate ZKDV control round: round"):
            owner.exchange("round", 2)
        assert control.exchange("round") == 1
    assert first.result() == 1


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (b"x" * (HostControl.limit + 10) + b"\n", "too_large"),
        (b"not json\n", "malformed"),
        (b"\xff\xfe\n", "malformed"),
        (b'{"rank": 1}\n', "malformed"),
        (b"[1, 2, 3]\n", "malformed"),
        (b"partial line without newline", "malformed"),
    ],
)
def test_a_malformed_or_oversized_request_is_rejected_without_harm(
    owner: HostControl, line: bytes, code: str
) -> None:
    with socket.create_connection(owner.address, timeout=TIMEOUT) as connection:
        connection.sendall(line)
        if not line.endswith(b"\n"):
            connection.shutdown(socket.SHUT_WR)
        stream = connection.makefile("rb")
        assert json.loads(stream.readline())["error"] == code
        assert stream.readline() == b""
    with follower(owner) as control:  # the owner still serves everyone else
        received = Blocked(control, "after")
        owner.exchange("after", "ok")
        assert received.result() == "ok"


def test_a_bad_token_or_rank_is_rejected_before_any_round(owner: HostControl) -> None:
    wrong = json.dumps([1, "nope", "round"]).encode() + b"\n"
    assert raw_request(owner.address, wrong)["error"] == "token"
    for rank in (0, 2, True, "1"):
        line = json.dumps([rank, owner.token, "round"]).encode() + b"\n"
        assert raw_request(owner.address, line)["error"] == "rank"


def test_sizes_are_bounded_on_both_sides(owner: HostControl) -> None:
    with pytest.raises(ValueError, match="limit is 65536"):
        owner.exchange("big", "x" * HostControl.limit)
    with pytest.raises(ValueError, match="non-empty string key"):
        owner.exchange("", 1)
    with pytest.raises(ValueError):
        owner.exchange("nan", float("nan"))
    with pytest.raises(TypeError):
        owner.exchange("object", object())
    with follower(owner) as control, pytest.raises(ValueError, match="key is too large"):
        control.exchange("k" * HostControl.limit)


def test_close_wakes_a_blocked_owner(owner: HostControl) -> None:
    blocked = Blocked(owner, "round", 1)
    deadline = time.monotonic() + TIMEOUT
    while "round" not in owner._rounds:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    started = time.monotonic()
    owner.close()
    with pytest.raises(ZKDVError, match="closed"):
        blocked.result()
    assert time.monotonic() - started < 2
    owner.close()  # idempotent
    with pytest.raises(ZKDVError, match="closed"):
        owner.exchange("again", 1)


def test_close_wakes_a_blocked_follower(owner: HostControl) -> None:
    control = follower(owner)
    blocked = Blocked(control, "never")
    wait_for_connections(owner, 1)
    control.close()
    with pytest.raises(ZKDVError, match="closed"):
        blocked.result()
    with pytest.raises(ZKDVError, match="closed"):
        control.exchange("again")


def test_an_owner_closing_disconnects_its_followers(owner: HostControl) -> None:
    with follower(owner) as control:
        blocked = Blocked(control, "never")
        wait_for_connections(owner, 1)
        owner.close()
        with pytest.raises(ConnectionError):
            blocked.result()


@pytest.mark.parametrize(
    "arguments",
    [
        {"rank": 0, "size": 1},
        {"rank": 2, "size": 2},
        {"rank": -1, "size": 2},
        {"rank": 0, "size": 2, "timeout": 0},
        {"rank": 0, "size": 2, "timeout": float("inf")},
        {"rank": 1, "size": 2},
        {"rank": 1, "size": 2, "address": ("127.0.0.1", 1)},
        {"rank": 0, "size": 2, "token": ""},
    ],
)
def test_invalid_configurations_are_rejected(arguments: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        HostControl(**arguments)


def test_the_owner_generates_a_token_unless_given_one() -> None:
    # The default bind address (0.0.0.0, for multi-host runs) is not exercised here:
    # tests listen on loopback only.
    with HostControl(0, 2, address=LOOPBACK, timeout=1.0) as owner:
        assert owner.address[0] == "127.0.0.1"
        assert len(owner.token) == 64
    with HostControl(0, 2, address=LOOPBACK, token="shared", timeout=1.0) as owner:
        assert owner.token == "shared"


def test_backends_without_a_process_group_need_no_channel() -> None:
    with pytest.raises(ValueError, match="unsupported ZKDV control backend: 'mpi'"):
        HostControl.for_backend("mpi")
    pytest.importorskip("torch")
    assert HostControl.for_backend("torch") is None
    pytest.importorskip("jax")
    assert HostControl.for_backend("jax") is None
