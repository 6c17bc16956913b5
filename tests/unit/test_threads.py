"""threads.py: the thread count that runs fastest now, on a scripted machine with a fake clock."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from transformer.errors import UserError
from transformer.threads import AUTO, HELPER, ThreadTuner, label, resolve


class Machine:
    """Seconds per unit of work by thread count, alone or beside a busy process (2 cores)."""

    ALONE = {2: 1.0, 1: 1.6}
    BUSY = {2: 12.0, 1: 1.7}

    def __init__(self) -> None:
        self.now, self.busy = 0.0, False

    def clock(self) -> float:
        return self.now

    def work(self, tuner: ThreadTuner) -> int:
        tuner.start()
        threads = torch.get_num_threads()
        self.now += (self.BUSY if self.busy else self.ALONE)[threads]
        tuner.stop(1000)
        return threads


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_alone_it_keeps_every_core_and_probes_less_and_less_often():
    m = Machine()
    tuner = ThreadTuner([2, 1], probe_units=2, every_s=30, max_every_s=120, clock=m.clock)
    used = [m.work(tuner) for _ in range(400)]
    assert used[:5] == [2, 2, 1, 1, 2] and tuner.best == 2
    one = used.count(1)  # probes only: 2 units each, after 30, 60, 120, 120 ... s
    assert one <= 2 * (1 + 400 * 1.0 / 30) and used[-1] == 2
    assert tuner.every_s == 120  # doubled while the choice held, up to the cap
    # Time lost to probing, against always using 2 threads: a few percent.
    assert m.now / (400 * 1.0) < 1.04


def test_the_first_choice_is_logged_even_where_it_keeps_every_core(caplog):
    # The quickstart's log named no thread count when the first probe kept the starting one.
    m = Machine()
    tuner = ThreadTuner([2, 1], probe_units=2, every_s=30, max_every_s=120, clock=m.clock)
    with caplog.at_level(logging.INFO, logger="transformer.threads"):
        for _ in range(100):
            m.work(tuner)
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("2 CPU threads run fastest (2: ") and "1: " in said[0]
    assert len(said) == 1  # later probes that keep the choice say nothing
    m.busy = True
    with caplog.at_level(logging.INFO, logger="transformer.threads"):
        for _ in range(20):
            m.work(tuner)
    assert [r.getMessage() for r in caplog.records][1].startswith("1 CPU thread run fastest now")


@pytest.mark.parametrize(("warmup", "chosen"), [(0, 1), (3, 2)])
def test_warmup_units_are_not_timed(warmup, chosen):
    # The first 3 units are slow whatever the thread count (a run's first steps allocate):
    # timed, they make every core look slower than one thread.
    m = Machine()
    tuner = ThreadTuner([2, 1], probe_units=2, every_s=30, clock=m.clock, warmup_units=warmup)
    used = []
    for unit in range(12):
        tuner.start()
        used.append(torch.get_num_threads())
        m.now += 2.5 if unit < 3 else Machine.ALONE[used[-1]]
        tuner.stop(1000)
    assert tuner.best == chosen
    assert used[:warmup] == [2] * warmup  # every core while warming up


def test_beside_a_busy_process_it_moves_to_one_thread_within_a_few_units():
    m = Machine()
    tuner = ThreadTuner([2, 1], probe_units=2, every_s=30, max_every_s=480, clock=m.clock)
    for _ in range(50):
        m.work(tuner)
    assert tuner.best == 2
    m.busy = True
    used = [m.work(tuner) for _ in range(300)]
    # At most three slow units show the drop (or a scheduled probe comes first); the re-probe
    # tries 1 thread first and 2 threads at most once more.
    assert used.index(1) <= 4 and used[:6].count(2) <= 4 and tuner.best == 1
    # Then one slow unit per scheduled probe, after 30, 60, 120, 240 s of 1-thread work.
    assert used[6:].count(2) <= 4
    # And back to both cores once the other process has stopped (at a scheduled probe).
    m.busy = False
    used = [m.work(tuner) for _ in range(600)]
    assert tuner.best == 2 and used[-1] == 2


def test_while_others_crowd_the_cpus_units_run_on_one_thread_untimed():
    # `room` (from OtherLoad's reading) says at once what a drop's three slow units and a probe
    # find out: beside a busy process no unit runs on both cores; when it stops, a probe.
    m = Machine()
    tuner = ThreadTuner([2, 1], probe_units=1, every_s=30, max_every_s=480, clock=m.clock,
                        room=lambda: 1.0 if m.busy else None)  # fmt: skip
    for _ in range(20):
        m.work(tuner)
    assert tuner.best == 2
    m.busy = True
    used = [m.work(tuner) for _ in range(400)]  # 680 s: scheduled probes would have come
    assert used == [1] * 400
    assert tuner.best == 2  # nothing timed: the choice for an uncrowded machine stands
    tuner.settle()  # between units (an encoder): one thread too
    assert torch.get_num_threads() == 1
    m.busy = False
    tuner.settle()
    assert torch.get_num_threads() == 2
    probe = tuner._next_probe
    assert probe <= m.now  # due at once: the machine changed
    used = [m.work(tuner) for _ in range(5)]
    assert used[:2] == [2, 1] and used[2:] == [2, 2, 2] and tuner.best == 2


@pytest.mark.parametrize(("room", "threads"), [(15.7, 8), (8.0, 8), (7.9, 1), (0.5, 1), (-3.0, 1)])
def test_while_crowded_a_machine_of_more_cores_keeps_the_threads_its_idle_cores_hold(room, threads):
    # 16 cores, others busy on 0.3 of them: 8 threads (the most of 16, 8, 1 that fit), not 1.
    m = Machine()
    m.ALONE = {16: 1.0, 8: 1.0, 1: 1.0}
    tuner = ThreadTuner([16, 8, 1], probe_units=1, clock=m.clock, room=lambda: room)
    before = torch.get_num_threads()
    try:
        assert m.work(tuner) == threads and tuner._queue == []
        tuner.settle()
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


def test_a_probe_under_way_when_others_crowd_in_is_dropped():
    m = Machine()
    tuner = ThreadTuner([2, 1], probe_units=2, every_s=30, clock=m.clock,
                        room=lambda: 1.0 if m.busy else None)  # fmt: skip
    m.work(tuner)  # the first probe's first unit (2 threads)
    m.busy = True
    assert m.work(tuner) == 1 and tuner._queue == []
    m.busy = False
    assert [m.work(tuner) for _ in range(4)] == [2, 2, 1, 1] and tuner.best == 2


def test_a_clearly_slower_count_is_timed_once_per_probe():
    m = Machine()
    m.busy = True
    tuner = ThreadTuner([2, 1], probe_units=3, every_s=30, clock=m.clock)
    used = [m.work(tuner) for _ in range(8)]
    # The first probe times 2 threads first (three units: no other rate to compare with yet),
    # then 1 thread; afterwards 1 thread only.
    assert used == [2, 2, 2, 1, 1, 1, 1, 1] and tuner.best == 1
    used = [m.work(tuner) for _ in range(40)]
    # The next (scheduled) probe: 1 thread first, then 2 threads once: 7x slower, not again.
    assert used.count(2) == 1 and tuner.best == 1


def test_resolve_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert isinstance(resolve(AUTO), ThreadTuner) and resolve(AUTO).probe_units == 2
    assert resolve(AUTO, probe_units=1).probe_units == 1  # the translator's choice
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert resolve(AUTO) is None  # the user's setting stands
    assert resolve(None) is None
    assert resolve(1) is None and torch.get_num_threads() == 1
    with pytest.raises(UserError, match=r"--threads: at least 1 \(or auto\), not 0"):
        resolve(0)
    before = torch.get_num_threads()
    with pytest.raises(UserError, match=r"--threads: at most 1024 \(this machine has \d+ usable"):
        resolve(99999)  # once exhausted the process's thread limit: a traceback
    assert torch.get_num_threads() == before  # refused before anything was set


@pytest.mark.parametrize(
    ("value", "fixed"),
    [("1", True), ("2,1", True), (" 3 ", True), ("", False), ("0", False), ("abc", False),
     ("-1", False)],
)  # fmt: skip
def test_only_a_thread_count_in_omp_num_threads_fixes_the_count(monkeypatch, value, fixed):
    """OpenMP and torch ignore OMP_NUM_THREADS=0 or =abc (torch then uses every core): auto
    must tune then, as if it were unset, not leave the every-core default untuned."""
    import transformer.threads as threads

    monkeypatch.setenv("OMP_NUM_THREADS", value)
    monkeypatch.setattr(threads, "_warned_omp", False)
    assert threads.omp_threads_fixed() is fixed
    assert (resolve(AUTO) is None) is fixed


def test_more_threads_than_cores_is_allowed_with_a_warning(monkeypatch, caplog):
    """--threads 32 on 2 cores ran 1.8x slower than 2 (300 lines, quickstart model): say so."""
    import transformer.threads as threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    try:
        for count, warned in ((2, False), (3, True)):
            monkeypatch.setattr(threads, "_warned_over", False)
            caplog.clear()
            assert resolve(count) is None and torch.get_num_threads() == count
            said = "--threads 3 on 2 usable core(s): the threads will take turns"
            assert (said in caplog.text) is warned
    finally:
        torch.set_num_threads(before)


class _Helper:
    """Stands in for gradhelper.WeightGradHelper: the tuner only sets `active`."""

    active = False


class HelpedMachine(Machine):
    """Machine, plus "1+helper": slower than two threads alone, faster than one beside a busy
    process (as measured: docs/performance.md, round nine)."""

    ALONE = {2: 1.0, 1: 1.6, HELPER: 1.4}
    BUSY = {2: 12.0, 1: 1.7, HELPER: 1.5}

    def __init__(self, helper: _Helper) -> None:
        super().__init__()
        self.helper = helper

    def work(self, tuner: ThreadTuner):
        tuner.start()
        choice = HELPER if self.helper.active else torch.get_num_threads()
        assert not self.helper.active or torch.get_num_threads() == 1
        self.now += (self.BUSY if self.busy else self.ALONE)[choice]
        tuner.stop(1000)
        return choice


def test_the_helper_is_timed_only_where_one_thread_wins_and_chosen_beside_a_busy_process():
    helper = _Helper()
    m = HelpedMachine(helper)
    tuner = ThreadTuner([2, 1], probe_units=2, every_s=30, clock=m.clock, helper=helper)
    assert tuner.candidates == [2, 1, HELPER]
    used = [m.work(tuner) for _ in range(200)]
    assert HELPER not in used and tuner.best == 2  # alone: two threads win, no helper units
    m.busy = True
    used = [m.work(tuner) for _ in range(300)]
    # The drop: one thread first, then two (7x slower: once), then the helper and one thread
    # interleaved (4 units of the helper, 2 more of one thread); the helper wins.
    probe = used[used.index(1) :][:9]
    assert probe[:3] == [1, 1, 2] and probe[3:] == [HELPER, 1, HELPER, 1, HELPER, HELPER]
    assert tuner.best == HELPER
    assert used[-1] == HELPER and helper.active
    m.busy = False
    used = [m.work(tuner) for _ in range(600)]
    assert tuner.best == 2 and used[-1] == 2 and not helper.active


class Others:
    """The cores other processes keep busy, as `room_left` turns them into the room left."""

    def __init__(self) -> None:
        self.cores: float | None = 0.0

    def room(self):
        from transformer.threads import room_left

        return room_left(self.cores, 2)


def test_training_beside_a_busy_process_times_only_the_counts_that_fit_and_keeps_timing():
    # Training's mode (`probe_when_crowded`): beside a busy process two threads ran ~8x slower,
    # and each probe's unit of them cost seconds. The helper still has to be timed there.
    helper, others = _Helper(), Others()
    m = HelpedMachine(helper)
    tuner = ThreadTuner([2, 1], probe_units=2, every_s=30, max_every_s=480, clock=m.clock,
                        helper=helper, room=others.room, probe_when_crowded=True)  # fmt: skip
    used = [m.work(tuner) for _ in range(50)]
    assert tuner.best == 2 and HELPER not in used
    m.busy, others.cores = True, 1.0
    used = [m.work(tuner) for _ in range(600)]  # ~900 s: scheduled probes came
    assert 2 not in used  # not one unit on two threads, not even the first one
    assert used[:8] == [1, 1, HELPER, 1, HELPER, 1, HELPER, HELPER] and tuner.best == HELPER
    assert used.count(1) > 2  # probes went on: the helper against one thread
    m.busy, others.cores = False, 0.0
    used = [m.work(tuner) for _ in range(8)]
    assert used == [HELPER, HELPER, 2, 2, 1, 1, 2, 2]  # a probe at once, of every count
    assert tuner.best == 2 and not helper.active


@pytest.mark.parametrize(
    ("cores", "timed"), [(0.3, True), (0.45, True), (0.6, False), (1.3, False)]
)
def test_while_crowded_a_probe_times_two_threads_only_beside_less_than_half_a_core(cores, timed):
    helper, others = _Helper(), Others()
    m = HelpedMachine(helper)
    tuner = ThreadTuner([2, 1], probe_units=1, every_s=30, clock=m.clock, helper=helper,
                        room=others.room, probe_when_crowded=True)  # fmt: skip
    others.cores = cores
    used = [m.work(tuner) for _ in range(6)]
    assert (2 in used) is timed
    assert tuner._timed  # the units stay timed while crowded (translation's do not)


def test_a_probe_under_way_in_training_drops_its_units_of_counts_that_no_longer_fit():
    helper, others = _Helper(), Others()
    m = HelpedMachine(helper)
    tuner = ThreadTuner([2, 1], probe_units=2, every_s=30, clock=m.clock, helper=helper,
                        room=others.room, probe_when_crowded=True)  # fmt: skip
    assert m.work(tuner) == 2  # the first probe's first unit
    m.busy, others.cores = True, 1.0
    used = [m.work(tuner) for _ in range(8)]
    assert used == [1, 1, HELPER, 1, HELPER, 1, HELPER, HELPER] and tuner.best == HELPER
    tuner.settle()  # between units: the choice stands while it fits
    assert helper.active and torch.get_num_threads() == 1


def test_label():
    assert label(2) == "2 CPU threads" and label(1) == "1 CPU thread"
    assert "weight-gradient" in label(HELPER)


def _stat(path, busy_per_cpu, idle=1000):
    """A /proc/stat with two CPUs, each `busy_per_cpu` ticks spread over its busy fields, and a
    third CPU (cpu2) whose load is not this process's business."""
    lines = [f"cpu  {3 * busy_per_cpu} 0 0 {3 * idle} 0 0 0 0 0 0"]
    for n in range(3):
        user, nice, system, irq, softirq = busy_per_cpu - 4, 1, 1, 1, 1
        steal = 500  # another guest's time on the host: not this machine's load
        lines.append(f"cpu{n} {user} {nice} {system} {idle} 7 {irq} {softirq} {steal} 0 0")
    lines.insert(2, "")  # a blank line among the CPUs': skipped, not an error
    lines.append("intr 1 2 3")
    path.write_text("\n".join(lines) + "\n")


def test_other_load_counts_the_others_busy_time_on_this_processes_cpus(tmp_path, monkeypatch):
    from transformer.threads import OtherLoad

    stat = tmp_path / "stat"
    monkeypatch.setattr("os.sysconf", lambda name: 100)
    now, own = [0.0], [0.0]
    _stat(stat, busy_per_cpu=100)
    load = OtherLoad(window_s=0.5, stat=stat, cpus=[0, 1], clock=lambda: now[0],
                     own_time=lambda: own[0])  # fmt: skip
    assert load.cores() is None  # no window has ended
    assert (load.spare_cpus(1), load.spare_cpus(2), load.spare_cpus(4)) == (1, 0, 0)
    # 2 s later: each CPU 150 ticks busier (3 s of busy time on cpu0 + cpu1), 1 s of it ours
    now[0], own[0] = 2.0, 1.0
    _stat(stat, busy_per_cpu=250)
    assert load.cores() == pytest.approx((3.0 - 1.0) / 2.0)
    now[0] = 2.3  # within the next window: the last whole one's figure, /proc/stat not read
    stat.unlink()
    assert load.cores() == pytest.approx(1.0)
    now[0] = 3.0  # unreadable now: still the last figure
    assert load.cores() == pytest.approx(1.0)
    _stat(stat, busy_per_cpu=260)  # 0.2 s busy in 1 s, 0.5 s of it ours: never below zero
    now[0], own[0] = 4.0, 1.5
    assert load.cores() == 0.0


def test_other_loads_first_window_may_be_shorter(tmp_path, monkeypatch):
    from transformer.threads import OtherLoad

    stat = tmp_path / "stat"
    monkeypatch.setattr("os.sysconf", lambda name: 100)
    now = [0.0]
    _stat(stat, busy_per_cpu=100)
    load = OtherLoad(window_s=0.5, stat=stat, cpus=[0, 1], clock=lambda: now[0],
                     own_time=lambda: 0.0, first_window_s=0.2)  # fmt: skip
    now[0] = 0.1
    assert load.cores() is None
    now[0] = 0.2  # the first window: 0.2 s, the other process's 20 ticks on cpu0 and cpu1
    _stat(stat, busy_per_cpu=110)
    assert load.cores() == pytest.approx(0.2 / 0.2)
    now[0] = 0.5  # later windows are window_s long: 0.3 s in, the last figure
    _stat(stat, busy_per_cpu=110)
    assert load.cores() == pytest.approx(1.0)
    now[0] = 0.75  # a whole window_s since 0.2: nothing busy
    assert load.cores() == 0.0


def test_other_load_tells_the_siblings_part_of_the_others_load(tmp_path, monkeypatch):
    from transformer.threads import OtherLoad

    class Ours:
        seconds: dict[int, float] = {}

        def cpu_seconds(self):
            return dict(self.seconds)

    stat, ours = tmp_path / "stat", Ours()
    monkeypatch.setattr("os.sysconf", lambda name: 100)
    now = [0.0]
    ours.seconds = {11: 5.0, 12: 1.0}
    _stat(stat, busy_per_cpu=100)
    load = OtherLoad(window_s=0.5, stat=stat, cpus=[0, 1], clock=lambda: now[0],
                     own_time=lambda: 0.0, siblings=ours)  # fmt: skip
    # 2 s: others 2 cores busy; sibling 11 took 1.5 s of it, 12 ended, 13 began (not counted)
    now[0], ours.seconds = 2.0, {11: 6.5, 13: 9.0}
    _stat(stat, busy_per_cpu=300)
    assert load.cores() == pytest.approx(2.0) and load.last_siblings == pytest.approx(0.75)
    now[0], ours.seconds = 3.0, {11: 6.5, 13: 9.5}  # 13 counts from its first reading on
    _stat(stat, busy_per_cpu=350)
    assert load.cores() == pytest.approx(1.0) and load.last_siblings == pytest.approx(0.5)


def _fake_stat(proc: Path, pid: int, start: str, utime: int, stime: int) -> None:
    """/proc/PID/stat with a command name holding ") " and the fields the reader takes."""
    fields = ["S", *[str(n) for n in range(4, 30)]]
    fields[11], fields[12], fields[19] = str(utime), str(stime), start
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "stat").write_text(f"{pid} (py (x) y) {' '.join(fields)}\n")


def test_siblings_are_this_users_live_processes_of_ours_and_their_cpu_time(tmp_path, monkeypatch):
    import os

    from transformer.threads import Siblings

    monkeypatch.setattr("os.sysconf", lambda name: 100)
    proc, folder = tmp_path / "proc", tmp_path / "ours"
    _fake_stat(proc, os.getpid(), "777", 1, 1)
    mine = Siblings(folder, proc=str(proc))
    assert mine.join() and (folder / str(os.getpid())).read_text() == "777"
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    _fake_stat(proc, 11, "500", utime=250, stime=50)  # alive, as it said
    (folder / "11").write_text("500")
    _fake_stat(proc, 12, "999", 1, 1)  # its pid taken by another process since
    (folder / "12").write_text("600")
    (folder / "13").write_text("700")  # ended (killed: its file left behind)
    (folder / "14").write_text("")  # being written
    (folder / "notes").write_text("x")  # not a pid
    assert mine.cpu_seconds() == {11: pytest.approx(3.0)}  # not this process itself
    # Compared as sets: sorted as strings, this process's pid falls anywhere among the names.
    assert {p.name for p in folder.iterdir()} == {"11", "14", str(os.getpid()), "notes"}


@pytest.mark.parametrize("kind", ["writable by others", "a symlink", "a file"])
def test_siblings_are_not_read_from_a_folder_that_is_not_this_users_alone(tmp_path, kind):
    from transformer.threads import Siblings

    folder, real = tmp_path / "ours", tmp_path / "elsewhere"
    if kind == "writable by others":
        folder.mkdir()
        folder.chmod(0o777)
    elif kind == "a symlink":
        real.mkdir(mode=0o700)
        folder.symlink_to(real)
    else:
        folder.write_text("")
    mine = Siblings(folder)
    assert not mine.join()
    assert not real.exists() or list(real.iterdir()) == []


def test_without_a_usable_temporary_directory_no_siblings_are_found(monkeypatch):
    import tempfile

    from transformer.threads import Siblings

    def none():
        raise FileNotFoundError("No usable temporary directory found in ['/tmp']")

    monkeypatch.setattr(tempfile, "gettempdir", none)
    mine = Siblings()
    assert mine.dir is None and not mine.join() and mine.cpu_seconds() == {}


def test_a_sibling_leaves_at_exit_and_a_killed_ones_file_goes_at_the_next_reading(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from transformer.threads import Siblings

    folder = tmp_path / "ours"
    code = (
        "import sys; from transformer.threads import Siblings\n"
        f"assert Siblings({str(folder)!r}).join()\n"
        "print('in', flush=True); sys.stdin.readline()\n"
    )
    kids = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    try:
        assert [kid.stdout.readline() for kid in kids] == ["in\n", "in\n"]
        reader = Siblings(folder)
        assert set(reader.cpu_seconds()) == {kid.pid for kid in kids}
        kids[0].communicate("\n", timeout=60)  # ends as a process ends: its file goes
        os.kill(kids[1].pid, signal.SIGKILL)
        kids[1].wait(timeout=60)
        assert [p.name for p in folder.iterdir()] == [str(kids[1].pid)]  # left behind
        assert reader.cpu_seconds() == {}
        assert list(folder.iterdir()) == []
    finally:
        for kid in kids:
            kid.kill()
            kid.wait()


def test_training_keeps_the_helper_for_strangers_not_for_its_siblings():
    # `helps` False: the crowding is this user's other jobs of ours, from which the helper would
    # only take CPU (two trainings side by side: 105-114 s with it, 103-104 on one thread each).
    helper, others = _Helper(), Others()
    ours = [True]
    m = HelpedMachine(helper)
    tuner = ThreadTuner([2, 1], probe_units=2, every_s=30, max_every_s=480, clock=m.clock,
                        helper=helper, room=others.room, probe_when_crowded=True,
                        helps=lambda: not ours[0])  # fmt: skip
    m.busy, others.cores = True, 1.0
    used = [m.work(tuner) for _ in range(400)]
    assert set(used) == {1} and tuner.best == 1 and not helper.active
    ours[0] = False  # a stranger's process now: the helper is timed at the next probe, and wins
    used = [m.work(tuner) for _ in range(400)]
    assert tuner.best == HELPER and used[-1] == HELPER
    ours[0] = True  # ours again: the helper gives way at once
    assert m.work(tuner) == 1 and tuner.best == 1 and not helper.active


@pytest.mark.parametrize("text", ["", "intr 1 2\n", "cpu0 1 2 x 4 5 6 7\n", "cpu0 1 2\n"])
def test_other_load_is_none_where_proc_stat_says_nothing_usable(tmp_path, text):
    from transformer.threads import OtherLoad

    stat = tmp_path / "stat"
    stat.write_text(text)
    clock = iter([0.0, 10.0, 20.0])
    load = OtherLoad(stat=stat, cpus=[0], clock=lambda: next(clock))
    assert load.cores() is None
    assert OtherLoad(stat=tmp_path / "missing").cores() is None


def test_auto_counts_the_cores_this_process_may_use_not_the_machines(monkeypatch):
    # `taskset -c 0` or a CPU quota of one core on a 2-core machine: the candidates are the
    # usable cores (os.cpu_count() counts the machine's), and torch's own count, which follows
    # the affinity but not a quota, comes down to them for what runs outside the units.
    import transformer.threads as threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    before = torch.get_num_threads()
    try:
        for usable, candidates in ((1, [1]), (2, [2, 1]), (8, [8, 4, 1])):
            monkeypatch.setattr(threads, "usable_cores", lambda usable=usable: usable)
            torch.set_num_threads(4)
            assert resolve(AUTO).candidates == candidates
            assert torch.get_num_threads() == min(4, usable)  # lowered, never raised
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: two ranks share the cores
        assert ThreadTuner.for_this_machine().candidates == [4, 2, 1]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("quota", "affinity", "said"),
    [(1.0, {0, 1}, "1 of the machine's 4 cores usable (a CPU quota of 1 CPU)"),
     (1.2, {0, 1, 2, 3}, "1 of the machine's 4 cores usable (a CPU quota of 1.2 CPUs)"),
     (None, {3}, "1 of the machine's 4 cores usable (a CPU affinity of 1 CPU)"),
     (3.0, {0, 1}, "2 of the machine's 4 cores usable (a CPU affinity of 2 CPUs)"),
     (None, {0, 1, 2, 3}, None)],
)  # fmt: skip
def test_auto_says_once_why_it_uses_fewer_cores_than_the_machine_has(
    monkeypatch, caplog, quota, affinity, said
):
    import logging
    import os

    import transformer.cpuinfo as cpuinfo
    import transformer.threads as threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_said_usable", False)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: affinity)
    monkeypatch.setattr(cpuinfo, "cpu_quota", lambda *_: quota)
    with caplog.at_level(logging.INFO, logger="transformer.threads"):
        resolve(AUTO)
        resolve(AUTO)
    lines = [r.getMessage() for r in caplog.records if "usable" in r.getMessage()]
    assert lines == ([] if said is None else [f"threads auto: {said}"])


def test_since_start_reads_others_since_the_packages_import(tmp_path, monkeypatch):
    """A command's start (its imports, ~0.7 s of one core): others' use of this process's CPUs
    since `cpuinfo.START`, at once; none where that is old (a server), unknown, or of other
    CPUs."""
    import time

    from transformer import cpuinfo
    from transformer.threads import OtherLoad

    stat = tmp_path / "stat"
    monkeypatch.setattr("os.sysconf", lambda name: 100)
    monkeypatch.setattr(cpuinfo, "STAT", str(stat))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    _stat(stat, busy_per_cpu=100)
    cpuinfo.mark_start()
    start = cpuinfo.START
    assert start[1] == pytest.approx(2.0) and start[3] == {"cpu0", "cpu1"}
    # 1 s ago, with none of this process's CPU time since: 150 ticks more on each CPU
    monkeypatch.setattr(
        cpuinfo, "START", (time.monotonic() - 1.0, 2.0, time.process_time(), start[3])
    )
    _stat(stat, busy_per_cpu=250)
    load = OtherLoad.since_start()
    load.stat = stat
    assert load.cores() == pytest.approx(3.0, rel=0.05)
    monkeypatch.setattr(cpuinfo, "START", (time.monotonic() - 11.0, *cpuinfo.START[1:]))
    assert OtherLoad.since_start().cores() is None  # older than max_age_s
    monkeypatch.setattr(cpuinfo, "START", (time.monotonic() - 1.0, 2.0, 0.0, {"cpu5"}))
    assert OtherLoad.since_start().cores() is None  # another affinity since
    monkeypatch.setattr(cpuinfo, "START", None)
    assert OtherLoad.since_start().cores() is None
    stat.unlink()
    cpuinfo.mark_start()  # unreadable: no mark
    assert cpuinfo.START is None


def test_busy_seconds_adds_the_named_cpus_busy_fields(tmp_path, monkeypatch):
    from transformer.cpuinfo import busy_seconds

    stat = tmp_path / "stat"
    monkeypatch.setattr("os.sysconf", lambda name: 100)
    _stat(stat, busy_per_cpu=100)  # user, nice, system, irq, softirq; not idle, iowait, steal
    assert busy_seconds(stat, {"cpu0"}) == pytest.approx(1.0)
    assert busy_seconds(stat, None) == pytest.approx(3.0)  # every CPU, not the "cpu" total
    assert busy_seconds(stat, {"cpu7"}) is None
    assert busy_seconds(tmp_path / "missing") is None
