"""Routed experts in groups (runtime field `expert_groups`): each device holds its group's whole
experts, sliced by feature, and runs only its group's (token, expert) pairs, in passes of a
fixed number of rows. Against one group (every device a slice of every expert): the layout's
arithmetic, the passes exact however uneven the routing, the fp8 kernel path, placement from a
checkpoint, and whole prefills' logits. And the experts placed in one group and regrouped for
long prompts (`prefill_expert_groups`): when they move, and the logits either way."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_engine, random_tokens, rel_l2
from test_checkpoint import HF_CONFIG, write_checkpoint
from cp_runtime.cache.pool import CP_AXIS
from cp_runtime.config import ConfigError, RuntimeConfig, load_model_config
from cp_runtime.engine.executor import LocalExecutor, experts_for_plan
from cp_runtime.engine.step import Segment, StepInputs
from cp_runtime.kernels import expert_matmul, fp8_rows
from cp_runtime.model import expert_groups
from cp_runtime.model.moe import every_expert, expert_rows, pairs_by_expert
from cp_runtime.weights.checkpoint import CheckpointBlocks
from cp_runtime.weights.format import SCALE_SUFFIX, device_tensors
from cp_runtime.weights.fp8_blocks import quantize
from cp_runtime.weights.sharding import grouped_experts
from cp_runtime.weights.params import init_params, model_layout
from cp_runtime.weights.placement import place_weights

S = 16
STACK = "model.layers.3.mlp.experts.{}_proj.weight"


def test_a_device_holds_its_groups_experts_and_a_slice_of_their_features():
    """GLM-5.2's gate stack [256, 6144, 2048] and down stack in 4 groups over 16 devices."""
    gate = grouped_experts(STACK.format("gate"), (256, 6144, 2048), S, 4)
    down = grouped_experts(STACK.format("down"), (256, 2048, 6144), S, 4)
    assert gate.local == (64, 6144, 512) and down.local == (64, 512, 6144)
    assert gate.full == (16 * 64, 6144, 512)
    assert [gate.experts(d) for d in (0, 3, 4, 15)] == [(0, 64), (0, 64), (64, 128), (192, 256)]
    assert [gate.features(d) for d in (0, 3, 4, 15)] == [(0, 512), (1536, 2048), (0, 512),
                                                        (1536, 2048)]
    # Not a stack, or one group: the by-feature split of every other layout.
    assert grouped_experts("model.layers.3.mlp.gate_proj.weight", (64, 64), S, 4) is None
    assert grouped_experts(STACK.format("gate"), (256, 6144, 2048), S, 1) is None
    # Experts and features that do not divide are padded: 4 experts in 16 groups.
    tiny = grouped_experts(STACK.format("up"), (4, 64, 32), S, 16)
    assert tiny.local == (1, 64, 32) and tiny.experts(5) == (5, 6)


def test_a_pass_takes_an_even_share_and_a_quarter_more_in_whole_tiles():
    assert expert_groups.rows_per_pass(16384 * 8, 4) == 40960     # GLM-5.2's half-chunk
    assert expert_groups.rows_per_pass(16384 * 8, 16) == 10240
    assert expert_groups.rows_per_pass(32 * 8, 4) == 256          # a decode step: every pair
    assert expert_groups.rows_per_pass(1 * 8, 4) == 8


def test_expert_groups_must_divide_the_shards_and_need_split_weights():
    with pytest.raises(ConfigError, match="expert_groups=3 must divide num_shards=16"):
        RuntimeConfig(expert_groups=3)
    with pytest.raises(ConfigError, match="expert_groups=0 must be"):
        RuntimeConfig(expert_groups=0)
    with pytest.raises(ConfigError, match="expert_groups=4 .* needs weights='sharded'"):
        RuntimeConfig(expert_groups=4, weights="replicated")
    with pytest.raises(ConfigError, match="prefill_expert_groups=6 must divide num_shards=16"):
        RuntimeConfig(prefill_expert_groups=6)
    with pytest.raises(ConfigError, match="prefill_expert_groups=8 .* needs weights='sharded'"):
        RuntimeConfig(prefill_expert_groups=8, weights="replicated")
    with pytest.raises(ConfigError, match="needs expert_groups=1, not 4"):
        RuntimeConfig(expert_groups=4, prefill_expert_groups=8)


def _stacks(rng, experts: int, hidden: int, inner: int, runs: int):
    """fp8 stacks with block scales: {proj: (values, scales)}, model layout."""
    out = {}
    for proj, shape in (("gate", (experts, hidden, inner)), ("up", (experts, hidden, inner)),
                        ("down", (experts, inner, hidden))):
        values, scales = quantize(rng.standard_normal(shape).astype(np.float32), (runs, runs))
        out[proj] = (jnp.asarray(values), jnp.asarray(scales))
    return out


def _params(stacks, lo: int, hi: int) -> dict:
    """Experts lo..hi of `stacks` (whole features) as a layer's parameters."""
    p = {}
    for proj, (values, scales) in stacks.items():
        name = f"mlp.experts.{proj}_proj.weight"
        p[name], p[name + SCALE_SUFFIX] = values[lo:hi], scales[lo:hi]
    return p


@pytest.mark.parametrize("capacity", [None, 24])
def test_groups_sum_to_one_groups_result_however_uneven_the_routing(capacity):
    """Every token chooses 3 of its k = 4 experts among group 0's (8 of 32 experts in 4
    groups) and one of the others': group 0 gets 192 of the T k = 256 pairs, three times its
    even share. With 24 rows a pass it takes 8 passes (the first, then 7 of the loop); the
    groups' sums, added, are one group's sum. Through the fp8 kernel (interpret mode) from fp8
    rows, as a TPU prefill runs them; each group's partial leaves the kernel in bf16, so the
    sums differ by the rounding of their order (measured rel-L2 1.7e-3 in both cases; bound
    1e-2)."""
    rng = np.random.default_rng(0)
    tokens, k, experts, groups = 64, 4, 32, 4
    stacks = _stacks(rng, experts, 128, 128, 128)
    x = jnp.asarray(rng.standard_normal((tokens, 128)), jnp.float32)
    rows = fp8_rows.quantize(x)
    chosen = jnp.asarray(np.concatenate([np.argsort(rng.random((tokens, 8)), 1)[:, :3],
                                         rng.integers(8, experts, (tokens, 1))], 1), jnp.int32)
    weights = jnp.asarray(rng.random((tokens, k)), jnp.float32)
    kernel = functools.partial(expert_matmul.grouped_matmul, interpret=True)
    whole, _ = pairs_by_expert(_params(stacks, 0, experts), x, chosen, weights, kernel,
                               fp8=rows)
    per = experts // groups
    parts = []
    for a in range(groups):
        run = expert_rows(_params(stacks, a * per, (a + 1) * per), x, kernel, rows)
        out = jnp.zeros(x.shape, jnp.bfloat16)
        parts.append(expert_groups.routed_in_group(chosen, weights, a * per, per, run, out,
                                                   capacity=capacity)[0])
    got = sum(np.asarray(part, np.float32) for part in parts)
    assert rel_l2(got, np.asarray(whole, np.float32)) <= 1e-2


def test_one_tokens_sorted_choices_take_no_sort():
    """A decode step of one token whose choices come in ascending expert order (the router's
    kernel hands them so): its group's run rotated to the front gives what the sort gives,
    for every group, including the groups it chose none or all of."""
    rng = np.random.default_rng(2)
    experts, per = 32, 8
    stacks = _stacks(rng, experts, 128, 128, 128)
    x = jnp.asarray(rng.standard_normal((1, 128)), jnp.float32)
    weights = jnp.asarray(rng.random((1, 4)), jnp.float32)
    for picks in ([1, 9, 17, 30], [8, 9, 10, 15], [2, 3, 25, 31]):
        chosen = jnp.asarray([picks], jnp.int32)
        for a in range(experts // per):
            run = expert_rows(_params(stacks, a * per, (a + 1) * per), x, None, None)
            out = jnp.zeros_like(x)
            got = [np.asarray(expert_groups.routed_in_group(chosen, weights, a * per, per, run,
                                                            out, presorted=p)[0])
                   for p in (False, True)]
            np.testing.assert_array_equal(got[1], got[0], err_msg=f"{picks} group {a}")


def test_a_pass_that_drops_pairs_would_be_seen():
    """The comparison above can fail: the first pass alone (24 of group 0's 256 pairs) is far
    from one group's sum (measured rel-L2 0.94)."""
    rng = np.random.default_rng(0)
    tokens, k, experts = 64, 4, 32
    stacks = _stacks(rng, experts, 128, 128, 128)
    x = jnp.asarray(rng.standard_normal((tokens, 128)), jnp.float32)
    chosen = jnp.asarray(np.argsort(rng.random((tokens, 8)), 1)[:, :k], jnp.int32)
    weights = jnp.asarray(rng.random((tokens, k)), jnp.float32)
    p = _params(stacks, 0, experts)
    whole, _ = pairs_by_expert(p, x, chosen, weights)
    run = expert_rows(_params(stacks, 0, 8), x, None, None)
    one_pass, _ = run(*_first_pass(chosen, weights, 8, 24))
    got = jnp.zeros_like(x).at[_first_pass(chosen, weights, 8, 24)[0]].add(one_pass)
    assert rel_l2(got, whole) > 0.5


def _first_pass(chosen, weights, experts: int, rows: int):
    """(token, routing, sizes) of the first `rows` pairs of experts 0..experts, as a pass."""
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)[:rows]
    counts = jnp.zeros((experts,), jnp.int32).at[flat].add(1)
    sizes = jnp.diff(jnp.minimum(jnp.cumsum(counts), rows), prepend=0)
    return order // chosen.shape[1], weights.reshape(-1)[order, None], sizes, ()


def test_a_decode_steps_every_expert_path_takes_only_its_groups_experts():
    """The CPU's path for a few tokens and fp8 experts (every expert of the device on every
    token, weighted): the 4 groups' sums, each from its experts' fp8 blocks, add up to one
    group's (f32 sums in another order: measured rel-L2 1.5e-8; bound 1e-5)."""
    rng = np.random.default_rng(1)
    tokens, k, experts, groups = 8, 4, 32, 4
    stacks = _stacks(rng, experts, 128, 128, 128)
    x = jnp.asarray(rng.standard_normal((tokens, 128)), jnp.float32)
    chosen = jnp.asarray(np.argsort(rng.random((tokens, experts)), 1)[:, :k], jnp.int32)
    weights = jnp.asarray(rng.random((tokens, k)), jnp.float32)
    whole = every_expert(_params(stacks, 0, experts), x, chosen, weights)
    per = experts // groups
    got = sum(every_expert(_params(stacks, a * per, (a + 1) * per), x, chosen, weights,
                           first=a * per) for a in range(groups))
    assert rel_l2(got, whole) <= 1e-5


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("groups") / "wide-v32"
    cfg, expected = write_checkpoint(d, HF_CONFIG | {"n_routed_experts": 16,
                                                     "moe_intermediate_size": 64}, seed=7)
    return d, cfg, model_layout(expected, cfg)


@pytest.mark.parametrize("dtype", ["f32", "fp8"])
@pytest.mark.parametrize("groups", [4, 16])
def test_each_device_loads_its_groups_experts_and_features_from_the_checkpoint(
        wide_ckpt, dtype, groups):
    """Device d's block of a stack is the checkpoint's experts of its group and its slice of
    their features: dequantised for f32, the stored fp8 values (and scales that give back
    the same f32 values) for fp8."""
    d, cfg, expected = wide_ckpt
    blocks = CheckpointBlocks(d, cfg)
    tensors = device_tensors(blocks.shapes, cfg, "sharded", dtype, S, blocks.block, groups)
    mesh = jax.make_mesh((S,), (CP_AXIS,), devices=jax.devices()[:S])
    placed = place_weights(blocks, tensors, mesh, CP_AXIS)
    stacks = [n for n in expected if tensors[n].experts is not None]
    assert stacks
    for name in stacks:
        t, want = tensors[name], np.asarray(expected[name])
        values = np.asarray(placed[name]).astype(np.float32)
        if dtype == "fp8":
            s = np.asarray(placed[name + SCALE_SUFFIX])
            ga, gb = values.shape[-2] // s.shape[-2], values.shape[-1] // s.shape[-1]
            values = values * np.repeat(np.repeat(s, ga, axis=-2), gb, axis=-1)
        for device in range(S):
            (e_lo, e_hi), (f_lo, f_hi) = t.experts.experts(device), t.experts.features(device)
            block = values[device * t.local[0]:(device + 1) * t.local[0]]
            part = np.take(want[e_lo:e_hi], np.arange(f_lo, f_hi), axis=t.experts.inner_axis)
            np.testing.assert_array_equal(block, part, err_msg=f"{name} device {device}")


def _prefill(model, params, groups: int, tokens: int) -> np.ndarray:
    engine = make_engine(model, params, kv_cache_dtype="f32", num_shards=S, pages_per_shard=4,
                         page_size=16, chunk_size=64, weights="sharded", expert_groups=groups)
    s = engine.create_session()
    return engine.extend(s.id, random_tokens(model, tokens, seed=3), all_logits=True)


# tiny's case is slow, for the default suite's time budget (deepseek-mini's runs the same path).
@pytest.mark.parametrize("model_name,groups", [
    pytest.param("tiny", (16,), marks=pytest.mark.slow), ("deepseek-mini", (2, 4))])
def test_a_prefill_in_expert_groups_gives_one_groups_logits(model_name, groups):
    """f32 weights over 16 shards, 300 tokens (5 chunks; every pass whole): the logits in 2
    and 4 groups (deepseek-mini) and 16 (tiny) against one group. tiny's 4 experts in 16
    groups: 12 groups of zero experts, which no token chooses. Measured rel-L2 at most
    3.1e-7; bound 1e-5, the replicated-weights bound of test_sharded_weights."""
    model = load_model_config(model_name)
    params = init_params(model, seed=0)
    one = _prefill(model, params, 1, 300)
    for g in groups:
        assert rel_l2(_prefill(model, params, g, 300), one) <= 1e-5, g


def _regrouped_session(model, params, groups: int, weight_dtype: str, halves: str):
    """A 200-token prompt in chunks that split their rows over 16 shards (gather_kv, 64 rows)
    and one decode step, the experts regrouped into `groups` for the prompt -> (the prompt's
    logits, the step's, the groups the experts were in after the prompt and after the step,
    the engine)."""
    engine = make_engine(model, params, kv_cache_dtype="f32", num_shards=S, pages_per_shard=4,
                         page_size=16, chunk_size=64, weights="sharded",
                         weight_dtype=weight_dtype, attention="gather_kv",
                         row_attention="weights", chunk_halves=halves,
                         prefill_expert_groups=groups)
    s = engine.create_session()
    prompt = engine.extend(s.id, random_tokens(model, 200, seed=3), all_logits=True)
    after_prompt = engine.executor.experts_in
    step = engine.decode([s.id], [7])
    return prompt, step, (after_prompt, engine.executor.experts_in), engine


def _expert_stacks(engine) -> dict[str, np.ndarray]:
    return {name: np.asarray(x) for name, x in engine.executor.params.items()
            if ".mlp.experts." in name}


@pytest.mark.parametrize("model_name,weight_dtype,groups,halves", [
    pytest.param("tiny", "f32", 16, "off", marks=pytest.mark.slow),
    ("deepseek-mini", "fp8", 4, "on")])
def test_a_prompt_with_its_experts_regrouped_gives_one_groups_logits(model_name, weight_dtype,
                                                                     groups, halves):
    """200 tokens over 16 shards: three whole chunks move the experts into `groups` groups,
    the last 8 rows run as they are, and the decode step moves them back. The prompt's and
    the step's logits against one group: f32 within 1e-5 (the bound of test_sharded_weights;
    each device sums other pairs). fp8 weights as two halves (block scales moved with their
    values): the same fp8 values as one group's, summed in another order into bf16
    partials, measured 4.7e-4 (1.3e-4 in one pass), bound 2e-3 (4 groups as placed quantize
    other blocks: 0.10 from one group's). Back in one group the stacks are bit for bit those
    placed. tiny's 4 experts in 16 groups: 12 zero experts pad them."""
    model = load_model_config(model_name)
    params = init_params(model, seed=0)
    one_prompt, one_step, groups_one, one = _regrouped_session(model, params, 1, weight_dtype,
                                                               halves)
    prompt, step, groups_seen, engine = _regrouped_session(model, params, groups,
                                                           weight_dtype, halves)
    assert groups_one == (1, 1) and groups_seen == (groups, 1)
    bound = 1e-5 if weight_dtype == "f32" else 2e-3
    assert rel_l2(prompt, one_prompt) <= bound
    assert rel_l2(step, one_step) <= bound
    placed, back = _expert_stacks(one), _expert_stacks(engine)
    assert placed.keys() == back.keys() and placed
    for name in placed:
        np.testing.assert_array_equal(back[name], placed[name], err_msg=name)


def _plan(*queries: tuple[int, int]) -> tuple:
    """A step plan of segments with (rows, real queries a row) each, padded to 64 queries
    where a row is a prefill chunk."""
    segments = []
    for rows, real in queries:
        width = 1 if real == 1 else 64
        positions = np.full((rows, width), -1, np.int32)
        positions[:, :real] = np.arange(real)
        segments.append(Segment("fill", StepInputs(
            tokens=np.zeros((rows, width), np.int32), positions=positions,
            page_table=np.zeros((rows, 16), np.int32),
            logit_index=np.zeros((rows,), np.int32))))
    return tuple(segments)


def test_the_experts_regroup_for_a_whole_chunk_and_come_back_for_decode_alone():
    """experts_for_plan with chunks of 64: a whole chunk (beside decode rows or not) wants 4
    groups; decode rows alone want one; a shorter chunk keeps what is (a prompt's last chunk
    runs as its others did, a short prompt between decode steps moves nothing); with
    prefill_expert_groups 1 nothing ever moves."""
    whole, decode, short = _plan((1, 64)), _plan((8, 1)), _plan((1, 20))
    beside = _plan((8, 1), (1, 64))
    for now in (1, 4):
        assert experts_for_plan(whole, 4, 64, now) == 4
        assert experts_for_plan(beside, 4, 64, now) == 4
        assert experts_for_plan(decode, 4, 64, now) == 1
        assert experts_for_plan(short, 4, 64, now) == now
        assert experts_for_plan(_plan((8, 1), (1, 20)), 4, 64, now) == now
    assert experts_for_plan(_plan((64, 1)), 4, 64, 4) == 1      # as many decode rows as a chunk
    assert experts_for_plan(whole, 1, 64, 1) == 1


def test_an_exchange_that_fails_part_way_puts_back_the_layers_it_moved():
    """deepseek-mini's MoE layers over 16 shards, the exchange into 4 groups failing at its
    second layer: the first layer's stacks come back, so every stack is the placed one, bit
    for bit, the executor still says one group, and the failure is raised."""
    model = load_model_config("deepseek-mini")
    executor = LocalExecutor(model, RuntimeConfig(model=model.name, num_shards=S,
                                                  pages_per_shard=4, page_size=16,
                                                  weights="sharded", weight_dtype="fp8",
                                                  prefill_expert_groups=4),
                             init_params(model, seed=0))
    placed = {n: np.asarray(x) for n, x in executor.params.items() if ".mlp.experts." in n}
    regrouping, calls = executor._regrouping, []
    exchange = regrouping.to_groups_layer

    def failing(stacks):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a device failed mid-exchange")
        return exchange(stacks)

    regrouping.to_groups_layer = failing
    with pytest.raises(RuntimeError, match="mid-exchange"):
        executor.run(_plan((1, 64)))
    assert executor.experts_in == 1 and len(calls) == 2
    for name, values in placed.items():
        np.testing.assert_array_equal(np.asarray(executor.params[name]), values, err_msg=name)
