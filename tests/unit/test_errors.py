"""errors.out_of_memory: the allocation failures the CLI prints as one line, from real errors."""

from __future__ import annotations

import pytest
import torch

from transformer.errors import JobError, UserError, out_of_memory


def test_real_allocation_failures_are_named_with_their_size(allocation_failures):
    torch_cpu = allocation_failures["torch"]  # torch.empty(2**62) in a child process
    assert out_of_memory(torch_cpu) == f"out of memory ({2**62 / 2**20:.1f} MiB asked for)"
    numpy_cpu = allocation_failures["numpy"]  # numpy.empty((10**7, 10**7)) likewise
    assert out_of_memory(numpy_cpu) == "out of memory (728. TiB asked for)"
    assert out_of_memory(MemoryError()) == "out of memory"


def test_the_other_shapes_of_an_allocation_that_failed():
    mmap = RuntimeError(
        "unable to mmap 45818616 bytes from file <m.safetensors>: Cannot allocate memory (12)"
    )  # torch.load's mmap under ulimit -v
    assert out_of_memory(mmap) == "out of memory (43.7 MiB asked for)"
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0)")
    assert out_of_memory(cuda) == "out of memory (2.00 GiB asked for)"
    thread = RuntimeError("can't start new thread")  # threading, under a memory limit
    assert out_of_memory(thread) == "out of memory or threads (a new thread could not start)"


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("shape mismatch"),
        ValueError("x"),
        UserError("can't allocate memory"),
        JobError("x"),
        OSError(12),
    ],
)
def test_anything_else_is_not_out_of_memory(error):
    assert out_of_memory(error) is None


def test_any_command_out_of_memory_is_one_line(monkeypatch, capsys, allocation_failures):
    """translate, evaluate, ... out of memory (a huge --beam under ulimit -v): the CLI's line,
    with what to lower; a thread that could not start names threads instead."""
    import transformer.experiments.table3 as table3
    from transformer.cli import main

    def no_memory(v):
        raise allocation_failures["torch"]

    monkeypatch.setattr(table3, "describe_presets", no_memory)
    assert main(["presets"]) == 2
    assert capsys.readouterr().err == (
        f"transformer presets: error: out of memory ({2**62 / 2**20:.1f} MiB asked for): "
        "smaller batches need less\n"
    )

    def no_thread(v):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(table3, "describe_presets", no_thread)
    assert main(["presets"]) == 2
    assert capsys.readouterr().err.endswith("fewer threads (--threads 1) need less\n")


def test_the_hint_names_the_commands_own_flags():
    from argparse import Namespace

    from transformer.cli import _needs_less

    memory = "out of memory (12.5 MiB asked for)"
    translate = Namespace(command="translate", max_tokens=None, beam=None)
    assert _needs_less(translate, memory) == "a smaller --max-tokens or --beam needs less"
    assert _needs_less(Namespace(beam=4), memory) == "a smaller --beam needs less"
    assert _needs_less(Namespace(), memory) == "smaller batches need less"
    thread = "out of memory or threads (a new thread could not start)"
    assert _needs_less(translate, thread) == "fewer threads (--threads 1) need less"
