"""The engine's scheduler, without a model: each prompt prefilled once (its other samples copy its KV), prefills
packed into the token buckets, running rows kept in the lowest slots, and every decode step covering every running
row."""

from rollout.scheduler import Request, Scheduler, pack_prefills


def test_scheduler_prefills_each_prompt_once_and_packs_buckets():
    a, b = [1, 2, 3, 4], [5, 6]
    sched = Scheduler(3)
    sched.add([Request(0, j, a, j) for j in range(4)] + [Request(1, 0, b, 9)])
    first = sched.admit()  # 3 slots: a's leader + 2 copies
    assert first.slots == [0, 1, 2] and first.prefill == [(0, a)] and first.copies == [(0, 1), (0, 2)]
    sched.release(1)
    second = sched.admit()  # a's 4th sample copies from a running sibling
    assert second.slots == [1] and second.prefill == [] and len(second.copies) == 1
    assert second.copies[0][0] in (0, 2) and second.copies[0][1] == 1
    assert sched.extent() == 3
    for s in (0, 1, 2):
        sched.release(s)
    third = sched.admit()
    assert third.slots == [0] and third.prefill == [(0, b)] and not sched.waiting
    batches = pack_prefills([(0, a[:-1]), (2, b[:-1]), (1, [7] * 7)], (4, 8), num_slots=3)
    assert [bt.tokens.size for bt in batches] == [4, 8]  # 3 + 1 tokens fill bucket 4; 7 tokens go to bucket 8
    first_batch = batches[0]
    assert first_batch.tokens.tolist() == [1, 2, 3, 5] and first_batch.positions.tolist() == [0, 1, 2, 0]
    assert first_batch.segments.tolist() == [0, 0, 0, 1] and first_batch.slots.tolist() == [0, 0, 0, 2]
    assert batches[1].slots.tolist() == [1] * 7 + [3]  # padding targets slot 3 == num_slots: dropped


def test_scheduler_admits_into_the_lowest_free_slots_whatever_the_release_order():
    """Slots released out of order (3, 0, 2) are taken again lowest first: running rows stay packed at the low slots,
    so the decode bucket stays small."""
    sched = Scheduler(4)
    sched.add([Request(p, 0, [p + 1, 2], p) for p in range(6)])
    assert sched.admit().slots == [0, 1, 2, 3]
    for slot in (3, 0, 2):
        sched.release(slot)
    assert sched.admit().slots == [0, 2]
    assert sched.extent() == 3


def test_scheduler_extent_covers_the_highest_running_slot_past_free_ones():
    """With slots 0 and 1 freed and slot 2 still running (a wave's last sample, nothing waiting), a decode step must
    cover 3 rows, not the 1 that runs: a smaller bucket would never decode slot 2 again, and generate would not end."""
    sched = Scheduler(3)
    sched.add([Request(0, j, [1, 2, 3], j) for j in range(3)])
    assert sched.admit().slots == [0, 1, 2]
    sched.release(0)
    sched.release(1)
    assert not sched.waiting and list(sched.running) == [2]
    assert sched.extent() == 3


def test_prefills_that_exactly_fill_the_largest_bucket_share_one_call():
    """3 + 5 tokens fill bucket 8 exactly: one prefill call, not two."""
    (batch,) = pack_prefills([(0, [1, 2, 3]), (1, [4, 5, 6, 7, 8])], (4, 8), num_slots=2)
    assert batch.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert batch.slots.tolist() == [0] * 3 + [1] * 5 and batch.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
