"""Part-parallel checksums: writer (copy + hash) and reader (hash) agree, and any flipped byte is caught."""

import multiprocessing

import numpy as np
import pytest
import xxhash

from weight_sync.checksum import PART, checksum, checksums, copy_with_checksums

SIZES = [0, 1, PART - 1, PART, PART + 1, 2 * PART + 3]


def random_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_a_buffer_of_one_part_is_plain_xxh3():
    buf = random_bytes(PART)
    assert checksum(buf) == xxhash.xxh3_64_intdigest(buf.tobytes())
    assert checksum(b"manifest") == xxhash.xxh3_64_intdigest(b"manifest")


def test_copying_writer_and_reader_agree_and_the_copy_is_exact():
    srcs = [random_bytes(n, seed=n) for n in SIZES]
    dsts = [np.full(n, 7, np.uint8) for n in SIZES]
    hashed = copy_with_checksums([(d, s, i % 2 == 0) for i, (d, s) in enumerate(zip(dsts, srcs))])
    for i, (d, s) in enumerate(zip(dsts, srcs)):
        assert np.array_equal(d, s)
        assert hashed[i] == (checksum(s) if i % 2 == 0 else None)
    assert checksums(srcs) == [checksum(s) for s in srcs]


def test_typed_arrays_are_hashed_by_their_bytes():
    a = np.random.default_rng(1).standard_normal(PART // 2 + 5).astype(np.float32)  # two parts
    assert checksum(a) == checksum(a.view(np.uint8)) == checksum(a.tobytes())
    assert checksum(a[::2]) == checksum(np.ascontiguousarray(a[::2]))


@pytest.mark.parametrize("pos", [0, PART - 1, PART, PART + 1, 2 * PART + 2])
def test_any_flipped_byte_changes_a_multi_part_checksum(pos):
    buf = random_bytes(2 * PART + 3)
    before = checksum(buf)
    buf[pos] ^= 0x01
    assert checksum(buf) != before


def test_parts_are_not_interchangeable():
    """Swapping two parts changes the checksum: the part digests are combined in order."""
    buf = random_bytes(2 * PART)
    swapped = np.concatenate([buf[PART:], buf[:PART]])
    assert checksum(swapped) != checksum(buf)


def _child_checksum(queue):
    queue.put(checksum(random_bytes(2 * PART + 3)))


def test_a_forked_child_gets_its_own_thread_pool():
    """The parent's pool threads do not survive fork; a child that hashes must not wait on them forever."""
    expected = checksum(random_bytes(2 * PART + 3))  # creates the parent's pool
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_checksum, args=(queue,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0 and queue.get(timeout=5) == expected
