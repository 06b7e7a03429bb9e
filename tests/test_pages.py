"""Page allocator and the page placement layout."""

import numpy as np
import pytest

from cp_runtime.layout import (global_page, local_page, local_page_table, local_page_table_jnp,
                               owner_shard, pages_on_shard)
from cp_runtime.pages import CapacityError, PageAllocator


def test_placement_is_round_robin_with_exact_ids():
    alloc = PageAllocator(num_shards=2, pages_per_shard=3)
    table = alloc.grow([], 5)      # pages 0,2,4 on shard 0; 1,3 on shard 1
    assert table == [0, 0, 1, 1, 2]
    assert alloc.num_free(0) == 0 and alloc.num_free(1) == 1
    assert alloc.sentinel == 3
    with pytest.raises(CapacityError):  # every session's page 0 lives on shard 0, now full
        alloc.grow([], 1)
    alloc.check_invariants()


def test_capacity_error_is_atomic_and_names_counts():
    alloc = PageAllocator(num_shards=2, pages_per_shard=2)
    a = alloc.grow([], 3)
    before = (alloc.num_free(0), alloc.num_free(1), alloc._refs.copy())
    with pytest.raises(CapacityError, match=r"requested 2 pages, 1 free") as err:
        alloc.grow(a, 5)
    assert err.value.requested == [1, 1] and err.value.free == [0, 1]
    assert (alloc.num_free(0), alloc.num_free(1)) == before[:2]
    assert (alloc._refs == before[2]).all()
    alloc.check_invariants()


def test_free_returns_lowest_ids_first():
    alloc = PageAllocator(num_shards=1, pages_per_shard=4)
    a = alloc.grow([], 2)
    b = alloc.grow([], 2)
    assert (a, b) == ([0, 1], [2, 3])
    alloc.free(a)
    assert alloc.grow([], 1) == [0]
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([1, 1])
    alloc.check_invariants()


def test_fork_shares_full_pages_and_copies_partial():
    alloc = PageAllocator(num_shards=2, pages_per_shard=4)
    parent = alloc.grow([], 3)                 # [0, 0, 1]
    child, copy = alloc.fork(parent, num_tokens=40, page_size=16)   # 2.5 pages
    assert child[:2] == parent[:2] and child[2] != parent[2]
    assert (copy.shard, copy.src, copy.dst) == (0, 1, child[2])
    assert alloc.refcount(0, 0) == 2 and alloc.refcount(1, 0) == 2
    full, none = alloc.fork(parent, num_tokens=48, page_size=16)
    assert full == parent and none is None
    alloc.free(parent)
    alloc.free(child)
    alloc.free(full)
    assert alloc.num_free() == alloc.capacity
    alloc.check_invariants()


def test_random_operations_keep_invariant():
    rng = np.random.default_rng(0)
    alloc = PageAllocator(num_shards=4, pages_per_shard=8)
    tables: list[list[int]] = []
    for _ in range(500):
        op = rng.integers(4)
        try:
            if op == 0 or not tables:
                tables.append(alloc.grow([], int(rng.integers(1, 6))))
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
    shard, local = owner_shard(pages, num_shards), local_page(pages, num_shards)
    assert (global_page(local, shard, num_shards) == pages).all()
    assert sum(pages_on_shard(77, r, num_shards) for r in range(num_shards)) == 77
    for r in range(num_shards):
        assert pages_on_shard(77, r, num_shards) == int((owner_shard(np.arange(77),
                                                                     num_shards) == r).sum())
    table = np.arange(3 * num_shards * 5).reshape(3, num_shards * 5)
    split = local_page_table(table, num_shards)
    assert (split == np.asarray(local_page_table_jnp(table, num_shards))).all()
    for r in range(num_shards):
        for j in range(5):
            assert (split[r, :, j] == table[:, j * num_shards + r]).all()
    if num_shards == 1:
        assert (split[0] == table).all()
