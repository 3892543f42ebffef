"""run.keep_freed_memory (esbatch/train/memory.py): with it, glibc serves blocks under 1 GiB from its heap and keeps
them there when they are freed; without it, a block over its mmap threshold is mapped and unmapped, and the heap's
top is trimmed. Read from glibc's own books (mallinfo2) in a fresh process per case, so the test process's allocator
is never changed. Where a run applies it: tests/unit/test_keep_freed_memory.py."""

import subprocess
import sys

import pytest

GiB = 1 << 30  # the threshold the help text and docs name

MiB = 1 << 20

# prints, against before the malloc: the bytes mapped (hblkhd) and the bytes in use in the heap (uordblks) while the
# block is held, the bytes still mapped after it is freed, and the heap's size (arena) after the free against while it
# was held (negative: trimmed). Not the heap's growth: a heap with free space at its top (what the imports before it
# left, which differs with the machine and whether modules were compiled) grows by less than the block.
PROBE = """
import ctypes, sys
from esbatch.train.memory import keep_freed_memory
names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in names]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "keep":
    assert keep_freed_memory() is None
before = libc.mallinfo2()
p = libc.malloc(int(sys.argv[2]))
assert p
held = libc.mallinfo2()
libc.free(p)
after = libc.mallinfo2()
print(held.hblkhd - before.hblkhd, held.uordblks - before.uordblks, after.hblkhd - before.hblkhd,
      after.arena - held.arena)
"""


def probe(mode: str, size: int) -> tuple[int, int, int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode, str(size)], capture_output=True, text=True, check=True)
    mapped, in_heap, mapped_after, heap_change = map(int, out.stdout.split())
    return mapped, in_heap, mapped_after, heap_change


def test_by_default_a_large_block_is_mapped_and_gone_when_freed():
    mapped, in_heap, mapped_after, _ = probe("default", 64 * MiB)
    assert mapped >= 64 * MiB and in_heap < 64 * MiB and mapped_after == 0


def test_kept_a_large_block_comes_from_the_heap_and_stays_there_when_freed():
    mapped, in_heap, mapped_after, heap_change = probe("keep", 64 * MiB)
    assert mapped == mapped_after == 0 and in_heap >= 64 * MiB and heap_change == 0  # not trimmed: reused next step


@pytest.mark.parametrize(
    ("size", "in_heap"),
    [(GiB - 64 * 1024, True), (GiB, False)],  # a chunk is the request and its header
    ids=["just-under-1GiB", "1GiB"],
)
def test_kept_blocks_of_1GiB_and_over_are_still_mapped(size, in_heap):
    """Untouched pages: a GiB of address space, no memory."""
    mapped, used, _, _ = probe("keep", size)
    assert (mapped == 0 and used >= size) if in_heap else (mapped >= size and used < size)
