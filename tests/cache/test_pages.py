"""Page allocator and the page placement layout (rotation included)."""

import numpy as np
import pytest

from cp_runtime.cache.layout import (global_page, global_page_jnp, local_page, local_page_jnp,
                                     local_page_table, local_page_table_jnp, owner_shard,
                                     owner_shard_jnp, pages_on_shard, rotated_row, shard_demand)
from cp_runtime.cache.pages import CapacityError, PageAllocator, PageTable


def table(rotation=0, *slots):
    return PageTable(rotation=rotation, slots=tuple(slots))


def test_placement_is_round_robin_from_the_rotation_with_exact_ids():
    alloc = PageAllocator(num_shards=2, pages_per_shard=3)
    t = alloc.grow(table(0), 5)          # pages 0,2,4 on shard 0; 1,3 on shard 1
    assert t.slots == (0, 0, 1, 1, 2)
    assert alloc.num_free(0) == 0 and alloc.num_free(1) == 1
    assert alloc.sentinel == 3
    assert alloc.new_table().rotation == 1          # the shard with the most free pages
    with pytest.raises(CapacityError):               # unrotated, page 0 lives on full shard 0
        alloc.grow(table(0), 1)
    assert alloc.grow(table(1), 1).slots == (2,)     # rotated to shard 1, it fits
    alloc.check_invariants()


def test_rotation_admits_a_one_page_session_per_free_page():
    """16 shards x 4 pages hold 64 one-page sessions (without rotation: 4)."""
    alloc = PageAllocator(num_shards=16, pages_per_shard=4)
    tables = [alloc.grow(alloc.new_table(), 1) for _ in range(64)]
    assert alloc.num_free() == 0
    assert sorted(t.rotation for t in tables) == sorted(list(range(16)) * 4)
    with pytest.raises(CapacityError):
        alloc.grow(alloc.new_table(), 1)
    alloc.check_invariants()


def test_capacity_error_is_atomic_and_names_counts():
    alloc = PageAllocator(num_shards=2, pages_per_shard=2)
    a = alloc.grow(table(0), 3)
    before = (alloc.num_free(0), alloc.num_free(1), alloc._refs.copy())
    with pytest.raises(CapacityError, match=r"requested 2 pages, 1 free") as err:
        alloc.grow(a, 5)
    assert err.value.requested == [1, 1] and err.value.free == [0, 1]
    assert (alloc.num_free(0), alloc.num_free(1)) == before[:2]
    assert (alloc._refs == before[2]).all()
    alloc.check_invariants()


def test_free_returns_lowest_ids_first_and_refuses_misuse_changing_nothing():
    alloc = PageAllocator(num_shards=1, pages_per_shard=4)
    a = alloc.grow(table(0), 2)
    b = alloc.grow(table(0), 2)
    assert (a.slots, b.slots) == ((0, 1), (2, 3))
    alloc.free(a)
    assert alloc.grow(table(0), 1).slots == (0,)
    refs = alloc._refs.copy()
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(table(0, 3, 1))                   # slot 1 is free: a double free
    with pytest.raises(ValueError, match="names a slot twice"):
        alloc.free(table(0, 2, 2))                   # one slot listed twice
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(table(0, 9))                      # not a slot at all
    assert (alloc._refs == refs).all()
    alloc.check_invariants()


def test_fork_shares_all_but_the_last_page_and_copies_it():
    alloc = PageAllocator(num_shards=2, pages_per_shard=4)
    parent = alloc.grow(table(1), 3)                 # pages on shards 1, 0, 1: slots 0, 0, 1
    assert parent.slots == (0, 0, 1)
    child, copy = alloc.fork(parent, num_tokens=40, page_size=16)   # 2.5 pages
    assert child.rotation == 1 and child.slots[:2] == parent.slots[:2]
    assert child.slots[2] != parent.slots[2]
    assert (copy.shard, copy.src, copy.dst) == (1, 1, child.slots[2])
    assert alloc.refcount(1, 0) == 2 and alloc.refcount(0, 0) == 2
    full, copy = alloc.fork(parent, num_tokens=48, page_size=16)    # a full last page too
    assert full.slots[:2] == parent.slots[:2] and full.slots[2] != parent.slots[2]
    assert copy.src == parent.slots[2]
    empty, none = alloc.fork(parent, num_tokens=0, page_size=16)
    assert empty.slots == () and none is None
    for t in (parent, child, full):
        alloc.free(t)
    assert alloc.num_free() == alloc.capacity
    alloc.check_invariants()


def test_random_operations_keep_invariant():
    rng = np.random.default_rng(0)
    alloc = PageAllocator(num_shards=4, pages_per_shard=8)
    tables: list[PageTable] = []
    for _ in range(500):
        op = rng.integers(4)
        try:
            if op == 0 or not tables:
                tables.append(alloc.grow(alloc.new_table(), int(rng.integers(1, 6))))
            elif op == 1:
                i = int(rng.integers(len(tables)))
                tables[i] = alloc.grow(tables[i], len(tables[i]) + int(rng.integers(1, 4)))
            elif op == 2:
                alloc.free(tables.pop(int(rng.integers(len(tables)))))
            else:
                i = int(rng.integers(len(tables)))
                n = len(tables[i]) * 16 - int(rng.integers(0, 16))
                tables.append(alloc.fork(tables[i], n, 16)[0])
        except CapacityError:
            pass
        alloc.check_invariants()
        assert alloc.num_free() + alloc.num_used() == alloc.capacity


@pytest.mark.parametrize("num_shards", [1, 3, 16])
def test_layout_twins_agree_and_biject(num_shards):
    pages = np.arange(200)
    for rotation in sorted({0, min(1, num_shards - 1), num_shards - 1}):   # r < S
        shard = owner_shard(pages, num_shards, rotation)
        local = local_page(pages, num_shards, rotation)
        assert (global_page(local, shard, num_shards, rotation) == pages).all()
        assert (np.asarray(owner_shard_jnp(pages, num_shards, rotation)) == shard).all()
        assert (np.asarray(local_page_jnp(pages, num_shards, rotation)) == local).all()
        assert (np.asarray(global_page_jnp(local, shard, num_shards, rotation)) == pages).all()
        assert len(set(zip(shard.tolist(), local.tolist()))) == len(pages)     # a bijection
        counts = [pages_on_shard(77, r, num_shards, rotation) for r in range(num_shards)]
        assert sum(counts) == 77
        assert counts == [int((shard[:77] == r).sum()) for r in range(num_shards)]
        assert sum(shard_demand(10, 77, num_shards, rotation)) == 67
        if num_shards == 1:
            assert (local == pages).all()
    table = np.arange(3 * num_shards * 5).reshape(3, num_shards * 5)
    split = local_page_table(table, num_shards)
    assert (split == np.asarray(local_page_table_jnp(table, num_shards))).all()
    for r in range(num_shards):
        for j in range(5):
            assert (split[r, :, j] == table[:, j * num_shards + r]).all()
    if num_shards == 1:
        assert (split[0] == table).all()


def test_rotated_row_places_page_i_at_i_plus_rotation():
    row = rotated_row([7, 8, 9], rotation=2, width=8, sentinel=99)
    assert row.tolist() == [99, 99, 7, 8, 9, 99, 99, 99]
    with pytest.raises(ValueError, match="do not fit"):
        rotated_row([1, 2, 3], rotation=6, width=8, sentinel=99)


def test_tables_take_hbm_slots_first_and_move_to_the_host_with_copies():
    """2 of 5 slots a shard in HBM: a table takes them first; `to_host` moves the HBM pages its
    tables alone hold, naming each copy, and `undo_to_host` takes that back."""
    alloc = PageAllocator(num_shards=2, pages_per_shard=5, device_pages=2)
    a = alloc.grow(table(0), 4)                        # pages 0, 2 on shard 0; 1, 3 on shard 1
    assert a.slots == (0, 0, 1, 1) and alloc.free_device_per_shard() == [0, 0]
    b = alloc.grow(table(0), 2)
    assert b.slots == (2, 2)                           # HBM full: host slots
    (moved,), copies = alloc.to_host([a])
    assert moved.slots == (3, 3, 4, 4)
    assert sorted((c.shard, c.src, c.dst) for c in copies) == [
        (0, 0, 3), (0, 1, 4), (1, 0, 3), (1, 1, 4)]
    assert alloc.free_device_per_shard() == [2, 2] and alloc.num_free() == 4
    alloc.check_invariants()
    alloc.undo_to_host(copies)
    assert alloc.free_device_per_shard() == [0, 0] and alloc.refcount(0, 3) == 0
    alloc.check_invariants()
    alloc.grow(table(0), 2)                            # one host slot a shard left
    with pytest.raises(CapacityError):                 # 2 pages a shard to move
        alloc.to_host([a])
    assert alloc.free_device_per_shard() == [0, 0] and alloc.num_free() == 2
    alloc.check_invariants()


def test_shared_hbm_pages_move_only_with_all_their_tables():
    alloc = PageAllocator(num_shards=1, pages_per_shard=8, device_pages=4)
    parent = alloc.grow(table(0), 3)
    child, copy = alloc.fork(parent, num_tokens=3 * 16, page_size=16)
    assert child.slots[:2] == parent.slots[:2] and copy.dst == child.slots[2] == 3
    (moved,), copies = alloc.to_host([parent])
    assert moved.slots[:2] == parent.slots[:2] and len(copies) == 1   # its own last page
    (parent2, child2), copies = alloc.to_host([moved, child])
    assert parent2.slots[:2] == child2.slots[:2] and min(parent2.slots + child2.slots) >= 4
    assert alloc.refcount(0, parent2.slots[0]) == 2 and len(copies) == 3
    alloc.check_invariants()


def test_unwritten_pages_move_into_free_hbm_slots_without_copies():
    alloc = PageAllocator(num_shards=1, pages_per_shard=6, device_pages=2)
    hog = alloc.grow(table(0), 2)
    t = alloc.grow(table(0), 3)
    assert t.slots == (2, 3, 4) and alloc.unwritten_on_host(t, first=1) == [2]
    alloc.free(hog)
    t = alloc.to_device(t, first=1)
    assert t.slots == (2, 0, 1) and alloc.unwritten_on_host(t, first=1) == [0]
    alloc.check_invariants()
