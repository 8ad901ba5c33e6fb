"""The compiled compact-row update computes bitwise what the torch ops compute."""

from __future__ import annotations

import pytest
import torch

from training.ctr import embedding, kernels
from training.ctr.embedding import ShardedEmbedding, table_offsets

SIZES = [3_000, 700, 40]
DIM = 12  # not a multiple of 4: the last word's lanes are cut


@pytest.fixture(scope="module")
def kernel():
    built = kernels.rounding_kernel()
    if built is None:
        pytest.skip("the rounding kernel could not be built here (no compiler)")
    return built


def _stores(precision: str, world_size: int = 1, rank: int = 0) -> list[ShardedEmbedding]:
    return [
        ShardedEmbedding(
            SIZES,
            DIM,
            "rowwise_adagrad",
            0.05,
            seed=-5,
            rank=rank,
            world_size=world_size,
            table_precision=precision,
        )  # fmt: skip
        for _ in range(2)
    ]


def _updates(rows: int, generator: torch.Generator) -> torch.Tensor:
    """Updates of every size that matters: below a 2-byte value's spacing, around the
    rows' values (int8 values leave their grid), values that end up in fp16's subnormal
    range, zero, and exactly minus the row (a constant row)."""
    update = torch.randn((rows, DIM), generator=generator) * 1e-3
    update[::7] *= 1e-4
    update[1::7] *= 100
    update[2::7] = 0
    return update


@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize(("world_size", "rank"), [(1, 0), (3, 2)])
def test_the_kernel_equals_the_torch_ops_bitwise(
    kernel, precision: str, world_size: int, rank: int
) -> None:
    compiled, reference = _stores(precision, world_size, rank)
    generator = torch.Generator().manual_seed(3)
    local = compiled.weight.shape[0]
    for step in range(1, 6):
        rows = torch.randperm(local, generator=generator)[: local // 3].sort().values
        update = _updates(len(rows), generator)
        if step == 3:  # rows whose new values are their old values minus themselves: zero
            update[3::7] = compiled._read_rows(rows[3::7])
        if step == 4:  # tiny values: fp16's subnormal range and the sign of zero
            rows_now = compiled._read_rows(rows[4::7])
            update[4::7] = rows_now - torch.randn(rows_now.shape, generator=generator) * 1e-6
        compiled.steps = reference.steps = step * 1_000_003
        compiled._subtract_rows(rows, update)
        reference._subtract_rows_torch(rows, update)
        for name, tensor in reference.state_dict().items():
            assert torch.equal(compiled.state_dict()[name], tensor), (precision, step, name)
    assert not torch.equal(compiled.weight, _stores(precision, world_size, rank)[0].weight)


def test_training_with_the_kernel_equals_training_without(kernel, monkeypatch) -> None:
    offsets = table_offsets(SIZES)
    generator = torch.Generator().manual_seed(1)
    batches = [
        torch.stack([torch.randint(0, n, (64,), generator=generator) for n in SIZES], dim=1)
        + offsets[:-1]
        for _ in range(4)
    ]

    def train() -> dict[str, torch.Tensor]:
        store = ShardedEmbedding(
            SIZES, DIM, "lazy_adam", 0.05, seed=2, table_precision="int8", weight_decay=1e-4
        )
        for batch in batches:
            rows, inverse, context = store.lookup(batch.flatten())
            (rows[inverse].sum(dim=1) ** 2).mean().backward()
            store.accumulate_gradients(rows.grad, context)
            store.step()
        return store.state_dict()

    compiled = train()
    monkeypatch.setattr(embedding, "subtract_rows", lambda *args: False)  # torch ops only
    for name, tensor in train().items():
        assert torch.equal(compiled[name], tensor), name


def test_without_the_kernel_the_update_is_left_to_torch(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "rounding_kernel", lambda: None)
    weight = torch.zeros((4, DIM), dtype=torch.float16)
    update = torch.ones((2, DIM))
    assert not kernels.subtract_rows(weight, None, torch.tensor([0, 2]), update, 1, 0, 0, 1)
    assert not weight.any()  # nothing was changed: the caller takes the torch path


def test_the_kernel_refuses_rows_out_of_the_table(kernel) -> None:
    weight = torch.zeros((4, DIM), dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="rows out of the table"):
        kernel.subtract_rows(weight, None, torch.tensor([4]), torch.zeros((1, DIM)), 1, 0, 0, 1)
