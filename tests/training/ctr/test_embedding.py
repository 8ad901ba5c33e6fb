"""The sharded embedding store: init, lookups, row-wise optimizers, 2-rank equivalence."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from training.ctr.embedding import (
    ADAGRAD_EPS,
    SCALE_BIAS,
    TABLE_DTYPES,
    ShardedEmbedding,
    decode_grads,
    decode_rows,
    encode_grads,
    encode_rows,
    group_by_owner,
    init_rows,
    init_table,
    narrowest_int,
    quantize_int8,
    reshard_state,
    rounding_bits,
    stochastic_round,
    sum_rows,
    table_offsets,
    unique_inverse,
    warm_start_state,
)

SIZES = [7, 13, 5]
DIM = 4


def gather_full_table(shards: list[torch.Tensor], num_rows: int) -> torch.Tensor:
    """Interleave W shards' local rows into the (N, D) table: row g is on shard g % W."""
    table = torch.empty((num_rows, shards[0].shape[1]), dtype=shards[0].dtype)
    for rank, shard in enumerate(shards):
        table[rank :: len(shards)] = shard
    return table


def _loss(rows: torch.Tensor, inverse: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """A nonlinear per-sample loss, averaged over the local batch (B, F) of global ids."""
    embedded = rows[inverse].view(batch.shape[0], batch.shape[1], DIM)  # (B, F, D)
    target = torch.linspace(-1, 1, DIM)
    return ((embedded.sum(dim=1) - target) ** 2).sum(dim=1).tanh().mean()


def _global_batches(steps: int, batch: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    offsets = table_offsets(SIZES)
    batches = []
    for _ in range(steps):
        ids = torch.stack(
            [torch.randint(0, n, (batch,), generator=generator) for n in SIZES], dim=1
        )
        batches.append(ids + offsets[:-1])  # (B, F) global ids
    return batches


def _train(store: ShardedEmbedding, batches: list[torch.Tensor], rank: int, world: int) -> None:
    for global_batch in batches:
        local = global_batch.chunk(world)[rank]
        rows, inverse, context = store.lookup(local.flatten())
        rows_eff = torch.where(context.admitted[:, None], rows, torch.zeros(()))
        _loss(rows_eff, inverse, local).backward()
        store.accumulate_gradients(rows.grad, context)
        store.step()


HALF = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_init_does_not_depend_on_world_size(dtype: torch.dtype) -> None:
    full = init_rows(SIZES, DIM, seed=3)
    # A 2-byte table starts from the fp32 values rounded to nearest, without the fp32 table.
    assert torch.equal(init_rows(SIZES, DIM, seed=3, dtype=dtype), full.to(dtype))
    for world in (2, 3):
        shards = [
            init_rows(SIZES, DIM, seed=3, rank=r, world_size=world, dtype=dtype)
            for r in range(world)
        ]
        assert all(shard.dtype == dtype for shard in shards)
        assert torch.equal(gather_full_table(shards, sum(SIZES)), full.to(dtype))
    bound = 1 / SIZES[1] ** 0.5
    assert full[7:20].abs().max() <= bound and full[7:20].abs().max() > 0.5 * bound
    assert not torch.equal(full, init_rows(SIZES, DIM, seed=4))


def test_init_is_chunked_independently_of_the_table_end() -> None:
    # Same seed, a larger table: the shared leading rows keep their values.
    small = init_rows([70_000], DIM, seed=1)
    large = init_rows([70_000, 10], DIM, seed=1)
    assert torch.equal(small, large[:70_000])


def test_an_int8_table_starts_from_the_fp32_rows_quantized_for_any_world_size() -> None:
    full = init_rows(SIZES, DIM, seed=3)
    codes, scale_bias = quantize_int8(full)
    table = init_table(SIZES, DIM, seed=3, precision="int8")
    assert torch.equal(table["weight"], codes) and torch.equal(table[SCALE_BIAS], scale_bias)
    for world in (2, 3):
        shards = [init_table(SIZES, DIM, 3, r, world, "int8") for r in range(world)]
        assert torch.equal(gather_full_table([s["weight"] for s in shards], 25), codes)
        assert torch.equal(gather_full_table([s[SCALE_BIAS] for s in shards], 25), scale_bias)
    # Each row's grid spans it: its minimum and maximum are codes 0 and 255, and every
    # value is within half a step of its row's fp32 value.
    assert bool((codes.amin(dim=1) == 0).all() and (codes.amax(dim=1) == 255).all())
    error = (decode_rows(codes, scale_bias) - full).abs()
    assert bool((error <= scale_bias[:, :1] * 0.5001).all())


def test_quantize_int8_rounds_stochastically_within_a_kept_grid() -> None:
    n = 40_000
    grid = torch.tensor([[0.01, -1.0]]).expand(n, 2).contiguous()  # codes 0..255: [-1, 1.55]
    start = torch.full((n, 2), -1.0)
    start[:, 1] = 1.55  # both ends of the grid: it fits, and is kept
    moved = start.clone()
    moved[:, 0] += 0.0025  # a quarter of a step
    codes, scale_bias = quantize_int8(moved, _draw_bits(n, 2), grid)
    assert torch.equal(scale_bias, grid)
    assert set(codes[:, 0].unique().tolist()) <= {0, 1}
    assert abs(codes[:, 0].float().mean().item() - 0.25) < 0.01  # unbiased
    assert bool((codes[:, 1] == 255).all())  # an unmoved value keeps its code
    # A value that leaves the grid re-grids its row on its new minimum and maximum.
    out = start[:1].clone()
    out[0, 0] = -2.0
    codes, scale_bias = quantize_int8(out, _draw_bits(1, 2), grid[:1])
    torch.testing.assert_close(scale_bias[0], torch.tensor([3.55 / 255, -2.0]))
    assert codes.tolist() == [[0, 255]]
    # A constant row has scale 0 and decodes to its value exactly.
    codes, scale_bias = quantize_int8(torch.full((1, 3), 0.3))
    assert torch.equal(decode_rows(codes, scale_bias), torch.full((1, 3), 0.3))


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "int8"])
def test_rowwise_adagrad_matches_the_formula_and_touches_only_batch_rows(precision: str) -> None:
    store = ShardedEmbedding(
        SIZES, DIM, "rowwise_adagrad", lr=0.1, seed=0, table_precision=precision
    )
    before = store.weight.clone()
    assert before.dtype == TABLE_DTYPES[precision]
    assert store.state["sum_sq"].dtype == torch.float32
    grid = store.scale_bias.clone() if store.scale_bias is not None else None
    values = decode_rows(before, grid)
    ids = torch.tensor([3, 3, 10, 24])
    rows, inverse, context = store.lookup(ids)
    assert torch.equal(context.unique_ids, torch.tensor([3, 10, 24]))
    assert rows.dtype == torch.float32  # the lookup upcasts (decodes int8)
    assert torch.equal(rows.detach(), values[[3, 10, 24]])
    (rows[inverse] * torch.arange(4.0)[:, None]).sum().backward()
    grad = rows.grad.clone()  # rows 3: 0 + 1, 10: 2, 24: 3 (times ones)
    store.accumulate_gradients(rows.grad, context)
    assert store.step() == 3
    for row, g in zip([3, 10, 24], grad, strict=True):
        sum_sq = g.pow(2).mean()
        expected = values[row] - 0.1 * g / (sum_sq.sqrt() + ADAGRAD_EPS)
        bits = rounding_bits(0, 1, torch.tensor([row]), DIM)  # (seed 0, step 1, row)
        if precision == "fp32":
            torch.testing.assert_close(store.weight[row], expected)
        elif precision == "int8":  # the fp32 update, quantized on the row's grid
            codes, scale_bias = quantize_int8(expected[None], bits, grid[row : row + 1])
            assert torch.equal(store.weight[row], codes[0])
            assert torch.equal(store.scale_bias[row], scale_bias[0])
        else:  # the fp32 update, rounded with those bits
            rounded = stochastic_round(expected[None], store.weight.dtype, bits)[0]
            assert torch.equal(store.weight[row], rounded)
        assert store.state["sum_sq"][row] == pytest.approx(float(sum_sq))
    untouched = torch.ones(sum(SIZES), dtype=torch.bool)
    untouched[[3, 10, 24]] = False
    assert torch.equal(store.weight[untouched], before[untouched])


def test_lazy_adam_matches_torch_adam_on_the_touched_rows() -> None:
    store = ShardedEmbedding(SIZES, DIM, "lazy_adam", lr=0.01, seed=0)
    reference = torch.nn.Parameter(store.weight[[2, 9]].clone())
    adam = torch.optim.Adam([reference], lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    for step in range(3):
        rows, inverse, context = store.lookup(torch.tensor([2, 9]))
        weights = torch.tensor([[1.0 + step, -2.0, 0.5, 3.0]])
        (rows * weights).sum().backward()
        store.accumulate_gradients(rows.grad, context)
        store.step()
        adam.zero_grad()
        (reference * weights).sum().backward()
        adam.step()
    torch.testing.assert_close(store.weight[[2, 9]], reference.detach())


def test_admission_shares_a_default_until_k_sightings() -> None:
    store = ShardedEmbedding(SIZES, DIM, "rowwise_adagrad", lr=0.1, admission_min_count=3)
    before = store.weight.clone()
    _, _, context = store.lookup(torch.tensor([5, 5, 6]))
    assert context.admitted.tolist() == [False, False]
    rows, inverse, context = store.lookup(torch.tensor([5, 6]))
    assert context.admitted.tolist() == [True, False]  # 5 seen 3 times, 6 twice
    rows.sum().backward()
    store.accumulate_gradients(rows.grad, context)
    assert store.step() == 1  # only the admitted row moves
    assert not torch.equal(store.weight[5], before[5])
    assert torch.equal(store.weight[6], before[6])
    # Evaluation lookups read without counting.
    _, _, context = store.lookup(torch.tensor([6]), train=False)
    assert context.admitted.tolist() == [False]


def test_out_of_range_ids_are_refused() -> None:
    store = ShardedEmbedding(SIZES, DIM, "rowwise_adagrad", lr=0.1)
    with pytest.raises(ValueError, match=r"\[0, 25\)"):
        store.lookup(torch.tensor([25]))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_main(
    rank: int,
    world: int,
    port: int,
    out: str,
    optimizer: str,
    admission: int,
    grad_clip: float,
    precision: str,
    comm: str = "fp32",
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    store = ShardedEmbedding(
        SIZES, DIM, optimizer, lr=0.05, admission_min_count=admission, seed=1,
        rank=rank, world_size=world, max_grad_norm=grad_clip, table_precision=precision,
        comm_precision=comm,
    )  # fmt: skip
    _train(store, _global_batches(steps=6, batch=8), rank, world)
    torch.save(store.state_dict(), Path(out) / f"rank{rank}.pt")
    torch.save(store.wire_bytes, Path(out) / f"wire{rank}.pt")
    dist.destroy_process_group()


def _run_two_ranks(out: Path, *args: object) -> list[dict]:
    """`_rank_main` on 2 spawned gloo ranks; each rank's saved shard state."""
    # Fresh interpreters, not forks: the test process runs threads (Prefect, moto, rich)
    # by now, and a fork inherits whatever lock one of them held.
    out.mkdir(parents=True, exist_ok=True)
    context = mp.get_context("spawn")
    port = _free_port()
    processes = [
        context.Process(target=_rank_main, args=(rank, 2, port, str(out), *args))
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        assert process.exitcode == 0
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize(
    ("optimizer", "admission", "grad_clip", "precision"),
    [
        ("rowwise_adagrad", 0, 0.0, "fp32"),
        ("lazy_adam", 0, 0.0, "fp32"),
        ("rowwise_adagrad", 2, 0.0, "fp32"),
        # About half the rows' gradients are longer than 0.1: clipped once summed.
        ("rowwise_adagrad", 0, 0.1, "fp32"),
        # 2-byte rows: the rounding bits follow the global row, not the rank.
        ("lazy_adam", 0, 0.0, "fp16"),
        ("rowwise_adagrad", 2, 0.0, "bf16"),
        ("rowwise_adagrad", 0, 0.0, "int8"),
    ],
)
def test_two_ranks_equal_one_process(
    tmp_path: Path, optimizer: str, admission: int, grad_clip: float, precision: str
) -> None:
    """Rows after 6 steps on 2 gloo ranks (batch 4 each) = 1 process with batch 8."""
    shards = _run_two_ranks(tmp_path, optimizer, admission, grad_clip, precision)
    two_ranks = gather_full_table([s["weight"] for s in shards], sum(SIZES))

    reference = ShardedEmbedding(
        SIZES, DIM, optimizer, lr=0.05, admission_min_count=admission, seed=1,
        max_grad_norm=grad_clip, table_precision=precision,
    )  # fmt: skip
    _train(reference, _global_batches(steps=6, batch=8), 0, 1)
    dtype = TABLE_DTYPES[precision]
    initial = init_table(SIZES, DIM, 1, precision=precision)["weight"]
    assert not torch.equal(reference.weight, initial)
    if grad_clip:
        unclipped = ShardedEmbedding(SIZES, DIM, optimizer, lr=0.05, seed=1)
        _train(unclipped, _global_batches(steps=6, batch=8), 0, 1)
        assert not torch.allclose(unclipped.weight, reference.weight)  # the clip acted
    if precision == "fp32":
        torch.testing.assert_close(two_ranks, reference.weight, rtol=1e-6, atol=1e-7)
        return
    # fp32 sums differ in the last bit with the order of ranks, which can flip a rounding
    # now and then (by one unit in the last place); bits keyed by the local row, or by
    # the rank, would change most of the updated elements.
    assert two_ranks.dtype == dtype
    updated = reference.weight != initial
    same = two_ranks == reference.weight
    assert int((updated & same).sum()) >= 0.95 * int(updated.sum())
    if precision == "int8":  # a code is one grid step; the grids agree to the last bits
        grids = gather_full_table([s[SCALE_BIAS] for s in shards], sum(SIZES))
        torch.testing.assert_close(grids, reference.scale_bias, rtol=1e-5, atol=1e-7)
        assert bool(((two_ranks.int() - reference.weight.int()).abs() <= 1).all())
        return
    steps = (two_ranks.float() - reference.weight.float()).abs()
    ulp = reference.weight.float().abs().clamp(min=2.0**-14) * torch.finfo(dtype).eps
    assert bool((steps <= ulp * 1.01).all())


def test_accumulated_micro_batches_update_once_with_the_summed_gradient() -> None:
    accumulated = ShardedEmbedding(SIZES, DIM, "lazy_adam", lr=0.05, seed=2)
    single = ShardedEmbedding(SIZES, DIM, "lazy_adam", lr=0.05, seed=2)
    first, second = torch.tensor([1, 4, 4, 20]), torch.tensor([4, 9, 20])
    for ids in (first, second):  # two micro steps, one optimizer step
        rows, inverse, context = accumulated.lookup(ids)
        rows[inverse].pow(2).sum().backward()
        accumulated.accumulate_gradients(rows.grad, context)
    assert accumulated.step() == 4
    rows, inverse, context = single.lookup(torch.cat([first, second]))
    rows[inverse].pow(2).sum().backward()
    single.accumulate_gradients(rows.grad, context)
    single.step()
    torch.testing.assert_close(accumulated.weight, single.weight)
    assert accumulated.steps == single.steps == 1


def test_weight_decay_adds_l2_to_the_updated_rows_only() -> None:
    decayed = ShardedEmbedding(SIZES, DIM, "rowwise_adagrad", lr=0.1, seed=3, weight_decay=0.5)
    before = decayed.weight.clone()
    rows, inverse, context = decayed.lookup(torch.tensor([4, 11]))
    (rows[inverse] * 2.0).sum().backward()
    decayed.accumulate_gradients(rows.grad, context)
    decayed.step()
    for row in (4, 11):
        grad = 2.0 + 0.5 * before[row]  # the loss gradient plus the L2 term
        sum_sq = grad.pow(2).mean()
        expected = before[row] - 0.1 * grad / (sum_sq.sqrt() + ADAGRAD_EPS)
        torch.testing.assert_close(decayed.weight[row], expected)
    untouched = torch.ones(sum(SIZES), dtype=torch.bool)
    untouched[[4, 11]] = False
    assert torch.equal(decayed.weight[untouched], before[untouched])


def _step_with(
    store: ShardedEmbedding, ids: list[int], grads: torch.Tensor, grad_scale: float = 1.0
) -> None:
    """One optimizer step in which row ids[i] (sorted, unique) gets the gradient grads[i]."""
    rows, _, context = store.lookup(torch.tensor(ids))
    (rows * grads).sum().backward()  # d loss / d rows = grads, (U, D)
    store.accumulate_gradients(rows.grad, context)
    store.step(grad_scale)


# Row 4's gradient has L2 norm 13 (above the clip 1), row 11's 0.5 (below it).
BIG, SMALL = torch.tensor([3.0, -4.0, 0.0, 12.0]), torch.tensor([0.3, 0.4, 0.0, 0.0])


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "lazy_adam"])
def test_grad_clip_updates_a_row_as_if_its_gradient_had_the_clip_norm(optimizer: str) -> None:
    clipped = ShardedEmbedding(SIZES, DIM, optimizer, lr=0.1, seed=3, max_grad_norm=1.0)
    twin = ShardedEmbedding(SIZES, DIM, optimizer, lr=0.1, seed=3)  # fed clipped gradients
    _step_with(clipped, [4, 11], torch.stack([BIG, SMALL]))
    _step_with(twin, [4, 11], torch.stack([BIG / 13, SMALL]))
    # The row below the clip is untouched by it: bit for bit what no clipping gives.
    assert torch.equal(clipped.weight[11], twin.weight[11])
    if optimizer == "rowwise_adagrad":
        # The accumulator holds the mean squared gradient: norm^2 / D.
        assert float(clipped.state["sum_sq"][4]) == pytest.approx(1.0 / DIM)
        assert float(clipped.state["sum_sq"][11]) == pytest.approx(0.25 / DIM)
    # Step 2 swaps them: now row 11 is clipped and row 4 is not.
    _step_with(clipped, [4, 11], torch.stack([SMALL, BIG]))
    _step_with(twin, [4, 11], torch.stack([SMALL, BIG / 13]))
    torch.testing.assert_close(clipped.weight, twin.weight, rtol=0, atol=1e-7)
    for name, state in clipped.state.items():
        torch.testing.assert_close(state, twin.state[name], rtol=1e-6, atol=0)
    unclipped = ShardedEmbedding(SIZES, DIM, optimizer, lr=0.1, seed=3)
    _step_with(unclipped, [4, 11], torch.stack([BIG, SMALL]))
    _step_with(unclipped, [4, 11], torch.stack([SMALL, BIG]))
    assert not torch.allclose(unclipped.weight[[4, 11]], clipped.weight[[4, 11]])


def test_grad_clip_zero_disables_it() -> None:
    store = ShardedEmbedding(SIZES, DIM, "rowwise_adagrad", lr=0.1, seed=3, max_grad_norm=0.0)
    _step_with(store, [4, 11], torch.stack([BIG, SMALL]))
    assert float(store.state["sum_sq"][4]) == pytest.approx(169.0 / DIM)


def test_grad_clip_applies_to_the_unscaled_gradient_before_weight_decay() -> None:
    # fp16: the rows receive the loss-scaled gradient; the clip sees it unscaled.
    scaled = ShardedEmbedding(SIZES, DIM, "lazy_adam", lr=0.1, seed=3, max_grad_norm=1.0)
    plain = ShardedEmbedding(SIZES, DIM, "lazy_adam", lr=0.1, seed=3, max_grad_norm=1.0)
    _step_with(scaled, [4, 11], torch.stack([BIG, SMALL]) * 128, grad_scale=128)
    _step_with(plain, [4, 11], torch.stack([BIG, SMALL]))
    torch.testing.assert_close(scaled.state["exp_avg"], plain.state["exp_avg"])
    # The L2 penalty is added to the clipped gradient, not clipped with it.
    decayed = ShardedEmbedding(
        SIZES, DIM, "rowwise_adagrad", lr=0.1, seed=3, weight_decay=0.5, max_grad_norm=1.0
    )
    before = decayed.weight.clone()
    _step_with(decayed, [4, 11], torch.stack([BIG, SMALL]))
    grad = BIG / 13 + 0.5 * before[4]
    assert float(decayed.state["sum_sq"][4]) == pytest.approx(float(grad.pow(2).mean()))


def test_reshard_state_moves_every_row_with_its_optimizer_state() -> None:
    sizes = [7, 5, 11]  # 23 rows: uneven shards for every world size below

    def shards(world_size: int) -> list[dict]:
        out = []
        for rank in range(world_size):
            shard = ShardedEmbedding(sizes, 4, "lazy_adam", 0.1, 2, 0, rank, world_size)
            shard.steps = 5
            local = torch.arange(rank, 23, world_size, dtype=torch.float32)  # global row ids
            shard.state["exp_avg"] += local[:, None]
            shard.counts += local.long()
            out.append(shard.state_dict())
        return out

    for old, new in [(2, 3), (3, 1), (1, 2), (2, 2)]:
        source = shards(old)
        for rank in range(new):
            moved = reshard_state(source, 23, rank, new)
            expected = shards(new)[rank]
            assert moved.keys() == expected.keys()
            for name in expected:
                assert torch.equal(moved[name], expected[name]), (old, new, rank, name)
            target = ShardedEmbedding(sizes, 4, "lazy_adam", 0.1, 2, 0, rank, new)
            target.load_state_dict(moved)
            assert target.steps == 5


@pytest.mark.parametrize(
    ("size", "bound"),
    [(0, 10), (1, 1), (5, 3), (16_384, 1_000_000), (3_000, 2**40), (100, 2**62)],
)
def test_unique_inverse_equals_torch_unique(size: int, bound: int) -> None:
    # The packed-key sort (and its torch.unique fallback when the key needs > 63 bits)
    # must give exactly torch.unique's sorted ids, inverse and counts.
    generator = torch.Generator().manual_seed(size)
    ids = (torch.rand(size, generator=generator, dtype=torch.float64) * bound).long()
    ids = torch.cat([ids, ids[: size // 3]])  # duplicates
    expected = torch.unique(ids, sorted=True, return_inverse=True, return_counts=True)
    unique, inverse, counts = unique_inverse(ids, bound, with_counts=True)
    assert torch.equal(unique, expected[0])
    assert torch.equal(inverse, expected[1])
    assert counts is not None and torch.equal(counts, expected[2])
    assert unique_inverse(ids, bound)[2] is None


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_group_by_owner_is_the_stable_argsort(world_size: int) -> None:
    owner = torch.randint(0, world_size, (5_000,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(group_by_owner(owner, world_size), torch.argsort(owner, stable=True))


@pytest.mark.parametrize(("size", "bound"), [(0, 10), (7, 3), (20_000, 50_000), (500, 2**62)])
def test_sum_rows_equals_index_add_in_order(size: int, bound: int) -> None:
    # Each row's values summed in their order of arrival, as index_add_ sums them.
    generator = torch.Generator().manual_seed(size)
    rows = (torch.rand(size, generator=generator, dtype=torch.float64) * bound).long()
    values = torch.randn((size, 3), generator=generator)
    unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    expected = torch.zeros((unique.numel(), 3)).index_add_(0, inverse, values)
    got_rows, got = sum_rows(rows, values, bound)
    assert torch.equal(got_rows, unique)
    assert torch.equal(got, expected)


def test_warm_start_carries_kept_rows_and_starts_new_and_reset_rows_afresh() -> None:
    # The parent: tables [4, 3] trained on 2 ranks (random rows and Adagrad state).
    old_sizes, new_sizes = [4, 3], [6, 3]  # feature 0 grew by 2 rows; offsets moved
    reset = [[1], [2]]  # feature 0's row 1 and feature 1's row 2 changed ids
    generator = torch.Generator().manual_seed(0)
    shards = []
    for rank in range(2):
        store = ShardedEmbedding(
            old_sizes, DIM, "rowwise_adagrad", 0.1, seed=3, rank=rank, world_size=2
        )
        store.weight.copy_(torch.randn(store.weight.shape, generator=generator))
        store.state["sum_sq"].copy_(torch.rand(store.weight.shape[0], generator=generator))
        store.steps = 7
        shards.append({k: v.clone() for k, v in store.state_dict().items()})
    parent = gather_full_table([s["weight"] for s in shards], 7)
    parent_sum = gather_full_table([s["sum_sq"][:, None] for s in shards], 7)[:, 0]

    tables = {}
    for world_size in (1, 2, 3):
        states = [
            warm_start_state(shards, old_sizes, new_sizes, reset, DIM, 5, rank, world_size)
            for rank in range(world_size)
        ]
        assert all(int(state["steps"]) == 7 for state in states)
        weight = gather_full_table([state["weight"] for state in states], 9)
        sum_sq = gather_full_table([state["sum_sq"][:, None] for state in states], 9)[:, 0]
        tables[world_size] = (weight, sum_sq)
    # The same table whatever the parent's and this run's world sizes.
    for world_size in (2, 3):
        assert torch.equal(tables[world_size][0], tables[1][0])
        assert torch.equal(tables[world_size][1], tables[1][1])
    weight, sum_sq = tables[1]
    fresh = init_rows(new_sizes, DIM, 5)
    kept = {0: 0, 2: 2, 3: 3, 6: 4, 7: 5}  # new global row -> parent global row
    for new_row, old_row in kept.items():
        assert torch.equal(weight[new_row], parent[old_row])
        assert sum_sq[new_row] == parent_sum[old_row]
    for new_row in (1, 4, 5, 8):  # reset (1, 8) and grown (4, 5): initial, no state
        assert torch.equal(weight[new_row], fresh[new_row])
        assert sum_sq[new_row] == 0


def test_warm_start_refuses_a_table_that_shrank() -> None:
    store = ShardedEmbedding([4, 3], DIM, "rowwise_adagrad", 0.1)
    with pytest.raises(ValueError, match="only grows tables"):
        warm_start_state([store.state_dict()], [4, 3], [3, 3], [[], []], DIM, 0, 0, 1)
    with pytest.raises(ValueError, match="same features"):
        warm_start_state([store.state_dict()], [4, 3], [4], [[]], DIM, 0, 0, 1)


# -- table precision ----------------------------------------------------------------------


def test_rounding_bits_are_a_function_of_seed_step_row_and_column() -> None:
    rows = torch.tensor([0, 5, 9, 1_000_000_007])
    bits = rounding_bits(7, 3, rows, 6)
    assert bits.shape == (4, 6) and bits.dtype == torch.int32
    assert torch.equal(bits, rounding_bits(7, 3, rows, 6))  # deterministic
    # A row's bits do not depend on the other rows of the call (nor on their order).
    assert torch.equal(rounding_bits(7, 3, torch.tensor([9]), 6)[0], bits[2])
    assert torch.equal(rounding_bits(7, 3, rows.flip(0), 6), bits.flip(0))
    # Nor on D beyond their own column: the first 4 columns are the same at D = 4.
    assert torch.equal(rounding_bits(7, 3, rows, 4), bits[:, :4])
    for other in (rounding_bits(8, 3, rows, 6), rounding_bits(7, 4, rows, 6)):
        assert int((other == bits).sum()) <= 2  # seed and step change (almost) every draw
    assert len(set(bits[1].tolist())) == 6  # the columns differ
    many = rounding_bits(-1, 2**40, torch.arange(20_000), 16)  # any int seed and step
    assert int(many.min()) >= 0 and int(many.max()) < 2**16
    # Uniform: each of 16 bins of the 16-bit range holds about 1/16 of 320k draws.
    counts = torch.bincount((many // 4096).flatten(), minlength=16).double()
    assert float((counts / counts.sum() - 1 / 16).abs().max()) < 0.002


def _draw_bits(n: int, dim: int = 1) -> torch.Tensor:
    return rounding_bits(11, 1, torch.arange(n), dim)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(
    "value", [0.1, -0.1, 1e-6, -3.3e-5, -6.1e-5, 6.2e-5, 1.0 + 2**-12, 0.3333, -700.3]
)
def test_stochastic_round_is_unbiased_and_picks_a_neighbour(
    dtype: torch.dtype, value: float
) -> None:
    # 1e-6, -3.3e-5 and -6.1e-5 are below fp16's 2**-14 (its subnormals, spaced 2**-24);
    # 6.2e-5 is just above it.
    n = 40_000
    x = torch.full((n, 1), value)
    rounded = stochastic_round(x, dtype, _draw_bits(n))
    assert rounded.dtype == dtype
    x32 = torch.tensor(value)  # fp32, as the table's updates are
    values = {float(v) for v in rounded.float()}
    assert len(values) == 2, values  # both neighbours occur
    down, up = sorted(values)
    assert down <= float(x32) <= up
    assert torch.tensor(down, dtype=dtype).float() == down and up > down
    assert torch.nextafter(torch.tensor(down, dtype=dtype), torch.tensor(up, dtype=dtype)) == up
    # Unbiased: the mean is x within 4 standard errors of the Bernoulli draw.
    p = (float(x32) - down) / (up - down)
    sigma = (up - down) * (p * (1 - p) / n) ** 0.5
    assert abs(float(rounded.double().mean()) - float(x32)) <= 4 * sigma + 1e-12


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_round_keeps_representable_values(dtype: torch.dtype) -> None:
    exact = torch.tensor([[0.0, -0.0, 1.0, -(2.0**-20), 0.5, -3.0, 2.0**-24, 1024.0]])
    exact = exact.to(dtype).float().repeat(1000, 1)
    bits = _draw_bits(1000, exact.shape[1])
    assert torch.equal(stochastic_round(exact, dtype, bits).float(), exact)


@pytest.mark.parametrize("dtype", HALF)
def test_a_quarter_ulp_update_moves_a_quarter_of_the_rows(dtype: torch.dtype) -> None:
    # Rounding to nearest would drop every such update; stochastic rounding keeps its mean.
    n = 20_000
    start = torch.full((n, 1), 1.0)
    ulp = float(torch.finfo(dtype).eps)  # spacing above 1.0
    rounded = stochastic_round(start + ulp / 4, dtype, _draw_bits(n)).float()
    moved = float((rounded != 1.0).double().mean())
    assert moved == pytest.approx(0.25, abs=0.02)
    assert (start + ulp / 4).to(dtype).float().eq(1.0).all()  # round to nearest moves none


def test_stochastic_round_beyond_fp16s_range_is_inf() -> None:
    x = torch.tensor([[70_000.0, -1e6, 65_504.0]]).repeat(100, 1)
    rounded = stochastic_round(x, torch.float16, _draw_bits(100, 3))
    assert rounded[:, :2].isinf().all() and (rounded[:, 2] == 65_504).all()
    assert stochastic_round(x, torch.bfloat16, _draw_bits(100, 3)).isfinite().all()


def test_stochastic_round_refuses_fp32() -> None:
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        stochastic_round(torch.zeros(1, 1), torch.float32, torch.zeros(1, 1, dtype=torch.int32))


@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8"])
def test_a_resumed_compact_table_is_bitwise_the_uninterrupted_one(
    tmp_path: Path, precision: str
) -> None:
    batches = _global_batches(steps=6, batch=8)

    def store() -> ShardedEmbedding:
        return ShardedEmbedding(
            SIZES, DIM, "lazy_adam", lr=0.05, admission_min_count=2, seed=4,
            table_precision=precision,
        )  # fmt: skip

    straight = store()
    _train(straight, batches, 0, 1)
    first = store()
    _train(first, batches[:3], 0, 1)
    save_file(first.state_dict(), str(tmp_path / "shard.safetensors"))
    resumed = store()
    resumed.load_state_dict(load_file(str(tmp_path / "shard.safetensors")))
    _train(resumed, batches[3:], 0, 1)
    for name, tensor in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name
    assert straight.state["exp_avg"].dtype == torch.float32  # the state stays fp32
    # Checkpoints are stored at table precision: the rows take half the bytes, int8 a
    # quarter plus 8 bytes a row.
    fp32 = ShardedEmbedding(SIZES, DIM, "lazy_adam", lr=0.05, seed=4)
    row_bytes = sum(
        straight.state_dict()[name].nbytes for name in ("weight", SCALE_BIAS) if name in
        straight.state_dict()
    )  # fmt: skip
    expected = {"fp16": 2 * DIM, "bf16": 2 * DIM, "int8": DIM + 8}[precision] * sum(SIZES)
    assert row_bytes == expected and fp32.weight.nbytes == 4 * DIM * sum(SIZES)
    # A resume does not convert: rows of another precision are refused, naming both.
    with pytest.raises(ValueError, match=f"rows are {precision} but .*table_precision is fp32"):
        fp32.load_state_dict(
            {**straight.state_dict(), "counts": torch.zeros(25, dtype=torch.int64)}
        )


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_reshard_state_keeps_the_table_precision(precision: str) -> None:
    shards = [
        ShardedEmbedding(SIZES, DIM, "rowwise_adagrad", 0.1, 0, 3, r, 2, table_precision=precision)
        for r in range(2)
    ]
    moved = reshard_state([s.state_dict() for s in shards], sum(SIZES), 0, 1)
    assert moved["weight"].dtype == TABLE_DTYPES[precision]
    assert moved["sum_sq"].dtype == torch.float32
    for name, tensor in init_table(SIZES, DIM, 3, precision=precision).items():
        assert torch.equal(moved[name], tensor), name  # int8 rows move with their grid


@pytest.mark.parametrize(
    ("parent", "child"),
    [("fp32", "bf16"), ("fp16", "fp32"), ("bf16", "fp16"), ("fp32", "int8"), ("int8", "fp16"),
     ("int8", "int8")],
)  # fmt: skip
def test_warm_start_converts_the_parent_rows_to_this_precision(parent: str, child: str) -> None:
    old_sizes, new_sizes, reset = [4, 3], [6, 3], [[1], []]
    generator = torch.Generator().manual_seed(1)
    shards = []
    for rank in range(2):
        store = ShardedEmbedding(
            old_sizes, DIM, "rowwise_adagrad", 0.1, seed=3, rank=rank, world_size=2,
            table_precision=parent,
        )  # fmt: skip
        stored = encode_rows(torch.randn(store.weight.shape, generator=generator), parent)
        for name, tensor in stored.items():
            store.state_dict()[name].copy_(tensor)
        shards.append({k: v.clone() for k, v in store.state_dict().items()})
    parent_table = {
        name: gather_full_table([s[name] for s in shards], 7) for name in stored
    }  # the parent's stored rows, in global order
    parent_rows = decode_rows(parent_table["weight"], parent_table.get(SCALE_BIAS))
    state = warm_start_state(shards, old_sizes, new_sizes, reset, DIM, 5, 0, 1, child)
    assert state["weight"].dtype == TABLE_DTYPES[child] and state["sum_sq"].dtype == torch.float32
    fresh = init_table(new_sizes, DIM, 5, precision=child)
    carried = {0: 0, 2: 2, 3: 3, 6: 4, 7: 5, 8: 6}  # new row: parent row
    if parent == child:  # the stored form itself
        converted = {name: tensor[list(carried.values())] for name, tensor in parent_table.items()}
    else:  # decoded to fp32 (exact), rounded to nearest at this precision
        converted = encode_rows(parent_rows[list(carried.values())], child)
    assert set(state) >= set(fresh)
    for name in fresh:
        assert torch.equal(state[name][list(carried)], converted[name]), name
        assert torch.equal(state[name][[1, 4, 5]], fresh[name][[1, 4, 5]]), name
    ShardedEmbedding(new_sizes, DIM, "rowwise_adagrad", 0.1, table_precision=child).load_state_dict(
        state
    )


def test_warm_start_refuses_rows_beyond_the_precision_range() -> None:
    store = ShardedEmbedding([4, 3], DIM, "rowwise_adagrad", 0.1, table_precision="bf16")
    store.weight[2, 0] = 1e6  # fine in bf16, beyond fp16's 65504
    with pytest.raises(ValueError, match="table_precision: fp16"):
        warm_start_state([store.state_dict()], [4, 3], [4, 3], [[], []], DIM, 0, 0, 1, "fp16")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_sent_gradients_come_back_within_the_precisions_rounding(precision: str) -> None:
    generator = torch.Generator().manual_seed(0)
    # Rows of magnitudes from 1e-30 to 1e10, a zero row and a row with one tiny value.
    grad = torch.randn(64, 8, generator=generator) * torch.logspace(-30, 10, 64)[:, None]
    grad[5] = 0.0
    grad[6, 3] = 1e-6 * float(grad[6].abs().max())
    sent = encode_grads(grad, precision)
    back = decode_grads(sent, precision)
    assert back.dtype == torch.float32 and bool(torch.isfinite(back).all())
    if precision == "fp32":
        assert torch.equal(back, grad)
        return
    # Relative to each row's largest value: the wire type's unit roundoff, whatever the
    # row's magnitude. Without fp16's per-row scale the rows below ~1e-8 would be zeros.
    largest = grad.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    unit = {"bf16": 2.0**-8, "fp16": 2.0**-11}[precision]
    assert float(((back - grad).abs() / largest).max()) <= unit
    assert torch.equal(back[5], grad[5])
    if precision == "fp16":
        assert sent.dtype == torch.float16 and sent.shape == (64, 9)  # + the scale column
        assert bool((back[:, :].abs().amax(dim=1) > 0)[grad.abs().amax(dim=1) > 0].all())


def test_ids_travel_in_the_narrowest_integer_type() -> None:
    assert narrowest_int(0) == torch.int16
    assert narrowest_int(2**15 - 1) == torch.int16
    assert narrowest_int(2**15) == torch.int32
    assert narrowest_int(2**31 - 1) == torch.int32
    assert narrowest_int(2**31) == torch.int64


def test_a_bad_comm_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="comm_precision must be one of"):
        ShardedEmbedding(SIZES, DIM, "rowwise_adagrad", lr=0.1, comm_precision="fp8")


@pytest.mark.parametrize(("comm", "admission"), [("bf16", 0), ("fp16", 2)])
def test_two_ranks_at_a_half_comm_precision_send_half_the_bytes_and_stay_close(
    tmp_path: Path, comm: str, admission: int
) -> None:
    """2 ranks exchanging half-precision rows and gradients: the bytes by kind against an
    fp32 exchange of the same steps, and rows within the rounding of a 1-process run."""
    exact = _run_two_ranks(tmp_path / "fp32", "rowwise_adagrad", admission, 0.0, "fp32", "fp32")
    half = _run_two_ranks(tmp_path / comm, "rowwise_adagrad", admission, 0.0, "fp32", comm)
    wire = {
        name: [torch.load(tmp_path / name / f"wire{r}.pt") for r in range(2)]
        for name in ("fp32", comm)
    }
    for rank in range(2):
        full, narrow = wire["fp32"][rank], wire[comm][rank]
        assert full["rows"] > 0 and full["row_grads"] > 0 and full["ids"] > 0
        # Forward rows (with admission, the admitted flag column too) at 2 bytes, not 4.
        assert narrow["rows"] * 2 == full["rows"]
        # fp16 gradients carry one scale column per row: (D + 1) values of 2 bytes.
        extra = (DIM + 1) / DIM if comm == "fp16" else 1.0
        assert narrow["row_grads"] == pytest.approx(full["row_grads"] / 2 * extra)
        # The ids do not depend on the comm precision, and already travel narrowed.
        assert narrow["ids"] == full["ids"]
    reference = ShardedEmbedding(
        SIZES, DIM, "rowwise_adagrad", lr=0.05, admission_min_count=admission, seed=1
    )
    _train(reference, _global_batches(steps=6, batch=8), 0, 1)
    two_ranks = gather_full_table([s["weight"] for s in half], sum(SIZES))
    exact_rows = gather_full_table([s["weight"] for s in exact], sum(SIZES))
    torch.testing.assert_close(exact_rows, reference.weight, rtol=1e-6, atol=1e-7)
    assert not torch.equal(two_ranks, exact_rows)  # the rounding did act
    # Six updates of lr 0.05, each off by at most the wire's rounding of a row or a
    # gradient: far below the updates themselves.
    torch.testing.assert_close(two_ranks, reference.weight, rtol=0, atol=2e-3)
