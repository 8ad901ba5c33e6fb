"""Incremental runs: which model a day's run starts from (`train.init`), and its lineage.

A daily run names its partition (`ingest.partition`) and, with `train.init: champion`
(or a registry version), warm-starts from that model. The parent is resolved once, at
the plan, and everything downstream is keyed by it: preprocess extends the parent's
fitted transform instead of refitting (`data_prep.idmap`), train starts from the
parent's weights and optimizer state (`training.stages.train_launch`), and the export
writes `lineage.json` (parent version, partitions seen, the stage outputs it was made
from) into the package, which is how the next day finds this model's train output. A
model that has already seen the run's partition is not its parent: the lineage is
walked back to the model before it, so a finished day runs again as cache hits.

Nothing here trusts the bucket: the package is verified against its signed manifest,
bound to the model and version it is read as (`Registry.verify`: another version's
package copied over it is refused), so `lineage.json` names the train output that
version was exported from; that train output is verified against its own manifest
(`ArtifactStore.verify`), which must be the train output of exactly that fingerprint (a
train output copied over it is refused, naming both); every stored name goes through the
registry's and the store's checks.

With `train.init: champion` and no champion yet, the run starts a chain from scratch
(day one of a daily deployment). A named version that is missing fails the plan.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from pydantic import BaseModel

from artifacts.errors import ConfigError, CorruptOutput, InputNotFoundError
from artifacts.fingerprint import FINGERPRINT
from artifacts.registry import Registry, check_version
from artifacts.store import ArtifactStore
from data_prep.idmap import transform_digest
from tasks.common import StageOutput, load_run_key, task_options

LINEAGE = "lineage.json"
TRANSFORM = "transform.json"
# How far back the lineage is walked to find the model before a partition.
_MAX_CHAIN = 10_000


class Parent(BaseModel):
    """The model an incremental run starts from.

    Attributes:
        version: Its registry version.
        package: Its package's local directory (verified).
        train: The fingerprint of the train output it was exported from.
        transform_digest: `data_prep.idmap.transform_digest` of its transform.
        partitions: The partitions its transform has seen, oldest first.
    """

    version: str
    package: str
    train: str
    transform_digest: str
    partitions: list[str]

    def identity(self) -> dict[str, str]:
        """What the preprocess and train fingerprints cover of the parent."""
        return {"version": self.version, "transform": self.transform_digest}

    def transform(self) -> dict:
        """The parent's fitted (or extended) transform, from its verified package."""
        return json.loads((Path(self.package) / TRANSFORM).read_text())

    def train_output(self, store: ArtifactStore) -> StageOutput:
        """The parent's train output, verified against its signed manifest.

        Raises:
            InputNotFoundError: It was deleted (`recforge gc`, by hand).
            CorruptOutput: It differs from its manifest.
            MisplacedRecord: Its manifest is another output's (copied over it), naming
                both.
        """
        manifest, why = store.verify("train", self.train)
        if manifest is None:
            raise InputNotFoundError(
                f"model {self.version}'s train output is gone ({why}): a warm start needs "
                "its final checkpoint. Start the chain again (train.init unset) or warm-start "
                "from another version"
            )
        return StageOutput(
            stage="train",
            status="cached",
            fingerprint=self.train,
            output=store.output_url("train", self.train),
            meta=manifest["meta"],
        )


def resolve_parent(config: Any, store: ArtifactStore) -> Parent | None:
    """The model `config.train.init` names, verified; None when the run starts afresh.

    A model that has already seen this run's partition (a finished day run again, or a
    backfill over days the chain has) is not its parent: the lineage is walked back to
    the model that preceded the partition, which is what the day's first run started
    from, so the rerun finds every stage's output cached.

    Args:
        config: The pipeline config (`flows.config.PipelineConfig`).
        store: The artifact store.

    Raises:
        InputNotFoundError: A named version is not in the registry.
        CorruptOutput: Its package differs from its manifest, or its lineage is invalid.
        ConfigError: The package was not made by an incremental-capable run (no
            lineage, or a transform that never saw a partition), or train.init is set
            without ingest.partition.
    """
    init = config.train.init
    if init is None:
        return None
    partition = config.ingest.partition
    if partition is None:
        raise ConfigError(
            f"train.init={init} extends a chain by one partition: set ingest.partition "
            "(e.g. --set ingest.partition=dt=2026-12-05, or dt={scheduled_date-1d} in a "
            "deployment)"
        )
    registry = Registry(store, config.export.model_name)
    version = registry.champion() if init == "champion" else init
    for _ in range(_MAX_CHAIN):
        if version is None:
            return None  # day one: no champion yet, or the partition started the chain
        parent, lineage_parent = _verified_parent(registry, version)
        if partition not in parent.partitions:
            return parent
        version = lineage_parent
    raise CorruptOutput(
        f"model {config.export.model_name!r}: the lineage from {init} is longer than "
        f"{_MAX_CHAIN} models without leaving partition {partition} (a cycle in lineage.json)"
    )


def _verified_parent(registry: Registry, version: str) -> tuple[Parent, str | None]:
    """`version` as a parent (its package verified), and its own parent's version."""
    package = registry.verify(version)
    where = f"model {registry.model_name!r} version {version}"
    if not (package / LINEAGE).is_file():
        raise ConfigError(
            f"{where} has no {LINEAGE}: it was exported before incremental training existed. "
            "Start a chain from scratch (unset train.init) and promote its first day"
        )
    lineage = json.loads((package / LINEAGE).read_text())
    train = lineage.get("train")
    if not isinstance(train, str) or not FINGERPRINT.fullmatch(train):
        raise CorruptOutput(f"{where}: {LINEAGE} 'train' is not a stage fingerprint")
    grandparent = lineage.get("parent")
    if grandparent is not None:
        check_version(grandparent, f"{where}: {LINEAGE} 'parent'")
    transform = json.loads((package / TRANSFORM).read_text())
    partitions = transform.get("partitions")
    if not partitions:
        raise ConfigError(
            f"{where} was trained without ingest.partition, so its transform starts no "
            "chain to extend. Run one day with ingest.partition set (train.init unset), "
            "promote it, then warm-start from it"
        )
    parent = Parent(
        version=version,
        package=str(package),
        train=train,
        transform_digest=transform_digest(transform),
        partitions=list(partitions),
    )
    return parent, grandparent


def lineage_record(
    parent: Parent | None, partitions: list[str] | None, upstream: list[StageOutput]
) -> dict[str, Any]:
    """The package's and the run record's lineage: parent, partitions, stage outputs."""
    return {
        "parent": parent.version if parent is not None else None,
        "partitions": list(partitions or []),
        **{output.stage: output.fingerprint for output in upstream},
    }


def train_section(config: Any, parent: Parent | None) -> dict[str, Any]:
    """What the train fingerprint covers: the train config and, warm-started, the parent."""
    section = config.fingerprinted()
    if parent is not None:
        section["parent"] = parent.identity()
    return section


@task(name="parent", task_run_name="parent", **task_options(retries=0))
def parent_task(config: Any, store: ArtifactStore) -> Parent | None:
    """`resolve_parent`, logged: which model this run warm-starts from, if any."""
    load_run_key(store)
    store.check_reachable()
    parent = resolve_parent(config, store)
    logger = get_run_logger()
    if parent is None:
        logger.info("train.init=%s: no champion yet, the chain starts here", config.train.init)
    else:
        logger.info(
            "warm start from %s %s (it has seen %d partitions, the last %s)",
            config.export.model_name,
            parent.version,
            len(parent.partitions),
            parent.partitions[-1],
        )
    return parent
