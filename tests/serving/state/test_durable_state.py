"""The state directory's formats and the journal's all-or-nothing writes, on real files: token
log records and their checksums, a store whose writes fail partway, an engine that changes
nothing when its journal refuses, and start-up over a directory with every kind of damage."""

import errno
import json

import numpy as np
import pytest

from conftest import make_engine, random_tokens
from cp_runtime.cache.pool import CacheRows
from cp_runtime.engine.requests import Extend, Generate, SamplingParams, StorageFailed, Token
from cp_runtime.serving.state import snapshots, token_log
from cp_runtime.serving.state.recovery import restore_sessions
from cp_runtime.serving.state.token_store import TokenStore, read_logs

A, B, C = "a" * 32, "b" * 32, "c" * 32


def test_log_records_round_trip_and_a_torn_or_damaged_record_ends_the_trusted_prefix():
    first, crc1 = token_log.encode_record([1, 2, 3], 0)
    second, crc2 = token_log.encode_record([4], crc1)
    raw = token_log.HEADER + first + second
    parsed = token_log.parse(raw)
    assert parsed.tokens.tolist() == [1, 2, 3, 4] and parsed.end == len(raw)
    assert (parsed.crc, parsed.torn, parsed.damage) == (crc2, 0, None)
    for cut in range(1, len(second)):                  # every way to cut the last record short
        torn = token_log.parse(raw[:-cut])
        assert torn.tokens.tolist() == [1, 2, 3] and torn.torn == len(second) - cut
    flipped = bytearray(raw)
    flipped[len(token_log.HEADER) + 9] ^= 0x10          # a bit of the first record's ids
    damaged = token_log.parse(bytes(flipped))
    assert damaged.tokens.size == 0 and "record 0" in damaged.damage
    # A record moved from another chain fails too: crcs chain from the previous record.
    assert token_log.parse(token_log.HEADER + second).damage is not None
    with pytest.raises(token_log.LogFormatError, match="header"):
        token_log.parse(b"\x01\x00\x00\x00" * 4)


class FailingWrites(TokenStore):
    """A store whose disk takes `room` more bytes, then fails writes with ENOSPC, having
    written part of the record (as a full disk does)."""

    room = 1 << 30

    def _write_at(self, path, data, offset):
        if len(data) > self.room:
            super()._write_at(path, data[: max(self.room, 0)], offset)
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        super()._write_at(path, data, offset)


def test_a_failed_commit_takes_back_every_record_it_wrote(tmp_path):
    store = FailingWrites(tmp_path, fsync="always")
    for sid in (A, B):
        store.create(sid)
    store.append({A: [1, 2], B: [3]})
    sizes = {sid: store.path(sid).stat().st_size for sid in (A, B)}
    store.room = 14                          # A's record (12 bytes) fits, B's does not
    with pytest.raises(StorageFailed, match="No space left"):
        store.append({A: [5], B: [6, 7]})
    assert {sid: store.path(sid).stat().st_size for sid in (A, B)} == sizes
    store.room = 1 << 30                     # space is back: the chain goes on unbroken
    store.append({A: [5], B: [6, 7]})
    assert read_logs(tmp_path) == {A: [1, 2, 5], B: [3, 6, 7]}
    store.room = 0
    with pytest.raises(StorageFailed):
        store.create(C)
    with pytest.raises(StorageFailed):
        store.fork(A, C, [1, 2, 5])
    assert not store.path(C).exists() and set(read_logs(tmp_path)) == {A, B}


def _engine_state(engine):
    return ({s.id: (list(s.tokens), s.kv_len, s.table) for s in engine.sessions.values()},
            engine.allocator.used_per_shard(), engine.scheduler.queued_tokens,
            len(engine.scheduler.work()))


@pytest.mark.slow     # over a minute on 2 cores
def test_an_engine_whose_journal_fails_changes_nothing_and_goes_on_once_it_works(
        tmp_path, tiny, tiny_params):
    store = FailingWrites(tmp_path, fsync="never")
    # One shard: the journal's rules do not depend on the shard count, and it compiles fastest.
    engine = make_engine(tiny, tiny_params, kv_cache_dtype="f32", num_shards=1,
                         pages_per_shard=16, chunk_size=32)
    engine.journal = store
    a, b = engine.create_session(), engine.create_session()
    engine.extend(a.id, random_tokens(tiny, 20, 0))
    before = _engine_state(engine)
    store.room = 0
    with pytest.raises(StorageFailed):
        engine.submit(Extend(id="x", session=b.id, tokens=np.asarray(random_tokens(tiny, 40, 1))))
    with pytest.raises(StorageFailed):
        engine.create_session()
    with pytest.raises(StorageFailed):
        engine.fork(a.id)
    assert _engine_state(engine) == before
    # A step whose sampled tokens cannot be stored ends its generation with `storage`, and the
    # prefill in the same step goes on (its tokens were stored when it was submitted).
    store.room = 1 << 30
    engine.submit(Extend(id="x", session=b.id, tokens=np.asarray(random_tokens(tiny, 40, 1))))
    engine.submit(Generate(id="g", session=a.id, sampling=SamplingParams(max_tokens=4)))
    store.room = 0
    events = engine.step()
    assert [(e.request, e.code) for e in events if hasattr(e, "code")] == [("g", "storage")]
    assert a.length == 20 and a.busy is None and b.kv_len == 32
    store.room = 1 << 30
    while engine.has_work:
        engine.step()
    engine.submit(Generate(id="g2", session=a.id, sampling=SamplingParams(max_tokens=3)))
    out = []
    while engine.has_work:
        out += [e.token for e in engine.step() if isinstance(e, Token)]
    assert read_logs(tmp_path) == {a.id: a.tokens, b.id: b.tokens}   # nothing twice
    assert a.tokens[20:] == out
    engine.allocator.check_invariants()


def _write_log(store, sid, pieces):
    """A format-2 log of `pieces` (lists of ids, one record each), checksummed."""
    data, crc = token_log.HEADER, 0
    for piece in pieces:
        record, crc = token_log.encode_record(piece, crc)
        data += record
    store.path(sid).write_bytes(data)
    return data


def test_start_up_repairs_reports_and_quarantines_and_never_stops(tmp_path, tiny, tiny_params,
                                                                caplog):
    store = TokenStore(tmp_path)
    good, torn, bad_ids, flipped, as_dir, old = ("%032x" % (0xabc0 + i) for i in range(6))
    _write_log(store, good, [[1, 2, 3], [4]])
    (store.path(torn)).write_bytes(_write_log(store, torn, [[5, 6]]) + b"\x07\x00\x00")
    _write_log(store, bad_ids, [[1, 2], [3, -1, 1000, 70000]])
    raw = bytearray(_write_log(store, flipped, [[1, 2], [3, 4]]))
    raw[-1] ^= 1
    store.path(flipped).write_bytes(bytes(raw))
    store.path(as_dir).mkdir()
    (store.dir / (old + ".tokens")).write_bytes(np.asarray([9, 8, 7], "<i4").tobytes() + b"\1")
    (store.dir / "README.tokens").write_text("notes")
    (store.dir / (good.upper() + ".log")).write_bytes(store.path(good).read_bytes())
    for leftover in (good + ".tmp-0badf00d", good + ".old-0badf00d", "e" * 32):
        (store.snapshots_dir / leftover).mkdir()
    engine = make_engine(tiny, tiny_params, kv_cache_dtype="f32", num_shards=4,
                         pages_per_shard=16, chunk_size=32)
    store = TokenStore(tmp_path)
    engine.journal = store
    restore_sessions(engine, store)
    got = {sid: s.tokens for sid, s in engine.sessions.items()}
    assert got == {good: [1, 2, 3, 4], torn: [5, 6], bad_ids: [1, 2, 3], flipped: [1, 2],
                   old: [9, 8, 7]}
    assert set(store.damaged) == {bad_ids, flipped}
    assert "-1 at position 3 is outside the vocabulary" in store.damaged[bad_ids]["reason"]
    assert "fails its checksum" in store.damaged[flipped]["reason"]
    assert [u["session"] for u in store.unrestored] == [as_dir]
    assert "not a regular file" in store.unrestored[0]["reason"]
    assert read_logs(tmp_path) == got                 # every repair is on disk
    assert not (store.dir / (old + ".tokens")).exists()          # migrated to format 2
    assert sorted(p.name for p in store.snapshots_dir.iterdir()) == []    # leftovers, orphan
    notes = [json.loads((d / "note.json").read_text()) for d in store.quarantine_dir.iterdir()]
    assert sorted(n["session"] for n in notes) == sorted([bad_ids, flipped, as_dir])
    assert "README.tokens: ignored" in caplog.text and good.upper() in caplog.text
    assert f"session {torn}: its token log ended in a record cut short (3 bytes" in caplog.text
    store.append({torn: [10]})                        # appends line up after the repair
    assert read_logs(tmp_path)[torn] == [5, 6, 10]


def _snapshot(store, sid, tokens, rng, *, cached=None, model="tiny", layers=(2, 1)):
    cached = len(tokens) if cached is None else cached
    rows = CacheRows(latent=rng.random((layers[0], cached, 4), np.float32),
                               indexer=rng.random((layers[1], cached, 3), np.float32))
    if sid not in store.live:
        store.create(sid)
    return store.write_snapshot(sid, tokens, rows, {"model": model, "kv_cache_dtype": "f32"})


def test_snapshots_are_verified_and_a_log_shorter_than_its_snapshot_is_rebuilt_from_it(
        tmp_path):
    rng = np.random.default_rng(0)
    store = TokenStore(tmp_path)
    d = _snapshot(store, A, [1, 2, 3], rng)
    snap = snapshots.read(d)
    assert snap.tokens.tolist() == [1, 2, 3] and snap.rows.latent.shape == (2, 3, 4)
    latent = np.load(d / "latent.npy")
    latent[1, 2, 3] += 1e-3                            # one value changed, file still valid
    np.save(d / "latent.npy", latent)
    with pytest.raises(snapshots.SnapshotError, match="latent.npy: its checksum"):
        snapshots.read(d)
    for name, content in (("meta.json", b""), ("meta.json", b"{garbage"),
                          ("indexer.npy", b"\0" * 200)):
        d = _snapshot(store, A, [1, 2, 3], rng)
        (d / name).write_bytes(content)
        with pytest.raises(snapshots.SnapshotError, match=name):
            snapshots.read(d)
    # A format-1 snapshot (no checksums) is upgraded in place.
    d = _snapshot(store, A, [1, 2, 3], rng)
    meta = json.loads((d / "meta.json").read_text())
    for key in ("crc32c", "latent_shape", "indexer_shape"):
        del meta[key]
    (d / "meta.json").write_text(json.dumps({**meta, "format": 1}))
    with pytest.raises(snapshots.SnapshotError, match="format 1"):
        snapshots.read(d)
    assert snapshots.read(d, upgrade=True).tokens.tolist() == [1, 2, 3]
    assert json.loads((d / "meta.json").read_text())["format"] == snapshots.FORMAT


def test_a_snapshot_of_a_session_closed_meanwhile_leaves_nothing(tmp_path):
    rng = np.random.default_rng(1)
    store = TokenStore(tmp_path)
    store.create(A)
    store.close(A)
    with pytest.raises(Exception, match="closed while its snapshot"):
        store.write_snapshot(A, [1], CacheRows(
            latent=rng.random((1, 1, 4), np.float32),
            indexer=rng.random((1, 1, 3), np.float32)), {})
    assert list(store.snapshots_dir.iterdir()) == []
