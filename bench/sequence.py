"""Benchmark: SASRec training throughput of the project's pipeline against plain PyTorch.

Data: MovieLens latest-small (`../shared/datasets/ml-latest-small/ratings.csv`,
read-only, never copied into the repo) when it is there: every rating an
interaction, split leave-last-out per user (last item test, second to last valid),
turned into train histories by `data_prep.sequences.build_sequences` into
`--workdir`. Without the file: synthetic users of the same count and length
distribution (610 users, 20-2,698 items each, 9,724 items); the figures say which
(`data`).

The train histories are windowed as the config's `preprocess.sequence_windows` says.

Model and training: `configs/sasrec-ml-latest-small.yaml`'s train section as shipped
(hidden_dim, blocks, heads, dropout, loss, negatives, micro batch, grad_accum_steps,
lr, seed), only the layout and the step count overridden. Runs, one after the other
in one invocation (the machine is shared and noisy, so only ratios within a run mean
much):

- `project_<S>x<R>`: the train stage as the flow runs it,
  `training.sequence.train.train_sequence_model`: the DeepSpeed launcher, S pipeline
  stages x R data-parallel replicas of gloo ranks (CPU threads split between ranks as
  the train stage does). Layouts: 1x2 (one stage, two replicas, ZeRO-1) and
  2x1 (the shipped two-stage pipeline); `--layouts` adds others (1x1: one rank with
  every core, slow on a shared machine and left out of the default).
  Sequences per step = batch_size x grad_accum_steps x R.
- `plain_torch`: a single-process PyTorch loop of the same SASRec written here
  (pre-LN causal Transformer, tied item table, the same loss and uniform negatives,
  `batch_size x grad_accum_steps` sequences per optimizer step, Adam with the
  project's betas, `nn.Dropout` and `scaled_dot_product_attention`), run with torch's
  default threads (every core) and with one thread; the faster is the baseline.

Steady state: the project's ranks report sequences/s per `log_every`-step window
(`train_log.jsonl`); the first window (graph warm-up, allocator growth, the first
gloo rendezvous) is dropped, start-up (launch, imports, rendezvous) and the final
checkpoint are outside every window. The plain loop is timed the same way, windows
of `log_every` steps after one dropped window. Each figure is the median window;
`*_spread` is [min, max] over windows.

Figures: `<run>_seq_per_s`, `throughput_vs_plain_torch` (best project layout over
the faster plain torch run; target >= 1.0), `best_layout`, `pipeline_vs_data_parallel` (2x1 over
1x2 sequences/s), `launch_seconds` per project run.

Usage::

    .venv/bin/python bench/sequence.py                  # about 5 minutes
    .venv/bin/python bench/sequence.py --steps 30       # quicker, noisier
    .venv/bin/python bench/sequence.py --layouts 2x1,1x2

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from data_prep.sequences import build_sequences  # noqa: E402
from flows.config import load_config  # noqa: E402
from training.config import TrainConfig  # noqa: E402
from training.runtime.files import TRAIN_LOG_FILE  # noqa: E402
from training.sequence.registry import sequence_model  # noqa: E402
from training.sequence.train import train_sequence_model  # noqa: E402

CONFIG = REPO / "configs" / "sasrec-ml-latest-small.yaml"
# ../shared/datasets beside the repository, as the shipped config reads it.
RATINGS = REPO.parent / "shared" / "datasets" / "ml-latest-small" / "ratings.csv"
MAX_LENGTH = 200  # the config's preprocess.sequence_length


# --- data -----------------------------------------------------------------------------


def write_sequences(workdir: Path, windows: str = "last", seed: int = 0) -> tuple[Path, str]:
    """Train sequences under workdir/sequences-<windows> (cached); returns (dir, data
    description). `windows` is the shipped config's preprocess.sequence_windows."""
    out = workdir / f"sequences-{windows}"
    if RATINGS.is_file():
        description = f"ml-latest-small ({RATINGS})"
    else:
        description = "synthetic, ml-latest-small shaped"
    if (out / "sequences.json").is_file():
        return out, description
    shutil.rmtree(workdir / "splits", ignore_errors=True)
    if RATINGS.is_file():
        table = pacsv.read_csv(RATINGS)
        users = table.column("userId").to_numpy()
        items_raw = table.column("movieId").to_numpy()
        times = table.column("timestamp").to_numpy()
    else:
        users, items_raw, times = _synthetic_ratings(np.random.default_rng(seed))
    # Per user by time (ties by row order), then leave-last-out.
    order = np.lexsort((np.arange(len(users)), times, users))
    users, items_raw, times = users[order], items_raw[order], times[order]
    from_end = _position_from_end(users)
    split = np.where(from_end == 0, 2, np.where(from_end == 1, 1, 0))  # test, valid, train
    # Item index 1.. over the items seen in train, 0 padding and out-of-vocabulary.
    vocabulary = np.unique(items_raw[split == 0])
    position = np.searchsorted(vocabulary, items_raw)
    known = (position < len(vocabulary)) & (
        vocabulary[np.minimum(position, len(vocabulary) - 1)] == items_raw
    )
    items = np.where(known, position + 1, 0)
    user_index = np.unique(users, return_inverse=True)[1]
    split_dirs = {}
    for code, name in enumerate(("train", "valid", "test")):
        keep = split == code
        directory = workdir / "splits" / name
        directory.mkdir(parents=True, exist_ok=True)
        pq.write_table(
            pa.table(
                {
                    "user": user_index[keep].astype(np.int64),
                    "item": items[keep].astype(np.int64),
                    "timestamp": times[keep].astype(np.int64),
                }
            ),
            directory / "part-00000.parquet",
        )
        split_dirs[name] = directory
    build_sequences(
        split_dirs,
        "user",
        "item",
        "timestamp",
        MAX_LENGTH,
        out,
        num_items=len(vocabulary) + 1,
        windows=windows,
    )
    shutil.rmtree(workdir / "splits")
    return out, description


def _position_from_end(users: np.ndarray) -> np.ndarray:
    """For rows sorted by user: 0 for a user's last row, 1 for the one before, ..."""
    starts = np.r_[0, np.flatnonzero(users[1:] != users[:-1]) + 1]
    ends = np.r_[starts[1:], len(users)]
    lengths = ends - starts
    run_end = np.repeat(ends, lengths)
    return run_end - 1 - np.arange(len(users))


def _synthetic_ratings(rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """610 users, ~100k ratings of 9,724 items, a long-tailed length per user."""
    lengths = np.clip(rng.lognormal(4.3, 1.0, size=610).astype(np.int64), 20, 2698)
    users = np.repeat(np.arange(1, 611), lengths)
    items = rng.zipf(1.3, size=len(users)) % 9724 + 1
    times = np.concatenate([np.arange(n) for n in lengths])
    return users, items, times


def read_histories(sequences: Path) -> list[list[int]]:
    return (
        pq.read_table(sequences / "train.parquet", columns=["history"])
        .column("history")
        .to_pylist()
    )


# --- the project's train stage ----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def project_run(config: TrainConfig, sequences: Path, out: Path) -> dict:
    """Train through `train_sequence_model`; sequences/s of its steady-state windows."""
    shutil.rmtree(out, ignore_errors=True)
    env = {
        **os.environ,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "TORCH_EXTENSIONS_DIR": os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions")
        ),
    }
    started = time.monotonic()
    train_sequence_model(config, sequences, out, "cpu", free_port(), env)
    seconds = time.monotonic() - started
    records = [json.loads(line) for line in (out / TRAIN_LOG_FILE).read_text().splitlines()]
    windows = [r["samples_per_s"] for r in records[1:]] or [r["samples_per_s"] for r in records]
    shutil.rmtree(out, ignore_errors=True)
    return {
        "seq_per_s": statistics.median(windows),
        "spread": [min(windows), max(windows)],
        "launch_seconds": round(seconds, 1),
    }


# --- plain PyTorch SASRec, written here on purpose (no project code) -----------------------


class PlainBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ffn = nn.Sequential(
            nn.Linear(dim, dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(dim, dim)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        b, length, d = x.shape
        q, k, v = (
            t.view(b, length, self.heads, -1).transpose(1, 2)
            for t in self.qkv(self.norm1(x)).split(d, dim=-1)
        )
        a = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, length, d)))
        x = x + self.drop(self.ffn(self.norm2(x)))
        return x * valid


class PlainSASRec(nn.Module):
    def __init__(self, items: int, length: int, dim: int, blocks: int, heads: int, p: float):
        super().__init__()
        self.items = nn.Embedding(items, dim, padding_idx=0)
        nn.init.normal_(self.items.weight, std=dim**-0.5)
        with torch.no_grad():
            self.items.weight[0].zero_()
        self.positions = nn.Embedding(length, dim)
        self.blocks = nn.ModuleList(PlainBlock(dim, heads, p) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(p)

    def forward(self, history: torch.Tensor, candidates: torch.Tensor | None) -> torch.Tensor:
        b, length = history.shape
        valid = (history != 0).unsqueeze(-1)  # (B, L, 1)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        mask = causal & ((history != 0).unsqueeze(1) | torch.eye(length, dtype=torch.bool))
        x = self.items(history) * math.sqrt(self.items.embedding_dim)
        x = self.drop(x + self.positions.weight[:length]) * valid
        for block in self.blocks:
            x = block(x, mask.unsqueeze(1), valid)
        hidden = self.norm(x)  # (B, L, D)
        if candidates is None:  # loss 'softmax': the caller scores every item
            return hidden
        vectors = self.items(candidates)  # (B, L, 1 + N, D)
        return (vectors * hidden.unsqueeze(-2)).sum(-1)  # (B, L, 1 + N)


def plain_batch(rows: list[list[int]], length: int, num_items: int, negatives: int):
    padded = torch.zeros(len(rows), length + 1, dtype=torch.int64)
    for i, items in enumerate(rows):
        kept = items[-(length + 1) :]
        padded[i, length + 1 - len(kept) :] = torch.tensor(kept)
    history, positives = padded[:, :-1], padded[:, 1:] * (padded[:, :-1] != 0)
    sampled = torch.randint(1, num_items, (*positives.shape, negatives))
    sampled = sampled * (positives != 0).unsqueeze(-1)
    return history, positives, torch.cat([positives.unsqueeze(-1), sampled], -1)


def plain_loss(logits: torch.Tensor, positives: torch.Tensor, kind: str) -> torch.Tensor:
    valid = positives != 0
    if kind == "bce":
        targets = torch.zeros_like(logits)
        targets[..., 0] = 1
        per = F.binary_cross_entropy_with_logits(logits, targets, reduction="none").sum(-1)
    else:
        per = torch.logsumexp(logits, -1) - logits[..., 0]
    return (per * valid).sum() / valid.sum().clamp(min=1)


def plain_torch_run(
    config: TrainConfig, histories: list[list[int]], num_items: int, steps: int
) -> dict:
    """A single-process loop; steady-state sequences/s over log_every-step windows."""
    torch.manual_seed(config.seed)
    seq = config.sequence
    model = PlainSASRec(
        num_items, MAX_LENGTH, seq.hidden_dim, seq.num_blocks, seq.num_heads, seq.dropout
    )
    adam = sequence_model(config.model).adam
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=config.lr,
        betas=adam.betas,
        eps=1e-8,
        weight_decay=config.weight_decay,
    )
    rng = np.random.default_rng(config.seed)
    order = iter(())
    per_step = config.batch_size * config.grad_accum_steps

    def next_rows() -> list[list[int]]:
        nonlocal order
        rows = []
        while len(rows) < config.batch_size:
            index = next(order, None)
            if index is None:
                order = iter(rng.permutation(len(histories)))
                continue
            rows.append(histories[index])
        return rows

    windows = []
    window_started = time.monotonic()
    for step in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=True)
        for _ in range(config.grad_accum_steps):
            per_position = 0 if seq.shared_negatives else seq.num_negatives
            history, positives, candidates = plain_batch(
                next_rows(), MAX_LENGTH, num_items, per_position
            )
            if seq.loss == "softmax":  # every item scored where there is a positive
                scored = positives != 0
                logits = model(history, None)[scored] @ model.items.weight.T  # (M, V)
                logits = logits.index_fill(-1, torch.tensor([0]), float("-inf"))
                loss = F.cross_entropy(logits, positives[scored])
            elif seq.shared_negatives:  # one set of negatives for the micro batch
                scored = positives != 0
                states, targets = model(history, None)[scored], positives[scored]  # (M, D)
                shared = torch.randint(1, num_items, (seq.num_negatives,))
                positive = (states * model.items(targets)).sum(-1, keepdim=True)
                logits = (states @ model.items(shared).T).masked_fill(
                    shared.unsqueeze(0) == targets.unsqueeze(1), float("-inf")
                )
                loss = F.cross_entropy(torch.cat([positive, logits], -1), torch.zeros_like(targets))
            else:
                loss = plain_loss(model(history, candidates), positives, seq.loss)
            (loss / config.grad_accum_steps).backward()
        if config.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        if step % config.log_every == 0:
            now = time.monotonic()
            windows.append(config.log_every * per_step / (now - window_started))
            window_started = now
    windows = windows[1:] or windows
    return {"seq_per_s": statistics.median(windows), "spread": [min(windows), max(windows)]}


# --- main -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=REPO / ".bench" / "sequence")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    parser.add_argument("--log-every", type=int, default=10, help="steps per timing window")
    parser.add_argument("--layouts", default="1x2,2x1", help="stages x replicas, comma list")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    config_file = load_config(CONFIG)
    sequences, data = write_sequences(args.workdir, config_file.preprocess.sequence_windows)
    num_items = json.loads((sequences / "sequences.json").read_text())["num_items"]
    shipped = config_file.train
    figures: dict = {"data": data, "num_items": num_items, "steps": args.steps}

    plain_config = shipped.model_copy(update={"log_every": args.log_every})
    histories = read_histories(sequences)
    plain_runs = {}
    # torch's default (every core) and one thread: on a shared machine OpenMP threads
    # that wait for a busy core can make the default the slower one; the faster counts.
    for threads in sorted({torch.get_num_threads(), 1}, reverse=True):
        torch.set_num_threads(threads)
        result = plain_torch_run(plain_config, histories, num_items, args.steps)
        plain_runs[threads] = result
        print(json.dumps({f"plain_torch_{threads}_threads": result}), flush=True)
        figures[f"plain_torch_{threads}_threads_seq_per_s"] = round(result["seq_per_s"], 1)
        figures[f"plain_torch_{threads}_threads_spread"] = [round(x, 1) for x in result["spread"]]
    plain = max(plain_runs.values(), key=lambda r: r["seq_per_s"])
    figures["plain_torch_seq_per_s"] = round(plain["seq_per_s"], 1)

    project = {}
    for layout in args.layouts.split(","):
        stages, replicas = (int(x) for x in layout.split("x"))
        config = shipped.model_copy(
            update={
                "pipeline_stages": stages,
                "world_size": stages * replicas,
                "max_steps": args.steps,
                "log_every": args.log_every,
            }
        )
        config = TrainConfig.model_validate(config.model_dump())
        result = project_run(config, sequences, args.workdir / f"run_{layout}")
        project[layout] = result
        print(json.dumps({f"project_{layout}": result}), flush=True)
        figures[f"project_{layout}_seq_per_s"] = round(result["seq_per_s"], 1)
        figures[f"project_{layout}_spread"] = [round(x, 1) for x in result["spread"]]
        figures[f"project_{layout}_launch_seconds"] = result["launch_seconds"]

    best = max(project, key=lambda k: project[k]["seq_per_s"])
    figures["best_layout"] = best
    figures["throughput_vs_plain_torch"] = round(project[best]["seq_per_s"] / plain["seq_per_s"], 3)
    if "2x1" in project and "1x2" in project:
        figures["pipeline_vs_data_parallel"] = round(
            project["2x1"]["seq_per_s"] / project["1x2"]["seq_per_s"], 3
        )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
