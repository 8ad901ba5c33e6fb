"""The memory planner: exact byte arithmetic on tiny hand-computed plans, the budget
check, suggestions that are re-planned to prove they fit, train.zero_stage: auto and
the rows that fit a budget at each table precision."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest

from artifacts.errors import ConfigError
from training.config import TrainConfig
from training.ctr.memory import (
    check_memory,
    choose_zero_stage,
    plan_memory,
    rows_report,
    rows_that_fit,
)
from training.runtime.memory import (
    CHUNK_BYTES,
    COMPONENTS,
    RUNTIME_BYTES,
    GiB,
    MemoryPlan,
    MiB,
    machine_memory_bytes,
    plan_record,
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
        "zero_stage": 0,
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


def test_int8_rows_take_a_byte_a_value_and_a_scale_and_bias_per_row() -> None:
    fp32 = tiny_plan()
    int8 = tiny_plan(table_precision="int8")
    # 6 local rows of 4 one-byte codes and an fp32 (scale, bias) each; 2 fp32 default rows.
    assert int8.per_rank["embeddings"] == 6 * (4 * 1 + 8) + 2 * 4 * 4 == 104
    assert int8.per_rank["sparse_optimizer"] == fp32.per_rank["sparse_optimizer"] == 32
    # The update of the 4 gathered rows: fp32 working copy and int32 bits as a 2-byte
    # table's, plus the (R, 2) fp32 grid read and written.
    assert int8.per_rank["activations"] == ACTIVATIONS + GATHERED + 4 * 4 * 4 * 2 + 4 * 2 * 4 * 2
    assert int8.per_rank["consolidation"] == fp32.per_rank["consolidation"]  # fp32 out
    # Table plus optimizer-state bytes per row at D = 16, rowwise_adagrad: 16 + 8 + 4.
    config = tiny_config(embedding_dim=16, bottom_mlp=[8, 16], table_precision="int8")
    plan = plan_memory(config, [1_000_000], 3, 100, 1)
    per_row = (plan.per_rank["embeddings"] + plan.per_rank["sparse_optimizer"]) / 1e6
    assert per_row == pytest.approx(28, abs=0.01)


def precision_case(precision: str = "fp32") -> tuple[TrainConfig, MemoryPlan]:
    """`big_sharded_case` with rowwise_adagrad at `precision`: the table dominates."""
    config, plan = big_sharded_case()
    update = {"sparse_optimizer": "rowwise_adagrad", "table_precision": precision}
    config = config.model_copy(update=update)
    return config, replan(plan, config)


def test_refusal_names_the_widest_table_precision_that_fits() -> None:
    config, plan = precision_case()
    half = replan(plan, config.model_copy(update={"table_precision": "bf16"}))
    int8 = replan(plan, config.model_copy(update={"table_precision": "int8"}))
    assert plan.total > half.total > int8.total
    # 2-byte rows fit: bf16 (or fp16) is named, not int8, which loses more precision.
    message = refusal(plan, config, half.total, "train.memory_per_rank_gb")
    assert "  - train.table_precision: bf16 (or fp16)" in message
    assert "table_precision: int8" not in message
    assert message.index("Any one of these fits") < message.index("train.table_precision")
    assert "rowwise_adagrad" not in message  # the text names no optimizer
    # Only 1-byte rows fit: int8 is named, not bf16.
    message = refusal(plan, config, int8.total, "train.memory_per_rank_gb")
    assert "  - train.table_precision: int8" in message and "bf16" not in message
    assert message.index("Any one of these fits") < message.index("table_precision: int8")
    check_memory(int8, config.model_copy(update={"table_precision": "int8"}), int8.total, "t")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_refusal_of_two_byte_rows_names_int8_when_it_fits(precision: str) -> None:
    config, plan = precision_case(precision)
    int8 = replan(plan, config.model_copy(update={"table_precision": "int8"}))
    message = refusal(plan, config, int8.total, "train.memory_per_rank_gb")
    assert "  - train.table_precision: int8" in message and "(or fp16)" not in message
    # Nothing narrower than int8, and nothing for a dense table.
    config, plan = precision_case("int8")
    assert "table_precision" not in refusal(plan, config, plan.total - 1, "test")
    dense = TrainConfig(zero_stage=0, embeddings="dense", embedding_dim=16, world_size=2)
    dense_plan = plan_memory(dense, [5_000_000, 100_000], 13, 20_000, 2)
    assert "table_precision" not in refusal(dense_plan, dense, dense_plan.total - 1, "test")


def test_when_no_precision_fits_alone_int8_is_offered_as_a_reduction() -> None:
    config, plan = precision_case()
    int8 = replan(plan, config.model_copy(update={"table_precision": "int8"}))
    message = refusal(plan, config, RUNTIME_BYTES // 2, "train.memory_per_rank_gb")
    assert "No single change fits" in message
    assert "  - train.table_precision: int8: 1-byte codes" in message
    assert f"needs {int8.total / GiB:.2f} GiB per rank" in message


def test_lazy_adam_keeps_two_moments_per_element() -> None:
    adagrad = tiny_plan()
    adam = tiny_plan(sparse_optimizer="lazy_adam")
    assert adam.per_rank["sparse_optimizer"] == (6 + 2) * 2 * 4 * 4
    assert adam.total - adagrad.total == 256 - 32


@pytest.mark.parametrize(("min_count", "counters"), [(0, 0), (1, 0), (2, 6 * 8), (5, 6 * 8)])
def test_admission_adds_an_int64_counter_per_local_row(min_count: int, counters: int) -> None:
    # `ShardedEmbedding.counts` is int64.
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
        zero_stage=0,
        embedding_dim=32,
        bottom_mlp=[64, 32],
        sparse_optimizer="lazy_adam",
        world_size=2,
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
    config = TrainConfig(zero_stage=0, embeddings="dense", embedding_dim=16, world_size=2)
    plan = plan_memory(config, [5_000_000, 100_000], 13, 20_000, 2)
    sharded = config.model_copy(update={"embeddings": "sharded"})
    budget = replan(plan, sharded).total
    message = refusal(plan, config, budget, "train.memory_per_rank_gb")
    assert "train.embeddings: sharded" in message
    check_memory(replan(plan, sharded), sharded, budget, "test")


def test_dense_heavy_refusal_suggests_zero_stage_or_offload_that_fits() -> None:
    config = TrainConfig(zero_stage=0, embedding_dim=16, world_size=4)
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
    config = TrainConfig(zero_stage=0, embedding_dim=16, world_size=4)
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
    config = TrainConfig(zero_stage=0, embedding_dim=16, world_size=8)
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


def dense_heavy_case(**update: Any) -> tuple[TrainConfig, list[int], int, int]:
    """200M dense parameters on 4 GPUs (AdamW state 3 GiB at ZeRO 0), a tiny table."""
    config = TrainConfig(embedding_dim=16, world_size=4, **update)
    return config, [1000], 13, 200_000_000


def plans_by_stage(config: TrainConfig, sizes: list[int], dn: int, params: int) -> dict:
    return {
        stage: plan_memory(
            config.model_copy(update={"zero_stage": stage}), sizes, dn, params, 4, "cuda"
        )
        for stage in range(4)
    }


def test_auto_zero_stage_is_0_when_the_dense_state_fits() -> None:
    config = tiny_config(zero_stage="auto")
    stage, line = choose_zero_stage(config, SIZES, 3, 100, 3, "cpu", (GiB, "the test budget"))
    assert stage == 0
    assert line.startswith("train.zero_stage: auto -> 0, the fastest: at ZeRO 0 the dense state")
    dense = 400 + 400 + 800  # params, grads, AdamW of the 100 dense parameters, fp32
    assert "needs 1.6 KiB per rank" in line and dense == 1600
    assert "within the budget of 1.00 GiB per rank (from the test budget)" in line
    # No budget to plan against: the fastest stage, and the line says so.
    stage, line = choose_zero_stage(config, SIZES, 3, 100, 3)
    assert stage == 0 and "no memory budget" in line
    # An explicit stage is kept as it is.
    assert choose_zero_stage(tiny_config(zero_stage=2), SIZES, 3, 100, 3)[0] == 2


def test_auto_zero_stage_rises_only_as_far_as_the_budget_needs() -> None:
    config, sizes, dn, params = dense_heavy_case(zero_stage="auto")
    plans = plans_by_stage(config, sizes, dn, params)
    # Half the AdamW state over budget: ZeRO 1 partitions it but adds rank 0's fp32
    # copy of the weights for model.safetensors; ZeRO 2 also partitions the grads.
    budget = plans[0].total - plans[0].per_rank["dense_optimizer"] // 2
    stage, line = choose_zero_stage(config, sizes, dn, params, 4, "cuda", (budget, "GPU 0"))
    assert stage == 2 and plans[1].total > budget >= plans[2].total
    dense = sum(plans[0].per_rank[k] for k in ("dense_params", "dense_grads", "dense_optimizer"))
    assert line.startswith("train.zero_stage: auto -> 2: at ZeRO 0 the dense state")
    assert f"{dense / GiB:.2f} GiB per rank" in line and "over the budget of" in line
    assert f"by ZeRO 2 over 4 ranks the plan needs {plans[2].total / GiB:.2f} GiB" in line
    # A budget only ZeRO 3 meets.
    stage, _ = choose_zero_stage(config, sizes, dn, params, 4, "cuda", (plans[3].total, "GPU"))
    assert stage == 3


def test_auto_zero_stage_with_offload_starts_at_1() -> None:
    config = tiny_config(zero_stage="auto", offload_optimizer=True)
    assert config.zero_stages() == (1, 2, 3)
    stage, line = choose_zero_stage(config, SIZES, 3, 100, 3, "cpu", (GiB, "test"))
    assert stage == 1 and "auto -> 1, the fastest" in line


def test_auto_zero_stage_that_cannot_fit_takes_the_smallest_plan_for_the_refusal() -> None:
    config, sizes, dn, params = dense_heavy_case(zero_stage="auto")
    plans = plans_by_stage(config, sizes, dn, params)
    budget = min(plan.total for plan in plans.values()) - 1
    stage, line = choose_zero_stage(config, sizes, dn, params, 4, "cuda", (budget, "GPU"))
    assert stage == 3 and "no stage fits" in line
    resolved = config.model_copy(update={"zero_stage": stage})
    message = refusal(plans[3], resolved, budget, "GPU")
    assert "- train.zero_stage:" not in message  # no stage to offer: auto tried them all
    assert "train.offload_optimizer: true with train.zero_stage: 3" in message


def test_plan_memory_plans_one_stage_at_a_time() -> None:
    with pytest.raises(ValueError, match="zero_stage is 'auto'"):
        plan_memory(tiny_config(zero_stage="auto"), SIZES, 3, 100, 3)


def test_rows_that_fit_is_the_plan_turned_around() -> None:
    config = tiny_config(embedding_dim=16, bottom_mlp=[8, 16])
    budget = 2 * GiB
    fit = rows_that_fit(config, budget, num_dense_features=3, num_dense_params=100)
    assert list(fit) == ["fp32", "bf16", "fp16", "int8"]
    assert fit["int8"] > fit["bf16"] == fit["fp16"] > fit["fp32"] > 0
    for precision, rows in fit.items():
        at = config.model_copy(update={"table_precision": precision})
        assert plan_memory(at, [rows], 3, 100, 1).total <= budget
        assert plan_memory(at, [rows + 1], 3, 100, 1).total > budget  # the largest
    # Split over tables and ranks, each rank with the budget: more rows in all.
    wider = rows_that_fit(config, budget, num_tables=3, world_size=2, num_dense_params=100)
    assert all(wider[p] > fit[p] for p in fit)
    # Not even the runtime fits: no rows.
    assert set(rows_that_fit(config, RUNTIME_BYTES // 2).values()) == {0}
    with pytest.raises(ValueError, match="embedding_dim"):
        rows_that_fit(config, budget, embedding_dim=0)


def test_rows_that_fit_predicts_the_whole_rank_not_the_table_alone() -> None:
    # The bench's case: 200M rows at dim 16, fp16 rows, rowwise_adagrad, one process.
    config = TrainConfig(zero_stage=0, embedding_dim=16, bottom_mlp=[512, 256, 16], world_size=1)
    fp16 = config.model_copy(update={"table_precision": "fp16"})
    plan = plan_memory(fp16, [200_000_000], 13, 500_000, 1)
    table_and_state = 200_000_000 * (16 * 2 + 4)  # 2-byte values, one fp32 accumulator
    assert plan.per_rank["embeddings"] + plan.per_rank["sparse_optimizer"] == pytest.approx(
        table_and_state, rel=1e-6
    )
    assert plan.total - table_and_state >= RUNTIME_BYTES  # runtime, activations, reader...
    fit = rows_that_fit(config, plan.total, num_dense_features=13, num_dense_params=500_000)
    assert fit["fp16"] == 200_000_000
    # zero_stage: auto counts its best stage (here one rank: ZeRO 0, no fp32 copy to write).
    auto = config.model_copy(update={"zero_stage": "auto"})
    assert rows_that_fit(auto, plan.total, num_dense_features=13, num_dense_params=500_000) == fit


def test_rows_that_fit_defaults_to_this_machines_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("training.ctr.memory.machine_memory_bytes", lambda: 3 * GiB)
    config = tiny_config(embedding_dim=8, bottom_mlp=[8, 8])
    assert rows_that_fit(config) == rows_that_fit(config, 3 * GiB)
    # embedding_dim overrides the config's (and, with 'dot', bottom_mlp's last layer).
    assert rows_that_fit(config, embedding_dim=4) == rows_that_fit(tiny_config(), 3 * GiB)


def test_the_plan_report_carries_the_notes() -> None:
    fit = {"fp32": 1_000, "bf16": 1_900, "fp16": 1_900, "int8": 3_500}
    line = rows_report(fit, 16, "the 1.00 GiB per-rank budget on 2 rank(s)")
    assert line == (
        "Embedding rows of dim 16 that fit the 1.00 GiB per-rank budget on 2 rank(s), by "
        "train.table_precision: fp32 1,000, bf16/fp16 1,900, int8 3,500."
    )
    plan = tiny_plan()
    noted = MemoryPlan(**{**plan.__dict__, "notes": ("train.zero_stage: auto -> 0", line)})
    assert noted.table().endswith(f"\n\ntrain.zero_stage: auto -> 0\n\n{line}")
    assert plan_record(noted)["notes"] == ["train.zero_stage: auto -> 0", line]
    assert "notes" not in plan_record(plan)
