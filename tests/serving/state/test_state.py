"""Sessions that survive, against real server processes over real state directories: restart
after kill -9, every kind of damage to the directory, a full disk, recovery from a failed
step.

A state directory damaged the way disks and operators damage it, served by real server
processes: every session that can come back does, nothing that fails a check is served, no bad
file stops the server, and a full disk changes nothing. Each test starts its own servers over
its own directory, since restarting over the same directory is what is tested.
(The directory's formats on their own, without a server: test_durable_state.py.)"""

import asyncio
import contextlib
import errno
import json
import os
import subprocess
import time

import jax.numpy as jnp
import numpy as np
import pytest

import cp_runtime
from conftest import make_engine, random_tokens
from cp_runtime.engine.requests import Extend, Generate, SamplingParams, Token, Unavailable
from cp_runtime.model.oracle import oracle_logits
from cp_runtime.serving.state import token_log
from cp_runtime.serving.state.token_store import read_logs
from serving_helpers import start_server, stop_server


def greedy_continuation(params, cfg, tokens, n):
    """The oracle's greedy next n tokens after `tokens`."""
    out = list(tokens)
    for _ in range(n):
        logits = oracle_logits(params, jnp.asarray(out), cfg=cfg, page_size=16)
        out.append(int(np.argmax(np.asarray(logits)[-1])))
    return out[len(tokens):]


class FailOnce:
    """Wraps an executor's jitted step: the call runs (so the pool is donated and gone), then
    raises, once."""

    def __init__(self, step):
        self.step, self.armed = step, True

    def __call__(self, *args, **kwargs):
        out = self.step(*args, **kwargs)
        if self.armed:
            self.armed = False
            raise RuntimeError("injected device failure")
        return out


def test_a_failed_step_rebuilds_the_pool_and_every_session(tiny, tiny_params):
    engine = make_engine(tiny, tiny_params, kv_cache_dtype="f32", num_shards=4,
                         pages_per_shard=16, chunk_size=32)
    a, b = engine.create_session(), engine.create_session()
    engine.extend(a.id, random_tokens(tiny, 50, 0))
    engine.extend(b.id, random_tokens(tiny, 30, 1))
    engine.executor._step = FailOnce(engine.executor._step)
    engine.submit(Generate(id="g", session=a.id, sampling=SamplingParams(max_tokens=4)))
    engine.submit(Extend(id="x", session=b.id, tokens=np.asarray(random_tokens(tiny, 40, 2))))
    events = engine.step()
    assert sorted((e.request, e.code) for e in events) == [("g", "unavailable"),
                                                           ("x", "unavailable")]
    assert engine.info(a.id)["restoring"] and b.length == 30 + 40   # accepted tokens stay
    with pytest.raises(Exception, match="being restored"):
        engine.submit(Generate(id="early", session=a.id, sampling=SamplingParams()))
    while engine.has_work:
        engine.step()
    assert (a.kv_len, b.kv_len) == (a.length, b.length)
    engine.submit(Generate(id="retry", session=a.id, sampling=SamplingParams(max_tokens=4)))
    out = []
    while engine.has_work:
        out += [e.token for e in engine.step() if isinstance(e, Token)]
    assert out == greedy_continuation(tiny_params, tiny, a.tokens[:50], 4)
    engine.allocator.check_invariants()


# The client's own retry waits out `unavailable` while a restarted server rebuilds a session
# (up to about two minutes).
WHILE_RESTORING = cp_runtime.Retry(attempts=600, backoff_s=0.05, max_backoff_s=0.2)


@pytest.fixture
def state_dir(tmp_path):
    return str(tmp_path / "state")


def test_kill_9_mid_extend_and_mid_generate_loses_no_acknowledged_token(state_dir, tiny,
                                                                       tiny_params):
    args = ("--state-dir", state_dir, "--fsync", "never")
    server = start_server(*args)
    address = server.address
    prompt = random_tokens(tiny, 200, 5)
    acked: dict[str, list[int]] = {}

    async def upload_then_kill(client):
        """Acknowledged 200 tokens, then a 3000-token extend killed after its first chunk."""
        s = await client.create_session()
        await s.extend(prompt)
        acked["upload"] = list(prompt)
        async for event in client.events("extend", session=s.id,
                                         tokens=random_tokens(tiny, 3000, 6)):
            if event["event"] == "progress":
                server.kill()
                break
        return s.id

    async def generate_then_kill(client):
        s = await client.create_session()
        await s.extend(prompt)
        got = []
        async for event in client.events("generate", session=s.id, max_tokens=60):
            if event["event"] == "token":
                got.append(event["token"])
            if len(got) == 5:
                server.kill()
                break
        acked["chat"] = list(prompt) + got
        return s.id

    async def main():
        async with cp_runtime.AsyncClient(address) as c:
            chat = await generate_then_kill(c)
        return chat

    chat_id = asyncio.run(main())
    server = start_server(*args)
    address = server.address
    async def second():
        async with cp_runtime.AsyncClient(address) as c:
            return await upload_then_kill(c)
    try:
        upload_id = asyncio.run(second())
    except (ConnectionError, OSError):
        pytest.fail("the upload's client lost the connection before the kill")
    t_restart = time.monotonic()
    server = start_server(*args)
    address = server.address
    try:
        with cp_runtime.Client(address, retry=WHILE_RESTORING) as client:
            listed = {s["id"]: s["length"] for s in client.sessions()}
            assert set(listed) == {chat_id, upload_id}
            logs = read_logs(state_dir)
            for sid, name in ((chat_id, "chat"), (upload_id, "upload")):
                assert logs[sid][: len(acked[name])] == acked[name]   # nothing acknowledged lost
                assert listed[sid] == len(logs[sid])
            chat = client.session(chat_id)
            cont = chat.generate(max_tokens=3).tokens
            first_token_s = time.monotonic() - t_restart
            assert cont == greedy_continuation(tiny_params, tiny, logs[chat_id], 3)
            print(f"restart to first token of the restored session: {first_token_s:.1f} s")
    finally:
        stop_server(server)


@pytest.mark.slow             # kept out of the default suite for its time budget
def test_a_snapshot_restores_into_a_server_with_another_shard_count(state_dir, tiny,
                                                                   tiny_params):
    server = start_server("--state-dir", state_dir)
    address = server.address
    try:
        with cp_runtime.Client(address) as client:
            s = client.create_session()
            s.extend(random_tokens(tiny, 300, 7))
            snap = s.snapshot()
            assert (snap["length"], snap["cached"]) == (300, 300)
            s.extend(random_tokens(tiny, 20, 8))                    # after the snapshot
            sid, log = s.id, read_logs(state_dir)[s.id]
    finally:
        stop_server(server)
    server = start_server("--state-dir", state_dir, "--shards", "4")
    address = server.address
    try:
        with cp_runtime.Client(address, retry=WHILE_RESTORING) as client:
            assert client.server["shards"] == 4
            s = client.session(sid)
            out = s.generate(max_tokens=3).tokens
            assert out == greedy_continuation(tiny_params, tiny, log, 3)
            # Only the 20 tokens past the snapshot were prefilled (then one decode per token).
            assert client.stats()["prefill_tokens_total"] == 20
    finally:
        stop_server(server)


def test_a_failed_direct_step_is_recovered_and_raised_as_unavailable(tiny, tiny_params):
    engine = make_engine(tiny, tiny_params, kv_cache_dtype="f32", num_shards=4,
                         pages_per_shard=16, chunk_size=32)
    s = engine.create_session()
    engine.extend(s.id, random_tokens(tiny, 40, 0))
    engine.executor._step = FailOnce(engine.executor._step)
    with pytest.raises(Unavailable, match="being rebuilt"):
        engine.decode([s.id], [3])
    assert s.length == 40 and engine.info(s.id)["restoring"]     # nothing half-appended
    while engine.has_work:
        engine.step()
    logits = engine.decode([s.id], [3])
    ref = oracle_logits(tiny_params, jnp.asarray(s.tokens), cfg=tiny, page_size=16)
    np.testing.assert_allclose(logits[0], np.asarray(ref)[-1], rtol=1e-4, atol=1e-4)


# -- damaged state directories and a full disk -------------------------------------------------
SNAPSHOT_FAULTS = ("flipped", "meta_empty", "meta_garbage", "npy_missing", "npy_zeroed",
                   "short_log")


def _serve(state_dir, *extra):
    """(the ServerProcess, its address) over `state_dir`."""
    server = start_server("--state-dir", state_dir, *extra)
    return server, server.address


def fresh_greedy(client, tokens, n):
    """The server's greedy n tokens after `tokens` in a new, undamaged session (the engine's
    greedy decoding equals the oracle's: tests/engine/test_engine.py)."""
    s = client.create_session()
    s.extend(tokens)
    out = s.generate(max_tokens=n).tokens
    s.close()
    return out


def _write_log(path, pieces):
    data, crc = token_log.HEADER, 0
    for piece in pieces:
        record, crc = token_log.encode_record(piece, crc)
        data += record
    path.write_bytes(data)


async def _first_life(address, tiny):
    """Sessions for every fault, snapshots for the snapshot faults, and snapshots racing
    closes; returns {name: (id, acknowledged tokens)}."""
    made = {}
    async with cp_runtime.AsyncClient(address) as client:
        for i, name in enumerate(("good", "torn", "flipped_log") + SNAPSHOT_FAULTS):
            s = await client.create_session()
            tokens = random_tokens(tiny, 30 + i, 100 + i)
            await s.extend(tokens)
            if name == "flipped_log":                  # a second record to flip a bit in
                more = random_tokens(tiny, 20, 99)
                await s.extend(more)
                tokens += more
            if name in SNAPSHOT_FAULTS:
                await s.snapshot()
            made[name] = (s.id, tokens)
        for i in range(6):                             # a snapshot racing a close
            s = await client.create_session()
            await s.extend(random_tokens(tiny, 20, 200 + i))
            await asyncio.gather(s.snapshot(), s.close(), return_exceptions=True)
    return made


def _damage(state, made, tiny):
    """Every fault, by hand, on the stopped server's directory; returns the extra ids."""
    sessions, snaps = state / "sessions", state / "snapshots"
    log = lambda name: sessions / (made[name][0] + ".log")       # noqa: E731
    snap = lambda name: snaps / made[name][0]                    # noqa: E731
    with log("torn").open("ab") as f:
        f.write(b"\x05\x00\x00\x00\x11")                         # a record cut short
    raw = bytearray(log("flipped_log").read_bytes())
    raw[-3] ^= 0x04                                              # in the second record's ids
    log("flipped_log").write_bytes(bytes(raw))
    latent = snap("flipped") / "latent.npy"
    raw = bytearray(latent.read_bytes())
    raw[-1] ^= 0x40
    latent.write_bytes(bytes(raw))
    (snap("meta_empty") / "meta.json").write_bytes(b"")
    (snap("meta_garbage") / "meta.json").write_bytes(b"\x00{ not json")
    (snap("npy_missing") / "indexer.npy").unlink()
    size = (snap("npy_zeroed") / "latent.npy").stat().st_size
    (snap("npy_zeroed") / "latent.npy").write_bytes(b"\0" * size)
    _write_log(log("short_log"), [])                             # the log emptied
    extra = {"bad_ids": "%032x" % 0xbad1, "log_dir": "%032x" % 0xbad2,
             "format1": "%032x" % 0xbad3}
    _write_log(sessions / (extra["bad_ids"] + ".log"), [[1, 2, 3], [4, -1, 1000, 70000]])
    (sessions / (extra["log_dir"] + ".log")).mkdir()
    (sessions / (extra["format1"] + ".tokens")).write_bytes(
        np.asarray([5, 6, 7, 8], "<i4").tobytes())
    (sessions / "README.tokens").write_text("an operator's notes")
    good = made["good"][0]
    (sessions / (good.upper() + ".log")).write_bytes(log("good").read_bytes())
    for leftover in (good + ".tmp-0badf00d", good + ".old-0badf00d", "e" * 32):
        (snaps / leftover).mkdir()
        (snaps / leftover / "latent.npy").write_bytes(b"x" * 1000)
    return extra


def test_every_kind_of_damage_is_repaired_reported_or_set_aside_and_never_stops_the_server(
        tmp_path, tiny):
    state = tmp_path / "state"
    server, address = _serve(str(state))
    try:
        made = asyncio.run(_first_life(address, tiny))
    finally:
        stop_server(server)
    assert sorted(p.name for p in (state / "snapshots").iterdir()) == sorted(
        made[name][0] for name in SNAPSHOT_FAULTS)                 # no orphan from the race
    extra = _damage(state, made, tiny)

    server, address = _serve(str(state))
    try:
        with cp_runtime.Client(address, retry=WHILE_RESTORING) as client:
            listed = {s["id"]: s for s in client.sessions()}
            unrestored = client.unrestored()
            length = {name: listed[sid]["length"] for name, (sid, _) in made.items()}
            assert length == {**{name: len(t) for name, (_, t) in made.items()},
                              "flipped_log": len(made["flipped_log"][1]) - 20}
            assert listed[extra["bad_ids"]]["length"] == 4
            assert listed[extra["format1"]]["length"] == 4
            damaged = {sid for sid, s in listed.items() if "damaged" in s}
            assert damaged == {made["flipped_log"][0], made["short_log"][0], extra["bad_ids"]}
            assert "checksum" in listed[made["flipped_log"][0]]["damaged"]
            assert "token id -1 at position 4" in listed[extra["bad_ids"]]["damaged"]
            assert [u["id"] for u in unrestored] == [extra["log_dir"]]
            assert "not a regular file" in unrestored[0]["reason"]
            # Restored sessions continue exactly, from the log where the snapshot was bad.
            for name in ("good", "flipped", "short_log"):
                sid, tokens = made[name]
                out = client.session(sid).generate(max_tokens=2).tokens
                assert out == fresh_greedy(client, tokens, 2), name
                made[name] = (sid, tokens + out)
            torn = client.session(made["torn"][0])
            more = random_tokens(tiny, 10, 300)
            torn.extend(more)
            made["torn"] = (torn.id, made["torn"][1] + more)
    finally:
        stop_server(server)
    text = server.log()
    for name in SNAPSHOT_FAULTS[:-1]:                    # each bad snapshot named in the log
        assert f"session {made[name][0]}: its snapshot fails a check" in text, name
    assert f"session {made['torn'][0]}: its token log ended in a record cut short" in text
    assert "README.tokens: ignored" in text and made["good"][0].upper() in text
    assert sorted(p.name for p in (state / "snapshots").iterdir()) == [
        made["short_log"][0]]                            # leftovers and bad snapshots gone
    notes = [json.loads((d / "note.json").read_text())
             for d in (state / "quarantine").iterdir()]
    assert len(notes) == 3 + 5 + 1                       # 3 damaged logs, 5 bad snapshots, a dir

    # A third life: the repairs held, and the torn log's later appends read back exactly.
    server, address = _serve(str(state))
    try:
        with cp_runtime.Client(address, retry=WHILE_RESTORING) as client:
            listed = {s["id"]: s for s in client.sessions()}
            assert not any("damaged" in s for s in listed.values())
            logs = read_logs(state)
            for name, (sid, tokens) in made.items():
                if name != "flipped_log":
                    assert logs[sid] == tokens, name
            sid, tokens = made["torn"]
            assert (client.session(sid).generate(max_tokens=2).tokens
                    == fresh_greedy(client, tokens, 2))
    finally:
        stop_server(server)


@contextlib.contextmanager
def small_tmpfs(path, size="256k"):
    """A real tmpfs of `size` mounted at `path` (skips the test where mounting is refused)."""
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): "
                    "the full-disk path is covered by "
                    "tests/serving/state/test_durable_state.py's injected faults")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(directory):
    """Write a filler file until the file system is full."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_refuses_with_storage_changes_nothing_and_the_server_goes_on(
        tmp_path, tiny):
    with small_tmpfs(tmp_path / "state") as state:
        # The compilation cache (else in the state dir) kept off the small disk: it would
        # fill it before the test's first session.
        server, address = _serve(str(state), "--fsync", "always", "--compile-cache",
                                 str(tmp_path / "compile-cache"))
        try:
            with cp_runtime.Client(address) as client:
                s = client.create_session()
                acked = random_tokens(tiny, 100, 1)
                s.extend(acked)
                acked += s.generate(max_tokens=3).tokens
                filler = _fill(state)
                with pytest.raises(cp_runtime.StorageError, match="No space left"):
                    s.extend(random_tokens(tiny, 2000, 2))
                with pytest.raises(cp_runtime.StorageError):
                    client.create_session()
                assert s.info()["length"] == len(acked) and not s.info()["busy"]
                assert read_logs(state) == {s.id: acked}          # nothing half-written
                filler.unlink()                                    # space is back
                more = random_tokens(tiny, 2000, 2)
                s.extend(more)
                acked += more
                out = s.generate(max_tokens=3).tokens
                assert out == fresh_greedy(client, acked, 3)
                acked += out
        finally:
            stop_server(server)
        assert read_logs(state) == {s.id: acked}         # what a restart would restore
        assert "No space left" in server.log()
