"""distributed.run_local: a job of N processes on this machine (`train --procs N`), forked from
a server that has imported torch once."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from transformer import distributed
from transformer.errors import JobError, UserError


def _sum_of_ranks(scale: float) -> tuple[int, float]:
    """Each rank contributes its rank; every rank sees the sum."""
    info = distributed.init_from_env(torch.device("cpu"))
    t = torch.tensor([float(info.rank) * scale])
    distributed.all_reduce_sum([t], info)
    return info.world_size, float(t)


def _rank1_user_error() -> None:
    if int(os.environ["RANK"]) == 1:
        raise UserError("data.txt line 3: bad pair")
    dist.barrier()  # rank 0 would wait here for ever: run_local must stop it


def _rank0_bug() -> None:
    if int(os.environ["RANK"]) == 0:
        raise KeyError("not a user error")
    dist.barrier()


def _rank1_killed() -> None:
    if int(os.environ["RANK"]) == 1:
        os._exit(9)
    dist.barrier()


def _broadcast_then_backward() -> tuple[bool, list[str]]:
    """Each rank starts from its own weights; after broadcast_parameters all hold rank 0's and
    a backward step through them warns of nothing."""
    info = distributed.init_from_env(torch.device("cpu"))
    torch.manual_seed(info.rank)
    layer = torch.nn.Linear(4, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distributed.broadcast_parameters(list(layer.parameters()), info)
        layer(torch.ones(2, 4)).sum().backward()
    torch.manual_seed(0)
    same = all(
        torch.equal(a, b)
        for a, b in zip(layer.parameters(), torch.nn.Linear(4, 3).parameters(), strict=True)
    )
    flags = torch.tensor([float(same)])
    distributed.all_reduce_sum([flags], info)
    return int(flags) == info.world_size, [str(w.message) for w in caught]


def test_every_rank_joins_and_rank_0_returns():
    assert distributed.run_local(2, _sum_of_ranks, (10.0,)) == (2, 10.0)


def _where_and_what(name: str) -> tuple[int, str | None, str]:
    """A rank's parent, the variable `name` in its environment, and its folder."""
    return os.getppid(), os.environ.get(name), os.getcwd()


def test_ranks_fork_from_one_server_and_run_in_the_environment_of_each_call(tmp_path, monkeypatch):
    """The forkserver started by the first job is kept for the next (torch is imported once
    per process, not once per rank), while each job's ranks see the environment and folder
    of its own call, not those of the call that started the server."""
    name = "TRANSFORMER_TEST_JOB"
    monkeypatch.setenv(name, "first")
    first = distributed.run_local(2, _where_and_what, (name,))
    monkeypatch.setenv(name, "second")
    monkeypatch.chdir(tmp_path)
    second = distributed.run_local(2, _where_and_what, (name,))
    assert first[0] == second[0] != os.getpid()  # one server, not this process
    assert (first[1], second[1]) == ("first", "second")
    assert second[2] == str(tmp_path)


def test_a_user_error_in_one_rank_stops_the_job_with_its_message():
    with pytest.raises(UserError, match="data.txt line 3: bad pair"):
        distributed.run_local(2, _rank1_user_error)


def test_a_bug_carries_the_rank_and_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)process 0 of 2 failed.*KeyError"):
        distributed.run_local(2, _rank0_bug)


def test_a_rank_that_dies_without_a_word_is_reported():
    with pytest.raises(JobError, match="process 1 of 2 exited with code 9 and no report"):
        distributed.run_local(2, _rank1_killed)


def _rank1_signalled(signum: int) -> None:
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signum)
    dist.barrier()


def test_a_rank_killed_by_a_signal_is_named_in_one_message():
    """The out-of-memory killer's SIGKILL (or anyone's kill) is a JobError, which the CLI
    prints as one line: not a RuntimeError with run_local's own traceback."""
    with pytest.raises(JobError, match=r"process 1 of 2 was killed by SIGKILL \(the kernel's "
                       "out-of-memory killer sends it"):  # fmt: skip
        distributed.run_local(2, _rank1_signalled, (signal.SIGKILL,))
    with pytest.raises(JobError, match=r"process 1 of 2 was killed by SIGTERM$"):
        distributed.run_local(2, _rank1_signalled, (signal.SIGTERM,))
    assert distributed._how_it_ended(-99) == "was killed by signal 99"


def test_a_stopped_rank_0_leaves_no_semaphore_and_ends_its_line(tmp_path):
    """Rank 0 drawing its progress bar when rank 1 is killed: run_local stops it (SIGTERM).
    Its tqdm lock once was a named semaphore, so the resource tracker warned of a "leaked
    semaphore" under the error; and the bar's last line ran into the error's."""
    import subprocess
    import sys

    code = (
        f"import sys; sys.path[:0] = {sys.path!r}\n"
        "from test_distributed import _bar_then_killed\n"
        "from transformer import distributed\n"
        "from transformer.errors import JobError\n"
        "try:\n"
        "    distributed.run_local(2, _bar_then_killed)\n"
        "except JobError as e:\n"
        "    print('error:', e, file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "\nerror: process 1 of 2 was killed by SIGKILL" in done.stderr, done.stderr
    assert "leaked semaphore" not in done.stderr


def _bar_then_killed() -> None:
    import time

    from tqdm import tqdm

    if int(os.environ["RANK"]) == 0:
        bar = tqdm(total=10)
        bar.update(1)  # drawn, its line not ended
        while True:
            time.sleep(0.1)
    time.sleep(2)
    os.kill(os.getpid(), signal.SIGKILL)


def test_parameters_broadcast_outside_autograd():
    """The broadcast of the initial weights is not part of any gradient's history (it once
    was: every rank's first backward warned "an autograd kernel was not registered")."""
    same, caught = distributed.run_local(2, _broadcast_then_backward)
    assert same
    assert caught == []


def test_at_least_one_process():
    with pytest.raises(UserError, match="--procs: must be at least 1"):
        distributed.run_local(0, _sum_of_ranks, (1.0,))


def test_train_procs_refuses_a_gpu_and_a_torchrun_job(tmp_path, monkeypatch):
    """train.procs starts its own processes on this CPU; it names the conflict otherwise."""
    from transformer.config import build_config
    from transformer.train import train

    config = build_config("tiny", overrides=["train.procs=2"], vocab_size=100)
    with pytest.raises(UserError, match=r"train.procs=2 is for CPU training \(device cuda"):
        train(tmp_path / "data", tmp_path / "run", config, device="cuda")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="already one rank of a torchrun job"):
        train(tmp_path / "data", tmp_path / "run", config, device="cpu")
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_more_processes_than_cores_trains_with_a_warning(tmp_path, monkeypatch, caplog):
    """train.procs beyond the cores is allowed (the processes take turns), and said."""
    import transformer.train as train_module
    from transformer.config import build_config

    config = build_config("tiny", overrides=["train.procs=3"], vocab_size=100)
    started = []
    monkeypatch.setattr(train_module, "resolve_run", lambda d, o, c, r, ov: (d, c))
    monkeypatch.setattr(distributed, "run_local", lambda n, fn, args: started.append(n))
    monkeypatch.setattr(train_module, "load_prepared", lambda d: None)  # no corpus here
    monkeypatch.setattr(train_module, "_check_lengths", lambda data, c: None)
    for cores, warned in ((2, True), (3, False)):
        monkeypatch.setattr(train_module, "_usable_cores", lambda cores=cores: cores)
        caplog.clear()
        train_module.train(tmp_path / "data", tmp_path / "run", config, device="cpu")
        assert ("train.procs=3 x 1 thread(s) on 2 core(s)" in caplog.text) is warned
    assert started == [3, 3]


def _train_forever(marker: str) -> None:
    import time
    from pathlib import Path

    Path(marker, str(os.getpid())).write_text("")
    while True:
        time.sleep(0.1)


def test_ranks_end_when_their_parent_is_killed(tmp_path):
    """`kill -9` of `transformer train --procs 2` must not leave its ranks training on."""
    import signal
    import subprocess
    import sys
    import time

    code = (
        f"import sys; sys.path[:0] = {sys.path!r}\n"
        "from test_distributed import _train_forever\n"
        "from transformer import distributed\n"
        f"distributed.run_local(2, _train_forever, ({str(tmp_path)!r},))\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=os.path.dirname(__file__))
    deadline = time.monotonic() + 60
    while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    ranks = [int(p.name) for p in tmp_path.iterdir()]
    assert len(ranks) == 2
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    alive = ranks
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [pid for pid in ranks if _running(pid)]
    assert not alive


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _rank0_disk_full(path: str) -> None:
    import errno

    if int(os.environ["RANK"]) == 0:
        raise OSError(errno.ENOSPC, "No space left on device", path)
    dist.barrier()


def test_an_os_error_comes_back_as_one(tmp_path):
    """The CLI prints an OSError (a full disk) as one line: a rank's arrives as an OSError."""
    target = str(tmp_path / "ckpt.pt")
    with pytest.raises(OSError, match="No space left on device") as err:
        distributed.run_local(2, _rank0_disk_full, (target,))
    assert err.value.filename == target and err.value.errno == 28


def _ok_then_abort(x: float) -> float:
    atexit.register(os.abort)  # the process aborts after its "ok" is sent, as gloo's teardown can
    return x


def test_a_rank_that_aborts_after_reporting_ok_does_not_fail_the_job():
    assert distributed.run_local(2, _ok_then_abort, (3.0,)) == 3.0


class _LateListener(dist.Store):
    """A rank's store, which keeps the peer's address from the rank that is to wait for the
    peer's connection until the peer has left the job (or for 1 s). Each rank publishes its
    address, and gloo has the one with the higher port connect to the other: that one has joined
    as soon as its connection is written, before the other has taken it, and with nothing to
    send it could leave while the other was still joining."""

    def __init__(self, store: dist.Store, peer_pid: int) -> None:
        super().__init__()
        self.store, self.peer_pid, self.mine = store, peer_pid, b""

    def set(self, key: str, value: bytes) -> None:
        self.mine = value  # this rank's address, the only key gloo sets
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.store.get(key)
        if self.mine and _port(self.mine) < _port(value):
            deadline = time.monotonic() + 1
            while _running(self.peer_pid) and time.monotonic() < deadline:
                time.sleep(0.02)
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.store.wait(keys)
        else:
            self.store.wait(keys, timeout)


def _port(address: bytes) -> int:
    """The port in gloo's record of a rank's address (the hostname's length and name, the
    address's length, then a sockaddr: family, port), read as gloo compares two ports: as
    native integers, not in network byte order."""
    name = int.from_bytes(address[:8], sys.byteorder)
    return int.from_bytes(address[name + 18 : name + 20], sys.byteorder)


def _join_late_if_listening() -> None:
    """Run in each rank as its arguments are unpickled, before it joins the job: the rank
    joins through a _LateListener, and fails if its peer left the job before it had joined."""
    join = dist.init_process_group

    def init_process_group(backend: str, init_method: str, rank: int, world_size: int) -> None:
        store, _, _ = next(dist.rendezvous(init_method, rank, world_size))
        store.set(f"pid{rank}", str(os.getpid()))
        peer_pid = int(store.get(f"pid{1 - rank}"))
        join(backend, store=_LateListener(store, peer_pid), rank=rank, world_size=world_size)
        if not _running(peer_pid):
            raise AssertionError(f"process {1 - rank} left the job before process {rank} joined")

    dist.init_process_group = init_process_group


class _JoinsLateIfListening:
    """An argument for `run_local`: unpickled, it is None, and it has run
    _join_late_if_listening in the rank."""

    def __reduce__(self):
        return (_join_late_if_listening, ())


def _nothing(_: None) -> None:
    pass


def test_no_rank_leaves_the_job_before_every_rank_has_joined_it():
    """A rank whose function sends nothing does not leave before its peer has joined, however
    long the peer takes to connect (_LateListener). It did, and in one CI run the peer's joining
    failed ("Gloo connectFullMesh failed with ... Connection closed by peer", in
    test_a_rank_that_aborts_after_reporting_ok_...); here, without the barrier that waits for
    every rank, the peer either fails so or joins after the rank has left."""
    assert distributed.run_local(2, _nothing, (_JoinsLateIfListening(),)) is None


def test_train_says_what_a_killed_job_kept(tmp_path, monkeypatch, capsys):
    """`train --procs 2` whose rank was killed: one line that names the process, the signal
    and what the run directory holds for --resume (nothing yet, or its last checkpoint)."""
    import transformer.train as train_module
    from transformer import checkpoint
    from transformer.cli import main
    from transformer.config import build_config

    def killed(n, fn, args):
        raise JobError(f"process 1 of {n} {distributed._how_it_ended(-9)}")

    config = build_config("tiny", overrides=["train.procs=2"], vocab_size=100)
    monkeypatch.setattr(train_module, "resolve_run", lambda d, o, c, r, ov: (d, c))
    monkeypatch.setattr(distributed, "run_local", killed)
    monkeypatch.setattr(train_module, "load_prepared", lambda d: None)  # no corpus here
    monkeypatch.setattr(train_module, "_check_lengths", lambda data, c: None)
    run = tmp_path / "run"
    with pytest.raises(JobError, match=f"train.procs=2: process 1 of 2 was killed by SIGKILL "
                       rf"\(.*\); {run} holds no checkpoint yet$"):  # fmt: skip
        train_module.train(tmp_path / "data", run, config, device="cpu")
    checkpoint.save_checkpoint(run, 40, {"step": 40}, keep_last=2)
    with pytest.raises(JobError, match=rf"; {run} keeps its last checkpoint, ckpt_40.pt, for a "
                       "resume$"):  # fmt: skip
        train_module.train(tmp_path / "data", run, config, device="cpu")
    # the CLI: the message in one line, no traceback
    monkeypatch.setattr(train_module, "train", lambda *a, **k: killed(2, None, None))
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("transformer train: error: process 1 of 2 was killed by SIGKILL")
    assert err.count("\n") == 1 and "Traceback" not in err


def _rank1_out_of_memory() -> None:
    if int(os.environ["RANK"]) == 1:
        torch.empty(2**62, dtype=torch.uint8)  # torch's RuntimeError: can't allocate memory
    dist.barrier()


def test_a_rank_out_of_memory_is_one_message_not_a_traceback():
    with pytest.raises(JobError, match=r"^process 1 of 2 ran out of memory \(\d+\.\d MiB asked "
                       r"for\): smaller batches or fewer processes need less$"):  # fmt: skip
        distributed.run_local(2, _rank1_out_of_memory)


def test_train_out_of_memory_is_one_line_with_what_the_run_kept(
    tmp_path, monkeypatch, capsys, allocation_failures
):
    """One process out of memory (ulimit -v, a cgroup's limit): the CLI's one line says so,
    with the batch size to lower and the run's checkpoint; any other RuntimeError stays a bug
    with its traceback."""
    import transformer.train as train_module
    from transformer.cli import main
    from transformer.config import build_config

    def job(*args):
        raise allocation_failures["torch"]  # torch.empty(2**62)'s, from a child process

    run = tmp_path / "run"
    config = build_config("tiny", overrides=["train.max_tokens=1234"], vocab_size=100)
    monkeypatch.setattr(train_module, "resolve_run", lambda d, o, c, r, ov: (d, config))
    monkeypatch.setattr(train_module, "_train_job", job)
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert err == (f"transformer train: error: out of memory ({2**62 / 2**20:.1f} MiB asked for): "
                   f"a smaller train.max_tokens (now 1234) needs less; {run} holds no checkpoint "
                   "yet\n")  # fmt: skip

    def bug(*args):
        raise RuntimeError("not memory")

    monkeypatch.setattr(train_module, "_train_job", bug)
    with pytest.raises(RuntimeError, match="not memory"):
        main(["train", "--resume", str(run)])


def test_ctrl_c_while_the_ranks_start_stops_the_started_ones(monkeypatch):
    """Ctrl-C between two ranks' starts: KeyboardInterrupt (the CLI's one line), the started
    rank stopped, not an AssertionError from joining the rank that never started."""
    import multiprocessing.context

    started = []
    start = multiprocessing.context.ForkServerProcess.start

    def start_one_then_interrupt(self):
        if started:
            raise KeyboardInterrupt
        start(self)
        started.append(self)

    monkeypatch.setattr(multiprocessing.context.ForkServerProcess, "start",
                        start_one_then_interrupt)  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        distributed.run_local(2, _sum_of_ranks, (1.0,))
    assert len(started) == 1 and started[0].exitcode is not None  # stopped and joined


def _interrupted_if_rank_1(wait: float = 5.0) -> int:
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, to this rank alone
        time.sleep(wait)
    return int(os.environ["RANK"])


def _with_ctrl_c(handler, fn, *args):
    """fn(*args) with this process's Ctrl-C handler set to `handler`, as it was after: the job's
    process takes Ctrl-C, or ignores it, whatever the suite's own start left it (a shell
    without job control starts a background command with Ctrl-C ignored, and Python keeps
    that)."""
    previous = signal.signal(signal.SIGINT, handler)
    try:
        return fn(*args)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_rank_takes_ctrl_c_though_its_server_ignores_it():
    """The server starts with Ctrl-C ignored (rankserver.start); a rank takes it again as the
    job's process does: KeyboardInterrupt, reported, the job interrupted."""
    with pytest.raises(KeyboardInterrupt):
        _with_ctrl_c(signal.default_int_handler, distributed.run_local, 2, _interrupted_if_rank_1)


def test_the_ranks_ignore_ctrl_c_where_the_jobs_process_does():
    """A job started with Ctrl-C ignored (`transformer train --procs 2 &` from a script): its
    ranks ignore it as well, and the job goes on."""
    job = (2, _interrupted_if_rank_1, (0.3,))
    try:  # (a KeyboardInterrupt let out of a test would stop the whole session)
        result = _with_ctrl_c(signal.SIG_IGN, distributed.run_local, *job)
    except KeyboardInterrupt:
        pytest.fail("a rank took the Ctrl-C that the job's process ignores")
    assert result == 0  # rank 0's
