"""Differential checkpoints of a shard: the changed rows, keyed by global row.

A base plus the deltas taken after it, applied in order, gives the shard's state
exactly, on the world size that took them and on any other.
"""

import pytest
import torch

from training.ctr.embedding import (
    DELTA_ROWS,
    ShardedEmbedding,
    apply_delta,
    reshard_state,
)

SIZES = [40, 25, 35]  # 100 rows
NUM_ROWS = sum(SIZES)


def train(store: ShardedEmbedding, ids: list[int], seed: int) -> None:
    """One optimizer step on a batch of global ids with a seeded gradient."""
    rows, _, context = store.lookup(torch.tensor(ids))
    grads = torch.randn(rows.shape, generator=torch.Generator().manual_seed(seed))
    (rows * grads).sum().backward()
    store.accumulate_gradients(rows.grad, context)
    store.step()


def snapshot(store: ShardedEmbedding) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in store.state_dict().items()}


@pytest.mark.parametrize(
    ("optimizer", "precision", "admission"),
    [("rowwise_adagrad", "fp32", 0), ("lazy_adam", "int8", 0), ("rowwise_adagrad", "fp16", 2)],
)
def test_a_base_and_its_deltas_rebuild_the_shard_on_any_world_size(
    optimizer: str, precision: str, admission: int
) -> None:
    store = ShardedEmbedding(
        SIZES, 4, optimizer, lr=0.1, seed=5, table_precision=precision,
        admission_min_count=admission,
    )  # fmt: skip
    base = snapshot(store)
    assert store.dirty_rows() == 0
    deltas = []
    for chunk, ids in enumerate(([3, 7, 7, 50], [3, 99, 60], [11], [12, 11])):
        train(store, ids, seed=chunk)
        touched = sorted(set(ids))
        assert store.dirty_rows() == len(touched)
        delta = store.take_delta()
        assert delta[DELTA_ROWS].tolist() == touched  # one rank: global rows are local
        assert store.dirty_rows() == 0
        deltas.append({name: tensor.clone() for name, tensor in delta.items()})  # reused
    final = snapshot(store)
    assert int(final["steps"]) == 4

    state = {name: tensor.clone() for name, tensor in base.items()}
    for delta in deltas:
        apply_delta(state, delta, NUM_ROWS, 0, 1, "delta")
    for name in final:
        assert torch.equal(state[name], final[name]), name

    # Two ranks resuming the same chain: each takes its rows (global g -> rank g % 2).
    for rank in (0, 1):
        state = reshard_state([base], NUM_ROWS, rank, 2)
        for delta in deltas:
            apply_delta(state, delta, NUM_ROWS, rank, 2, "delta")
        expected = reshard_state([final], NUM_ROWS, rank, 2)
        for name in expected:
            assert torch.equal(state[name], expected[name]), (rank, name)


def test_rows_that_were_only_looked_up_are_not_in_a_delta_without_admission() -> None:
    store = ShardedEmbedding(SIZES, 4, "rowwise_adagrad", lr=0.1, seed=5)
    store.lookup(torch.tensor([1, 2, 3]), train=False)
    assert store.dirty_rows() == 0
    whole = store.take_delta(whole=True)
    assert whole[DELTA_ROWS].tolist() == list(range(NUM_ROWS))


def test_loading_a_state_leaves_no_row_dirty() -> None:
    store = ShardedEmbedding(SIZES, 4, "rowwise_adagrad", lr=0.1, seed=5)
    train(store, [1, 2], seed=0)
    store.load_state_dict(snapshot(store))
    assert store.dirty_rows() == 0


def test_a_delta_of_another_table_or_precision_is_refused_by_name() -> None:
    store = ShardedEmbedding(SIZES, 4, "rowwise_adagrad", lr=0.1, seed=5)
    train(store, [1, 2], seed=0)
    delta = store.take_delta()
    state = snapshot(store)
    adam = ShardedEmbedding(SIZES, 4, "lazy_adam", lr=0.1, seed=5)
    with pytest.raises(ValueError, match="d.safetensors is not a delta of this table"):
        apply_delta(snapshot(adam), delta, NUM_ROWS, 0, 1, "d.safetensors")
    outside = {**delta, DELTA_ROWS: torch.tensor([1, NUM_ROWS])}
    with pytest.raises(ValueError, match=r"d.safetensors names rows outside.*\[0, 100\)"):
        apply_delta(state, outside, NUM_ROWS, 0, 1, "d.safetensors")
    half = {**delta, "weight": delta["weight"].half()}
    with pytest.raises(ValueError, match="table precision and embedding_dim"):
        apply_delta(state, half, NUM_ROWS, 0, 1, "d.safetensors")
