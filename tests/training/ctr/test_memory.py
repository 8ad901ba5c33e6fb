"""The memory planner: exact byte arithmetic on tiny hand-computed plans, the budget
check, and suggestions that are re-planned to prove they fit."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest

from artifacts.errors import ConfigError
from training.config import TrainConfig
from training.ctr.memory import check_memory, plan_memory
from training.runtime.memory import (
    CHUNK_BYTES,
    COMPONENTS,
    RUNTIME_BYTES,
    GiB,
    MemoryPlan,
    MiB,
    machine_memory_bytes,
)

# The tiny case: F = 2 tables of 10 + 6 = 16 rows, D = 4, W = 3 (rank 0 holds
# ceil(16 / 3) = 6 rows), Dn = 3 dense features, P = 100 dense parameters.
SIZES = [10, 6]
DENSE_FEATURES = 3
DENSE_PARAMS = 100
# Activations, dot: per sample Dn 3 + bottom 8+4 + pooled 2*4 + interaction
# (3 vectors * 4 + 3*3 Gram + width 4+3) + top 8 + 1 logit = 60; B=2, fp32, x3 -> 1440.
# Gathered rows: min(B*F=4, 16) * D 4 * fp32 * 4 copies = 256.
ACTIVATIONS = 1440
GATHERED = 256
# Reader: (prefetch 1 + 1 in use) * B 2 * (2 ids * 8 + 3 dense * 4 + 1 label * 4) = 128.
READER = 128


def tiny_config(**update: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "embedding_dim": 4,
        "bottom_mlp": [8, 4],
        "top_mlp": [8],
        "batch_size": 2,
        "prefetch_batches": 1,
        "world_size": 1,
    }
    return TrainConfig(**(base | update))


def tiny_plan(world_size: int = 3, accelerator: str = "cpu", **update: Any) -> MemoryPlan:
    return plan_memory(
        tiny_config(**update), SIZES, DENSE_FEATURES, DENSE_PARAMS, world_size, accelerator
    )


def replan(plan: MemoryPlan, config: TrainConfig, **kwargs: Any) -> MemoryPlan:
    args: dict[str, Any] = {
        "table_sizes": list(plan.table_sizes),
        "num_dense_features": plan.num_dense_features,
        "num_dense_params": plan.num_dense_params,
        "world_size": plan.world_size,
        "accelerator": plan.accelerator,
        "feature_names": plan.feature_names or None,
    }
    return plan_memory(config, **(args | kwargs))


def refusal(plan: MemoryPlan, config: TrainConfig, budget: int, source: str, **kw: Any) -> str:
    with pytest.raises(ConfigError) as error:
        check_memory(plan, config, budget, source, **kw)
    return str(error.value)


def test_sharded_rowwise_adagrad_exact_bytes() -> None:
    plan = tiny_plan()
    assert plan.per_rank == {
        "embeddings": (6 + 2) * 4 * 4,  # 6 local rows + 2 default rows, D=4, fp32
        "sparse_optimizer": (6 + 2) * 1 * 4,  # one fp32 accumulator per row
        "admission": 0,
        "dense_params": 100 * 4,
        "dense_grads": 100 * 4,
        "dense_optimizer": 100 * 8,
        "activations": ACTIVATIONS + GATHERED,
        "reader": READER,
        "consolidation": 2 * 16 * 4 * 4,  # one chunk read, one written: the table is one chunk
        "runtime": RUNTIME_BYTES,
    }
    assert list(plan.per_rank) == list(COMPONENTS)
    assert (
        plan.total
        == sum(plan.per_rank.values())
        == 128 + 32 + 1600 + 1696 + 128 + 512 + (RUNTIME_BYTES)
    )
    assert plan.host_offload == 0 and plan.world_size == 3


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_two_byte_table_halves_the_rows_but_not_the_optimizer_state(precision: str) -> None:
    fp32 = tiny_plan()
    half = tiny_plan(table_precision=precision)
    # 6 local rows at 2 bytes; the 2 default rows are fp32 parameters.
    assert half.per_rank["embeddings"] == 6 * 4 * 2 + 2 * 4 * 4 == 80
    assert half.per_rank["sparse_optimizer"] == fp32.per_rank["sparse_optimizer"] == 32
    # The rounded update: the 4 gathered rows in fp32 and their int32 bits.
    assert half.per_rank["activations"] == ACTIVATIONS + GATHERED + 4 * 4 * 4 * 2
    assert half.per_rank["consolidation"] == fp32.per_rank["consolidation"]  # fp32 out
    assert half.total - fp32.total == 80 - 128 + 128
    # Table plus optimizer-state bytes per row at D = 16, rowwise_adagrad: 36 over 68.
    config = tiny_config(embedding_dim=16, bottom_mlp=[8, 16])
    rows = [1_000_000]
    per_row = {}
    for name in ("fp32", "fp16"):
        plan = plan_memory(config.model_copy(update={"table_precision": name}), rows, 3, 100, 1)
        per_row[name] = (plan.per_rank["embeddings"] + plan.per_rank["sparse_optimizer"]) / 1e6
    assert per_row["fp32"] == pytest.approx(68, abs=0.01)
    assert per_row["fp16"] == pytest.approx(36, abs=0.01)


def test_refusal_names_a_table_precision_that_fits() -> None:
    config, plan = big_sharded_case()
    adagrad = config.model_copy(update={"sparse_optimizer": "rowwise_adagrad"})
    adagrad_plan = replan(plan, adagrad)
    half = adagrad.model_copy(update={"table_precision": "bf16"})
    budget = replan(plan, half).total
    assert adagrad_plan.total > budget
    message = refusal(adagrad_plan, adagrad, budget, "train.memory_per_rank_gb")
    assert "  - train.table_precision: bf16 (or fp16)" in message
    assert message.index("Any one of these fits") < message.index("train.table_precision")
    assert "rowwise_adagrad" not in message  # the text names no optimizer
    check_memory(replan(plan, half), half, budget, "test")
    # Not offered again at bf16, nor for a dense table.
    half_plan = replan(plan, half)
    assert "table_precision" not in refusal(half_plan, half, half_plan.total - 1, "test")
    dense = TrainConfig(embeddings="dense", embedding_dim=16, world_size=2)
    dense_plan = plan_memory(dense, [5_000_000, 100_000], 13, 20_000, 2)
    assert "table_precision" not in refusal(dense_plan, dense, dense_plan.total - 1, "test")


def test_lazy_adam_keeps_two_moments_per_element() -> None:
    adagrad = tiny_plan()
    adam = tiny_plan(sparse_optimizer="lazy_adam")
    assert adam.per_rank["sparse_optimizer"] == (6 + 2) * 2 * 4 * 4
    assert adam.total - adagrad.total == 256 - 32


@pytest.mark.parametrize(("min_count", "counters"), [(0, 0), (1, 0), (2, 6 * 4), (5, 6 * 4)])
def test_admission_adds_an_int32_counter_per_local_row(min_count: int, counters: int) -> None:
    assert tiny_plan(admission_min_count=min_count).per_rank["admission"] == counters


@pytest.mark.parametrize(
    ("stage", "params", "grads", "optimizer", "consolidation"),
    [
        (0, 400, 400, 800, 512),
        (1, 400, 400, 34 * 8, 512 + 400),  # ceil(100 / 3) = 34 per partition
        (2, 400, 34 * 4, 34 * 8, 512 + 400),
        (3, 34 * 4, 34 * 4, 34 * 8, 512 + 400),  # streamed, but 400 B is one chunk
    ],
)
def test_zero_stages_partition_the_dense_state(
    stage: int, params: int, grads: int, optimizer: int, consolidation: int
) -> None:
    plan = tiny_plan(zero_stage=stage)
    dense = [plan.per_rank[k] for k in ("dense_params", "dense_grads", "dense_optimizer")]
    assert dense == [params, grads, optimizer]
    # ZeRO 1-2: rank 0 assembles one fp32 copy of the dense weights for model.safetensors.
    assert plan.per_rank["consolidation"] == consolidation


def test_consolidation_streams_the_table_and_zero3_in_chunks() -> None:
    # 100M rows x 16 fp32 = 6 GiB of table and 1G dense parameters (4 GiB fp32).
    config = tiny_config(embedding_dim=16, bottom_mlp=[16])
    stage = {s: config.model_copy(update={"zero_stage": s}) for s in (2, 3)}
    plans = {s: plan_memory(stage[s], [100_000_000], 3, 1 << 30, 8) for s in (2, 3)}
    assert plans[3].per_rank["consolidation"] == 3 * CHUNK_BYTES  # table 2 chunks, dense 1
    assert plans[2].per_rank["consolidation"] == 2 * CHUNK_BYTES + (1 << 30) * 4


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_keeps_fp32_masters_with_the_optimizer(precision: str) -> None:
    half = tiny_plan(precision=precision)
    dense = [half.per_rank[k] for k in ("dense_params", "dense_grads", "dense_optimizer")]
    assert dense == [100 * 2, 100 * 2, 100 * (4 + 8)]
    assert half.per_rank["embeddings"] == tiny_plan().per_rank["embeddings"]  # always fp32


def test_offload_moves_the_optimizer_off_an_accelerator_only() -> None:
    on_device = tiny_plan(accelerator="cuda", zero_stage=1)
    cuda = tiny_plan(accelerator="cuda", zero_stage=1, offload_optimizer=True)
    cpu = tiny_plan(accelerator="cpu", zero_stage=1, offload_optimizer=True)
    assert cuda.per_rank["dense_optimizer"] == 0 and cuda.host_offload == 34 * 8
    assert on_device.total - cuda.total == 34 * 8
    # The CPU accelerator's "device" is the host: the bytes move but still count.
    assert cpu.per_rank["dense_optimizer"] == 34 * 8 and cpu.host_offload == 34 * 8
    assert cpu.total == on_device.total


def test_dense_embeddings_are_dense_parameters() -> None:
    plan = tiny_plan(embeddings="dense")
    params = 100 + 16 * 4  # the dense module plus the N x D tables
    assert plan.per_rank["dense_params"] == params * 4
    assert plan.per_rank["dense_grads"] == params * 4
    assert plan.per_rank["dense_optimizer"] == params * 8
    for sparse_part in ("embeddings", "sparse_optimizer", "admission", "consolidation"):
        assert plan.per_rank[sparse_part] == 0
    assert plan.per_rank["activations"] == ACTIVATIONS  # no gathered rows


def test_cross_interaction_activations() -> None:
    # width = bottom 6 + F*D 8 = 14; x0 + 2 tensors per layer: 14 * (1 + 2 * 2) = 70.
    # Per sample: 3 + (8 + 6) + 8 + 70 + 8 + 1 = 104; B=2, fp32, x3 -> 2496.
    plan = tiny_plan(interaction="cross", bottom_mlp=[8, 6], num_cross_layers=2)
    assert plan.per_rank["activations"] == 2496 + GATHERED


def test_more_ranks_shrink_the_sharded_rows() -> None:
    config = tiny_config(embedding_dim=16, bottom_mlp=[16], sparse_optimizer="lazy_adam")
    plans = [plan_memory(config, [1_000_000, 30_000], 13, 10_000, w) for w in (1, 2, 4, 8)]
    for part in ("embeddings", "sparse_optimizer"):
        sizes = [p.per_rank[part] for p in plans]
        assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 4
    assert plans[0].per_rank["embeddings"] == (1_030_000 + 2) * 16 * 4
    assert plans[3].per_rank["embeddings"] == (128_750 + 2) * 16 * 4
    assert [p.total for p in plans] == sorted((p.total for p in plans), reverse=True)


def test_check_memory_passes_within_budget() -> None:
    plan = tiny_plan()
    check_memory(plan, tiny_config(), plan.total, "train.memory_per_rank_gb")
    with pytest.raises(ConfigError):
        check_memory(plan, tiny_config(), plan.total - 1, "train.memory_per_rank_gb")


def big_sharded_case() -> tuple[TrainConfig, MemoryPlan]:
    config = TrainConfig(
        embedding_dim=32, bottom_mlp=[64, 32], sparse_optimizer="lazy_adam", world_size=2
    )
    sizes = [20_000_000, 3_000_000, 1000]
    plan = plan_memory(config, sizes, 13, 50_000, 2, feature_names=["item", "user", "city"])
    return config, plan


def test_refusal_names_budget_and_suggests_a_world_size_that_fits() -> None:
    config, plan = big_sharded_case()
    budget = 4 * GiB
    assert plan.total > budget
    message = refusal(plan, config, budget, "12.0 GiB machine memory / 3 ranks")
    assert "12.0 GiB machine memory / 3 ranks" in message
    assert f"{plan.total / GiB:.2f} GiB" in message and "4.00 GiB" in message
    assert "sparse_optimizer" in message.splitlines()[1]  # the largest part is named

    found = re.search(r"train\.world_size: (\d+)", message)
    assert found, message
    world = int(found.group(1))
    assert world > 2
    check_memory(replan(plan, config, world_size=world), config, budget, "test")
    assert replan(plan, config, world_size=world - 1).total > budget  # the smallest one


def test_refusal_suggests_an_embedding_dim_that_fits() -> None:
    config, plan = big_sharded_case()
    budget = 4 * GiB
    message = refusal(plan, config, budget, "train.memory_per_rank_gb")
    found = re.search(r"train\.embedding_dim: (\d+) and train\.bottom_mlp: (\[[\d, ]+\])", message)
    assert found, message
    dim, bottom = int(found.group(1)), json.loads(found.group(2))
    assert dim < 32
    # Validated: the suggestion is a config the user can actually write.
    smaller = TrainConfig.model_validate(
        config.model_dump() | {"embedding_dim": dim, "bottom_mlp": bottom}
    )
    check_memory(replan(plan, smaller), smaller, budget, "test")


def test_refusal_suggests_rowwise_adagrad_and_caps_only_when_they_fit() -> None:
    config, plan = big_sharded_case()
    adagrad = config.model_copy(update={"sparse_optimizer": "rowwise_adagrad"})
    fits_with_adagrad = replan(plan, adagrad).total
    message = refusal(plan, config, fits_with_adagrad, "train.memory_per_rank_gb")
    assert "train.sparse_optimizer: rowwise_adagrad" in message

    cap = re.search(r"hash_buckets: (\d+)", message)
    assert cap, message
    rows = int(cap.group(1))
    assert "item (20,000,000 rows)" in message and "city" not in message
    capped = [min(size, rows) for size in plan.table_sizes]
    check_memory(replan(plan, config, table_sizes=capped), config, fits_with_adagrad, "test")

    # Already rowwise_adagrad: not suggested again.
    adagrad_plan = replan(plan, adagrad)
    message = refusal(adagrad_plan, adagrad, adagrad_plan.total - 1, "test")
    assert "rowwise_adagrad" not in message


def test_dense_embeddings_refusal_suggests_sharded() -> None:
    config = TrainConfig(embeddings="dense", embedding_dim=16, world_size=2)
    plan = plan_memory(config, [5_000_000, 100_000], 13, 20_000, 2)
    sharded = config.model_copy(update={"embeddings": "sharded"})
    budget = replan(plan, sharded).total
    message = refusal(plan, config, budget, "train.memory_per_rank_gb")
    assert "train.embeddings: sharded" in message
    check_memory(replan(plan, sharded), sharded, budget, "test")


def test_dense_heavy_refusal_suggests_zero_stage_or_offload_that_fits() -> None:
    config = TrainConfig(embedding_dim=16, world_size=4)
    plan = plan_memory(config, [1000], 13, 200_000_000, 4, accelerator="cuda")
    budget = plan.total - plan.per_rank["dense_optimizer"] // 2
    message = refusal(plan, config, budget, "GPU memory")
    stage = re.search(r"train\.zero_stage: (\d)", message)
    assert stage, message
    zero = config.model_copy(update={"zero_stage": int(stage.group(1))})
    check_memory(replan(plan, zero), zero, budget, "test")

    # Only offloading fits on a GPU; on the CPU accelerator offloading cannot help.
    budget = replan(plan, config.model_copy(update={"zero_stage": 3})).total - 1
    message = refusal(plan, config, budget, "GPU memory")
    offload = re.search(r"train\.offload_optimizer: true with train\.zero_stage: (\d)", message)
    assert offload and "- train.zero_stage:" not in message, message
    update = {"zero_stage": int(offload.group(1)), "offload_optimizer": True}
    offloaded = config.model_copy(update=update)
    check_memory(replan(plan, offloaded), offloaded, budget, "test")
    cpu_plan = replan(plan, config, accelerator="cpu")
    assert "offload_optimizer" not in refusal(cpu_plan, config, budget, "machine memory")


def test_shared_machine_suggests_fewer_ranks() -> None:
    config = TrainConfig(embedding_dim=16, world_size=4)
    plan = plan_memory(config, [2_000_000], 13, 20_000, 4)
    machine = int(2.5 * GiB)
    budget = machine // 4
    message = refusal(
        plan, config, budget, "2.5 GiB machine memory / 4 ranks", split_over_ranks=True
    )
    found = re.search(r"train\.world_size: (\d+)", message)
    assert found, message
    world = int(found.group(1))
    assert world < 4
    check_memory(replan(plan, config, world_size=world), config, machine // world, "test")


def test_ten_billion_rows_fit_on_more_ranks() -> None:
    config = TrainConfig(embedding_dim=16, world_size=8)
    plan = plan_memory(
        config, [10_000_000_000, 1000], 13, 50_000, 8, feature_names=["item_id", "city"]
    )
    # No rank consolidates the 596 GiB table: each streams two chunks of it.
    assert plan.per_rank["consolidation"] == 2 * CHUNK_BYTES
    message = refusal(plan, config, 64 * GiB, "train.memory_per_rank_gb")
    assert "train.memory_per_rank_gb" in message
    found = re.search(r"train\.world_size: (\d+)", message)
    assert found, message
    world = int(found.group(1))
    assert world > 8
    check_memory(replan(plan, config, world_size=world), config, 64 * GiB, "test")
    cap = re.search(r"hash_buckets: (\d+)", message)
    assert cap and "item_id (10,000,000,000 rows)" in message, message
    capped = [min(size, int(cap.group(1))) for size in plan.table_sizes]
    check_memory(replan(plan, config, table_sizes=capped), config, 64 * GiB, "test")


def test_table_is_a_markdown_breakdown() -> None:
    plan = tiny_plan(accelerator="cuda", zero_stage=1, offload_optimizer=True)
    text = plan.table()
    assert "| component | size | bytes |" in text
    for name in COMPONENTS:
        assert f"| {name} |" in text
    assert f"**{plan.total:,}**" in text and f"{RUNTIME_BYTES / MiB:.1f} MiB" in text
    assert "offload_optimizer keeps" in text and "not in the total" in text
    assert "offload_optimizer" not in tiny_plan().table()


def test_machine_memory_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert machine_memory_bytes() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert machine_memory_bytes() > 0

    def unsupported(name: str) -> int:
        raise ValueError(f"unrecognized configuration name {name}")

    monkeypatch.setattr(os, "sysconf", unsupported)
    with pytest.raises(ConfigError, match="train.memory_per_rank_gb"):
        machine_memory_bytes()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"table_sizes": []},
        {"table_sizes": [10, 0]},
        {"world_size": 0},
        {"accelerator": "tpu"},
        {"feature_names": ["only_one"]},
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {
        "table_sizes": SIZES,
        "num_dense_features": 3,
        "num_dense_params": 100,
        "world_size": 2,
    }
    with pytest.raises(ValueError):
        plan_memory(tiny_config(), **(args | kwargs))


def test_when_nothing_fits_alone_the_reductions_are_listed() -> None:
    config, plan = big_sharded_case()
    message = refusal(plan, config, RUNTIME_BYTES // 2, "train.memory_per_rank_gb")
    assert "Any one of these fits" not in message
    assert "No single change fits" in message and "rowwise_adagrad" in message
    assert "train.world_size:" not in message  # nothing was found, nothing is claimed
