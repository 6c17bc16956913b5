"""CPU threads: the count that runs fastest now, re-checked as the machine's load changes.

Not in the paper. PyTorch uses every core by default; beside one other busy process on a 2-core
machine its threads wait for each other while the other process holds a core, and a training
step runs ~12x slower than alone (one thread keeps ~95% of its own speed). `ThreadTuner` times
the work itself: it tries each candidate thread count on a few units of work (training steps,
decoder steps), keeps the fastest, and tries again when the rate falls by half (another
process started) or, less and less often while nothing changes, on a schedule (it stopped).

    tuner = ThreadTuner.for_this_machine()
    for batch in batches:
        tuner.start()
        ...                      # one unit of work
        tuner.stop(n_tokens)
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from transformer import cpuinfo

logger = logging.getLogger(__name__)

AUTO = "auto"
# Others' cores kept busy (`OtherLoad`) from which this process counts as crowded: a model then
# loads on one thread, a training run starts on one, and decoding streams keep to a CPU each.
CROWDED_CORES = 0.25
# The tuner's candidate "one thread, and the weight gradients on a second" (gradhelper.py):
# training only, where beside a busy process it beats one thread by ~10%.
HELPER = "1+helper"


def label(choice: int | str) -> str:
    """A candidate as the log says it: "2 CPU threads", "1 CPU thread and a weight-gradient
    thread"."""
    if choice == HELPER:
        return "1 CPU thread and a weight-gradient thread"
    return f"{choice} CPU thread{'s' if choice != 1 else ''}"


class ThreadTuner:
    """Chooses torch's intra-op thread count among `candidates` by measured work per second.

    Args:
        candidates: thread counts to choose from (e.g. all cores and 1).
        probe_units: units of work timed per candidate in a probe (the best one counts).
        every_s: seconds between two scheduled probes; doubled (up to `max_every_s`) after
            each probe that keeps the same choice, reset when the choice changes.
        drop: re-probe at once when the recent rate falls below this fraction of the rate
            the chosen count had in its probe.
        clock: a monotonic clock (tests pass a fake one).
        warmup_units: units run with the first candidate and not timed before the first probe
            (a training run's first steps allocate and fill caches: timed, they made the count
            tried first look slower than it is).
        helper: a `gradhelper.WeightGradHelper`: adds the candidate `HELPER` (one thread, the
            helper active), timed in a probe where one thread ran fastest of the counts.
        room: while other processes crowd this one's cores (`OtherLoad`), the cores they
            leave it; None while they do not (None as the argument: not asked). While they do,
            units run untimed on the most threads among the candidates that fit in that room,
            else the fewest: on 2 cores, one. Beside a busy process every thread's barriers
            wait for the core it holds, and the units a probe or a drop's three spend finding
            that out cost a short job most of its time (a 200-line `translate` beside one on 2
            cores: 2.5-3.0 s against 2.1-2.2 with one thread, docs/performance.md, "Round
            forty-three"). A machine of more cores keeps as many threads as its idle cores
            hold (not measured: 16 cores, others busy on 1.2 of them: 8 of 16, 8, 1). When they
            stop, a probe.
        probe_when_crowded: with `room`, units stay timed while others crowd the cores, and a
            probe times only the counts that `room` holds with half a core to spare (the fewest
            and the helper always): training, whose run is long enough to find whether the
            helper beats one thread there. A chosen count the room does not hold gives way at
            once to the most it holds, and a probe follows. Beside a busy process on 2 cores a
            quickstart training step on two threads ran ~8x slower than on one: each probe's
            unit of them, and the three units a drop took to show, cost ~3-5 s
            (docs/performance.md, "Round sixty").
        helps: while others crowd the cores, whether the helper may be timed or kept: False
            where the crowding is this user's other processes of the package (`Siblings`), from
            which the helper would only take CPU. None: always.
    """

    def __init__(
        self,
        candidates: Sequence[int],
        probe_units: int = 2,
        every_s: float = 30.0,
        max_every_s: float = 480.0,
        drop: float = 0.5,
        clock: Callable[[], float] = time.perf_counter,
        warmup_units: int = 0,
        helper=None,
        room: Callable[[], float | None] | None = None,
        probe_when_crowded: bool = False,
        helps: Callable[[], bool] | None = None,
    ) -> None:
        self.candidates: list[int | str] = sorted({max(1, int(c)) for c in candidates},
                                                  reverse=True)  # fmt: skip
        self.helper = helper
        if helper is not None:
            self.candidates.append(HELPER)
        self.probe_units, self.every_s, self.max_every_s = probe_units, every_s, max_every_s
        self.base_every_s, self.drop, self.clock = every_s, drop, clock
        self.best = self.candidates[0]
        self.best_rate = 0.0
        self.recent: list[float] = []
        self._queue: list[int | str] = []
        self._rates: dict[int | str, float] = {}
        self._next_probe = clock()  # probe at the first unit
        self._threads = self.best
        self._start = 0.0
        self._after_drop = False
        self._chosen = False  # whether a probe has chosen (the first choice is logged)
        self._warmup = warmup_units
        self._timed = True  # whether the current unit counts
        self.room, self.probe_when_crowded, self.helps = room, probe_when_crowded, helps
        self._room_seen: float | None = None  # `room` at the last unit's start
        self._was_crowded = False

    @classmethod
    def for_this_machine(cls, helper: bool = False, **kwargs) -> ThreadTuner:
        """Candidates: every core (this process's share of them under torchrun, whose
        LOCAL_WORLD_SIZE ranks share the node), half of them, one; with `helper` (training)
        also one thread with the weight-gradient helper, where the process has one (a single
        process on 2 or more usable CPUs, gradhelper.py)."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        # The cores this process may use, not the machine's: under `taskset -c 0` on 2 cores
        # (os.cpu_count() 2) a 2,028-line `translate` ran three decoding streams on one CPU,
        # 7.7 s against 6.7 on one thread ("Round forty-six").
        usable = usable_cores()
        _say_usable(usable)
        cores = max(1, usable // local)
        if helper and local == 1:  # the helper itself needs 2 usable CPUs
            from transformer.gradhelper import WeightGradHelper

            kwargs["helper"] = WeightGradHelper.for_this_process()
        return cls([cores, cores // 2, 1], **kwargs)

    def start(self) -> None:
        """Before a unit of work: set the thread count it runs with."""
        now = self.clock()
        room = self._room_seen = self._room_now()
        if room is not None and not self.probe_when_crowded:
            self._timed, self._queue = False, []  # a probe under way is dropped
            self._set(self._fitting(room))
            self._start = self.clock()
            return
        if room is not None and not all(self._holds(room, c) for c in [self.best, *self._queue]):
            # Others crowd in beside a count they leave no room for: the most that fits now,
            # and a new probe (of those that fit) as soon as units are timed; a probe under
            # way is dropped, its rates timed on a machine that has changed.
            if not self._holds(room, self.best):
                self.best = self._fitting(room)
            self._queue, self._next_probe, self._after_drop = [], now, False
        self._timed = self._warmup <= 0
        if not self._timed:
            self._warmup -= 1
        elif not self._queue and len(self.candidates) > 1 and now >= self._next_probe:
            # After a drop the others come first (the way out); on schedule the current choice
            # does, so that an other that is clearly slower is timed only once.
            # The helper is timed only once one thread has won (`stop`), unless it is the
            # choice: alone, two threads win and the helper's slower units are not spent.
            others = [c for c in self.candidates
                      if c not in (self.best, HELPER) and self._holds(room, c)]  # fmt: skip
            order = [*others, self.best] if self._after_drop else [self.best, *others]
            self._queue = [c for c in order for _ in range(self.probe_units)]
            self._rates = {}
        self._set(self._queue[0] if self._queue else self.best)
        self._start = self.clock()

    def settle(self) -> None:
        """Between units (a search's encoder, before its first timed step): sets the chosen
        count, or while others crowd the cores the count that fits beside them (`room`)."""
        room = self._room_now()
        if room is not None and (not self.probe_when_crowded or not self._holds(room, self.best)):
            self._set(self._fitting(room))
        else:
            self._set(self.best)

    def fewest(self) -> int | str:
        """The candidate with the fewest threads (1 before the helper's one)."""
        return min(self.candidates, key=lambda c: 1 if c == HELPER else c)

    def _holds(self, room: float | None, choice: int | str) -> bool:
        """Whether a probe times `choice` while `room` cores are left (None: not crowded):
        counts of more threads than the room with half a core to spare are not, nor the helper
        where `helps` says no."""
        if room is None:
            return True
        if choice == HELPER:
            return self.helps is None or self.helps()
        return choice == self.fewest() or choice <= room + 0.5

    def _fitting(self, room: float) -> int | str:
        """The most threads among the candidates that `room` cores hold, else the fewest."""
        fits = [c for c in self.candidates if c != HELPER and c <= room]
        return max(fits) if fits else self.fewest()

    def _room_now(self) -> float | None:
        """`room()`, and a probe due at once when the crowding has just ended."""
        if self.room is None:
            return None
        room = self.room()
        if self._was_crowded and room is None:
            self._next_probe, self._after_drop = self.clock(), False
        self._was_crowded = room is not None
        return room

    def _set(self, choice: int | str) -> None:
        self._threads = choice
        threads = 1 if choice == HELPER else choice
        if self.helper is not None:
            self.helper.active = choice == HELPER
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def stop(self, work: float) -> None:
        """After the unit: `work` done (tokens); updates the rates and the choice."""
        if not self._timed:
            return
        rate = work / max(self.clock() - self._start, 1e-9)
        if self._queue:
            threads = self._queue.pop(0)
            self._rates[threads] = max(self._rates.get(threads, 0.0), rate)
            best_so_far = max(self._rates.values())
            if rate < self.drop * best_so_far:  # clearly slower: no second unit of it
                self._queue = [t for t in self._queue if t != threads]
            if not self._queue and self._helper_next():
                # Within ~10% of each other: both timed again, interleaved, twice the units.
                self._queue = [HELPER, 1] * self.probe_units + [HELPER] * self.probe_units
            if not self._queue:
                self._choose()
            return
        self.recent = [*self.recent[-2:], rate]
        if len(self.recent) == 3 and max(self.recent) < self.drop * self.best_rate:
            logger.debug("throughput fell to %.0f%%: timing the thread counts again",
                        100 * max(self.recent) / self.best_rate)  # fmt: skip
            self.every_s = self.base_every_s
            self._next_probe = self.clock()
            self._after_drop = True

    def _helper_next(self) -> bool:
        """Whether the probe goes on to the helper: it has one, has not timed it, one thread
        ran fastest of the counts, and the crowding (if any) is not only ours (`helps`)."""
        if self.helper is None or HELPER in self._rates:
            return False
        if self.probe_when_crowded and not self._holds(self._room_seen, HELPER):
            return False
        return max(self._rates, key=self._rates.get) == 1

    def _choose(self) -> None:
        best = max(self._rates, key=self._rates.get)
        if best != self.best or not self._chosen:  # the first choice, kept or not, and changes
            rates = [f"{t}: {self._rates[t]:.0f}/s" for t in self.candidates if t in self._rates]
            now = " now" if self._chosen else ""
            logger.info("%s run fastest%s (%s)", label(best), now, ", ".join(rates))
        if best == self.best:
            self.every_s = min(2 * self.every_s, self.max_every_s)
        else:
            self.every_s = self.base_every_s
        self._chosen = True
        self.best, self.best_rate, self.recent = best, self._rates[best], []
        self._after_drop = False
        self._next_probe = self.clock() + self.every_s


class OtherLoad:
    """The cores that other processes kept busy on this process's CPUs, window by window.

    Not in the paper. Linux's /proc/stat counts each CPU's busy time (user, nice, system, irq,
    softirq; not idle, iowait or steal); this process's own CPU time (all its threads) taken
    from it leaves the others'. `cores()` gives their mean over the time since the window
    began, and starts a new window once the old one is `window_s` long. Elsewhere (no
    /proc/stat, or one it cannot read) it gives None.

        load = OtherLoad()      # the first window starts here
        ...
        if (load.cores() or 0.0) >= 0.25: ...  # others keep a quarter core or more busy
    """

    def __init__(
        self,
        window_s: float = 0.5,
        stat: str | os.PathLike = "/proc/stat",
        cpus: Sequence[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        own_time: Callable[[], float] = time.process_time,
        first_window_s: float | None = None,
        siblings: Siblings | None = None,
    ) -> None:
        self.window_s, self.stat, self.clock, self.own_time = window_s, stat, clock, own_time
        self.siblings = siblings
        self.last_siblings = 0.0  # the cores this user's other processes of ours took in it
        # The first window may end sooner (a short job's first batch asks ~0.2 s in)
        self._length = window_s if first_window_s is None else first_window_s
        # As /proc/stat names them ("cpu0", ...): this process's affinity unless given.
        self.cpus = cpuinfo.affinity_names() if cpus is None else {f"cpu{c}" for c in cpus}
        self.last = None  # the cores of the last whole window
        self._lock = threading.Lock()  # decoding streams ask from their own threads
        self._begin = self._read()

    def _read(self) -> tuple | None:
        """(now, busy seconds of this process's CPUs, this process's CPU seconds, the siblings'
        CPU seconds by pid), or None."""
        busy = cpuinfo.busy_seconds(self.stat, self.cpus)
        if busy is None:
            return None
        ours = self.siblings.cpu_seconds() if self.siblings is not None else {}
        return (self.clock(), busy, self.own_time(), ours)

    @classmethod
    def since_start(cls, max_age_s: float = 10.0) -> OtherLoad:
        """An OtherLoad whose first window began when the package was imported (`cpuinfo.START`,
        a command's start) and may end now: `cores()` gives others' mean use of this process's
        CPUs since then. None from `cores()` where that is older than `max_age_s` (a server, a
        notebook: an old mean says little of now) or unknown."""
        load = cls(first_window_s=0.0)
        start = cpuinfo.START
        fresh = start is not None and time.monotonic() - start[0] <= max_age_s
        load._begin = (*start[:3], {}) if fresh and start[3] == load.cpus else None
        return load

    @classmethod
    def crowded_since_start(cls) -> bool:
        """Whether others kept at least CROWDED_CORES of this process's CPUs busy since the
        command started (`since_start`; False where that is not known): a model then loads,
        and a training run starts, on one thread."""
        return (cls.since_start().cores() or 0.0) >= CROWDED_CORES

    def spare_cpus(self, cores: int) -> int:
        """The CPUs read beyond a process's `cores` usable ones (a CPU quota below its
        affinity), whose load leaves those cores free (`room_left`); 0 where none are known."""
        return max(0, len(self.cpus) - cores) if self.cpus is not None else 0

    def cores(self) -> float | None:
        """The others' mean cores over the current window (or, until it is `window_s` long,
        the last whole one's; the first: `first_window_s`); None where this cannot be measured
        or no window has ended. `last_siblings`: the part of them that `siblings` took (the
        processes alive at both ends of the window; on any CPU)."""
        with self._lock:
            if self._begin is None or self.clock() - self._begin[0] < self._length:
                return self.last
            end = self._read()
            if end is None:
                return self.last
            seconds = end[0] - self._begin[0]
            others = (end[1] - self._begin[1]) - (end[2] - self._begin[2])
            self.last = max(0.0, others / seconds)
            ours = sum(
                t - self._begin[3][pid] for pid, t in end[3].items() if pid in self._begin[3]
            )
            self.last_siblings = max(0.0, ours / seconds)
            self._begin, self._length = end, self.window_s
            return self.last


class Siblings:
    """This user's other processes of the package on this machine, and their CPU time.

    Not in the paper. Two jobs of ours side by side on 2 cores (a sweep's two trainings, a
    training and a translation) crowd each other as any busy process would, but the helper
    that wins beside a stranger's process (gradhelper.py) does so by taking part of that
    process's CPU: between two jobs of ours it only moves CPU from one to the other, and loses
    some on the way: two quickstart trainings started together took 114-142 s (the helper, and
    probes of two threads), 102-108 with one thread each, now 99-103 (docs/performance.md,
    "Round sixty"). So a process that sets its threads
    (`resolve`) leaves a file, named by its pid and holding its start time, in a directory of
    the temporary directory that only this user may write (`join`); a tuner's reading of
    others' load tells ours from strangers' by them (`OtherLoad.last_siblings`). A process
    that ended without removing its file (killed) is found out by its pid's start time, and
    its file removed by the next reader. Where the directory cannot be made, or is not this
    user's alone, nothing is written and none are found: every process a stranger, as before.
    """

    def __init__(self, directory: str | os.PathLike | None = None, proc: str = "/proc") -> None:
        self.dir: Path | None = Path(directory) if directory is not None else None
        if self.dir is None and hasattr(os, "getuid"):
            try:
                self.dir = Path(tempfile.gettempdir()) / f"transformer-{os.getuid()}-processes"
            except OSError:  # "No usable temporary directory found": none of ours are found
                self.dir = None
        self.proc = Path(proc)
        self.pid = os.getpid()

    def _started(self, pid: int) -> tuple[str, float] | None:
        """(start time in clock ticks since boot, CPU seconds) of process `pid`, or None."""
        try:
            with open(self.proc / str(pid) / "stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # past "pid (comm)": comm may hold ")"
            cpu = (int(fields[11]) + int(fields[12])) / cpuinfo.clock_ticks()  # utime + stime
            return fields[19], cpu  # starttime
        except (OSError, IndexError, ValueError):
            return None

    def _usable(self) -> bool:
        """Whether the directory is there (made if not), a directory and this user's alone."""
        if self.dir is None:
            return False
        try:
            self.dir.mkdir(mode=0o700, exist_ok=True)
            st = os.lstat(self.dir)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022

    def join(self) -> bool:
        """Leave this process's file (removed at exit); whether it could."""
        mine = self._started(self.pid)
        if mine is None or not self._usable():
            return False
        path = self.dir / str(self.pid)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(path, flags, 0o600)
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(mine[0])
        except OSError as e:
            logger.debug("threads: cannot leave %s (%s)", path, e)
            return False
        pid = self.pid

        def leave() -> None:
            if os.getpid() == pid:  # not a forked child's exit
                with contextlib.suppress(OSError):  # gone, or its folder's rights changed
                    path.unlink(missing_ok=True)

        atexit.register(leave)
        return True

    def cpu_seconds(self) -> dict[int, float]:
        """The CPU seconds of each live sibling by pid (this process not among them)."""
        found: dict[int, float] = {}
        if self.dir is None:
            return found
        try:
            names = os.listdir(self.dir)
        except OSError:
            return found
        for name in names:
            if not name.isdigit() or int(name) == self.pid:
                continue
            path = self.dir / name
            try:
                said = path.read_text(encoding="ascii").strip()
            except (OSError, ValueError):
                continue
            now = self._started(int(name))
            if now is None or now[0] != said:  # ended (or its pid taken by another since)
                if said:  # not one that is being written
                    with contextlib.suppress(OSError):
                        path.unlink(missing_ok=True)
                continue
            found[int(name)] = now[1]
        return found


_siblings: Siblings | None = None


def siblings() -> Siblings:
    """This process's `Siblings`, joined at the first call."""
    global _siblings
    if _siblings is None:
        _siblings = Siblings()
        _siblings.join()
    return _siblings


def room_left(others: float | None, cores: int, spare_cpus: int = 0) -> float | None:
    """The cores others leave a process of `cores` usable cores while they crowd them: None
    where they keep fewer than CROWDED_CORES busy, or unknown (`others`: `OtherLoad.cores`).
    `spare_cpus`: CPUs of the affinity beyond the usable cores (a CPU quota), whose load leaves
    this process's cores free (64 CPUs, a quota of 2: crowded once others keep 62.25 busy)."""
    if others is None or others < CROWDED_CORES + spare_cpus:
        return None
    return cores + spare_cpus - others


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity, and its CPU quota where a control
    group sets one (`cpuinfo.usable_cores`)."""
    return cpuinfo.usable_cores()


def _say_usable(usable: int) -> None:
    """Log once per process where the usable cores are fewer than the machine's, and why."""
    global _said_usable
    machine = os.cpu_count() or 1
    if usable >= machine or _said_usable:
        return
    _said_usable = True
    quota = cpuinfo.cpu_quota()
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    if quota is not None and usable < affinity:
        why = f"a CPU quota of {quota:g} CPU{'s' if quota != 1 else ''}"
    else:
        why = f"a CPU affinity of {affinity} CPU{'s' if affinity != 1 else ''}"
    logger.info("threads auto: %d of the machine's %d cores usable (%s)", usable, machine, why)


_said_usable = False


def warn_if_oversubscribed(threads: int) -> None:
    """A fixed count above the usable cores is allowed (a test of a larger machine's setting)
    but slow: the threads take turns on the cores and wait for each other at every op (300
    Multi30k lines, quickstart model, 2 Zen 5 cores: 2.6 s with 2 threads, 3.4 s with 8, 4.7 s
    with 32); said once per process."""
    global _warned_over
    cores = usable_cores()
    if threads > cores and not _warned_over:
        _warned_over = True
        logger.warning(
            "--threads %d on %d usable core(s): the threads will take turns on the cores and "
            "run more slowly than %d would", threads, cores, cores,
        )  # fmt: skip


_warned_over = False


def omp_threads_fixed() -> bool:
    """Whether the user fixed the thread count with OMP_NUM_THREADS: a positive count, or
    OpenMP's list of them ("2,1"). Anything else (empty, "0", "abc") OpenMP and torch ignore,
    so auto tunes as if it were unset (said once, in a warning)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return False
    first = value.split(",")[0].strip()
    if first.isdigit() and int(first) > 0:
        return True
    global _warned_omp
    if not _warned_omp:
        _warned_omp = True
        logger.warning(
            "OMP_NUM_THREADS=%r is not a thread count: ignored, as OpenMP and torch ignore "
            "it; the thread count is tuned (--threads N fixes it)", value,
        )  # fmt: skip
    return False


_warned_omp = False


def resolve(threads: int | str | None, **tuner: int | float) -> ThreadTuner | None:
    """A `--threads` value -> the tuner to use (None: a fixed count, set here, or none at all).

    An int fixes the count; AUTO tunes it (`tuner`: ThreadTuner's keyword arguments), unless
    the user fixed it with OMP_NUM_THREADS (which torch read at start); None leaves torch as it
    is.
    """
    if threads is None:
        return None
    siblings()  # this process sets its threads: others of ours tell it from a stranger's
    if threads == AUTO:
        if omp_threads_fixed():
            return None
        found = ThreadTuner.for_this_machine(**tuner)
        if torch.get_num_threads() > found.candidates[0]:
            # torch counts the CPUs of the affinity, not a CPU quota: what runs outside the
            # tuned units (a model's loading, the encoder) keeps to the usable cores too.
            torch.set_num_threads(found.candidates[0])
        return found
    problem = cpuinfo.count_problem(int(threads))
    if problem is not None:
        from transformer.errors import UserError

        raise UserError(f"--threads: {problem}")
    warn_if_oversubscribed(int(threads))
    torch.set_num_threads(int(threads))
    return None
