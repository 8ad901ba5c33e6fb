"""Leave-one-out ranking evaluation of next-item models (the SASRec paper's protocols).

Each evaluated user has one held-out target item and a set of seen items (its
history). Two protocols rank the target among candidates scored by the model:

- (a) sampled: the target plus `num_negatives` items drawn uniformly without
  replacement from the items the user has not seen (SASRec: 100 negatives);
- (b) full: every item 1..num_items-1, the user's seen items other than the
  target masked out.

Item 0 is the padding/OOV index and is never a candidate. Ranks are 0-based and
ties are counted pessimistically (the target loses every tie), so a constant scorer
scores zero instead of looking perfect. HR@K, NDCG@K and MRR follow from the ranks.

A user whose target is out of vocabulary (item 0: never seen in training) stays in
the evaluation as a miss: its rank is `UNRANKED`, which counts 0 towards HR@K, NDCG@K
(every K) and MRR. The published protocols rank every test user against the whole
catalogue; removing the users no model can rank would raise every model's figures
(and the baseline's) by the same unearned factor. A miss is what such a user gets from
any recommender built on this vocabulary: item 0 is never a candidate, so the exported
top-K never holds the target (a reciprocal rank of 0). It is not scored as the padding
row: that row's score is an artefact (zero, or a trained bias) that could land the
target anywhere.

No I/O: the model is reached only through a `score_fn` callable. The protocols are
pure numpy; the model adapters at the end (`state_score_fn` for models that score
items against a user state, `candidate_score_fn` for models that score each
candidate with the history, BST) run torch inside a score_fn. Users are processed in
blocks of `block_users`, so memory is bounded by the block, not by the number of users.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from artifacts.errors import DataError
from training.sequence.bst import BST, score_candidates
from training.sequence.sasrec import SASRec

ScoreFn = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""score_fn(users (b,), candidate_items (b, C)) -> scores (b, C); higher ranks first."""

# SplitMix64 (Steele, Lea & Flood 2014): a counter-based generator whose output
# mix(key + (j + 1) * GAMMA) passes BigCrush. Counter-based means draw j of user u is
# a pure function of (seed, u, j), so a whole block of users is drawn in one
# vectorised call and no user's negatives depend on its neighbours in the block.
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_USER_GAMMA = np.uint64(0xD1B54A32D192ED03)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_SAMPLE_CHUNK_USERS = 8192
"""Users whose draws are materialised at once inside the sampler (bounds its memory)."""
_MIN_ACCEPTANCE = 1 / 8
"""Below this share of acceptable draws a user is sampled exactly instead of by rejection."""
_EXACT_GROUP_ENTRIES = 1 << 22
"""Random keys materialised at once by the exact sampler: rows x (num_items - 1)."""
UNRANKED = -1
"""The rank of an out-of-vocabulary target (item 0): a miss at every K, reciprocal rank 0."""


class TooFewNegativesError(DataError, ValueError):
    """A user has fewer unseen items than the negatives requested.

    A DataError (deterministic: retrying cannot help) and a ValueError (bad input).
    """


@dataclass(frozen=True)
class RankingResult:
    """Leave-one-out ranking metrics of a model.

    Attributes:
        metrics: f"hr@{k}_sampled", f"ndcg@{k}_sampled", "mrr_sampled" for each k,
            and the same keys ending in "_full" when the full protocol ran.
        num_users: Users (evaluation rows) ranked.
    """

    metrics: dict[str, float]
    num_users: int


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer, elementwise on uint64 (wraps modulo 2**64 by design)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _user_keys(seed: int, user_ids: np.ndarray) -> np.ndarray:
    """(U,) uint64 stream keys, one per user, a pure function of (seed, user id)."""
    # numpy's SeedSequence turns any non-negative int seed into well-mixed bits.
    base = np.random.SeedSequence(seed).generate_state(1, dtype=np.uint64)[0]
    return _mix(base + (user_ids.astype(np.uint64) + np.uint64(1)) * _USER_GAMMA)


def _stream(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """(U, T) uint64: draw counters[t] of the stream of keys[u]."""
    return _mix(keys[:, None] + (counters.astype(np.uint64) + np.uint64(1))[None, :] * _GAMMA)


def _as_int_array(name: str, values: np.ndarray, ndim: int) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != ndim or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
        raise ValueError(
            f"{name} must be a {ndim}-d integer array, got dtype {array.dtype} shape {array.shape}"
        )
    return array.astype(np.int64, copy=False)


def _flatten_seen(
    seen: Sequence[np.ndarray], num_items: int, user_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Row-major (row, item) pairs of the seen lists, padding item 0 dropped.

    Returns:
        rows (P,) and items (P,) int64, items in [1, num_items); duplicates kept.

    Raises:
        ValueError: A seen item is negative or not below num_items.
    """
    arrays = [np.asarray(s, dtype=np.int64).ravel() for s in seen]
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    items = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
    rows = np.repeat(np.arange(len(arrays), dtype=np.int64), lengths)
    bad = (items < 0) | (items >= num_items)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"seen item {int(items[first])} of user {int(user_ids[rows[first]])} is outside "
            f"[0, num_items={num_items}); pass num_items = the item vocabulary size "
            "(including the padding index 0)"
        )
    keep = items > 0
    return rows[keep], items[keep]


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    # np.unique is hash-based for integers in numpy >= 2.3, ~10x slower than a sort here.
    ordered = np.sort(values)
    keep = np.ones(ordered.shape, dtype=bool)
    keep[1:] = ordered[1:] != ordered[:-1]
    return ordered[keep]


def _first_valid(
    draws: np.ndarray, rows: np.ndarray, excluded: np.ndarray, num_items: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the first k draws that are neither excluded nor repeats, in draw order.

    Args:
        draws: (S, T) int64 items drawn for S rows.
        rows: (S,) row numbers, to look up (row * num_items + item) in `excluded`.
        excluded: Sorted unique (row * num_items + item) keys of the excluded items.
        num_items: Item vocabulary size.
        k: Items wanted per row.

    Returns:
        done (S,) bool: the row found k items; chosen (done.sum(), k) int64.
    """
    # Sorting each row's draws (stably: the earliest of equal draws stays first) finds
    # repeats as equal neighbours, and makes the (row, item) keys globally sorted, which
    # makes the lookup in `excluded` several times faster.
    order = np.argsort(draws, axis=1, kind="stable")  # (S, T)
    ordered = np.take_along_axis(draws, order, axis=1)
    invalid_ordered = np.zeros(draws.shape, dtype=bool)
    invalid_ordered[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    if excluded.size:
        keys = rows[:, None] * num_items + ordered
        position = np.minimum(np.searchsorted(excluded, keys), excluded.size - 1)
        invalid_ordered |= excluded[position] == keys
    invalid = np.empty_like(invalid_ordered)
    np.put_along_axis(invalid, order, invalid_ordered, axis=1)
    valid = ~invalid
    count = np.cumsum(valid, axis=1)  # (S, T)
    done = count[:, -1] >= k
    take = valid[done] & (count[done] <= k)  # exactly k per done row, in draw order
    return done, draws[done][take].reshape(-1, k)


def _sample_exact(
    rows: np.ndarray, keys: np.ndarray, excluded: np.ndarray, num_items: int, k: int
) -> np.ndarray:
    """The k unseen items with the smallest random keys: a uniform ordered k-subset.

    Args:
        rows: (S,) sorted rows to sample; each has at least k unseen items.
        keys: Stream keys of all rows of the chunk.
        excluded: Sorted (row * num_items + item) keys of the excluded items.
        num_items: Item vocabulary size.
        k: Items per row.

    Returns:
        (S, k) int64 items.
    """
    items = np.arange(1, num_items, dtype=np.int64)
    # Item i's key is draw i of the row's stream; halved so that excluded items, set
    # to the largest uint64, sort after every unseen one.
    random_keys = _stream(keys[rows], items) >> np.uint64(1)  # (S, I - 1)
    hits = excluded[np.isin(excluded // num_items, rows)]  # rows is sorted
    group_rows = np.searchsorted(rows, hits // num_items)
    random_keys[group_rows, hits % num_items - 1] = np.iinfo(np.uint64).max
    order = np.argsort(random_keys, axis=1, kind="stable")[:, :k]
    return items[order]


def _sample_chunk(
    num_items: int,
    seen: Sequence[np.ndarray],
    extra: np.ndarray | None,
    k: int,
    seed: int,
    user_ids: np.ndarray,
) -> np.ndarray:
    """Negatives of one chunk of users; see sample_negatives. `extra` (b,) is excluded too."""
    b = len(seen)
    rows, items = _flatten_seen(seen, num_items, user_ids)
    if extra is not None:
        rows = np.concatenate([rows, np.arange(b, dtype=np.int64)])
        items = np.concatenate([items, extra])
    excluded = _sorted_unique(rows * num_items + items)  # one key per excluded (row, item)
    unseen = (num_items - 1) - np.bincount(excluded // num_items, minlength=b)  # (b,)
    short = np.flatnonzero(unseen < k)
    if short.size:
        r = int(short[0])
        raise TooFewNegativesError(
            f"user {int(user_ids[r])} has {int(unseen[r])} unseen items but {k} negatives "
            f"were requested ({short.size} of {b} users sampled together are short); lower "
            "num_negatives or leave users with near-complete histories out of the evaluation"
        )
    keys = _user_keys(seed, user_ids)  # (b,)
    out = np.empty((b, k), dtype=np.int64)
    # Rejection sampling needs about k * (num_items - 1) / (unseen - k) draws; when
    # most of the catalogue is excluded that explodes, so those users are sampled exactly.
    exact = (unseen - k) < _MIN_ACCEPTANCE * (num_items - 1)
    pending = np.flatnonzero(~exact)
    total = int(np.ceil(1.25 * k)) + 16
    while pending.size:
        # Regenerating the prefix keeps each row's draws a prefix of its own stream, so
        # the result is the first k acceptable draws whatever the round it finished in.
        raw = _stream(keys[pending], np.arange(total))  # (S, total) uint64
        draws = (raw % np.uint64(num_items - 1)).astype(np.int64) + 1
        done, chosen = _first_valid(draws, pending, excluded, num_items, k)
        out[pending[done]] = chosen
        pending = pending[~done]
        total *= 2
    exact_rows = np.flatnonzero(exact)
    group = max(1, _EXACT_GROUP_ENTRIES // (num_items - 1))
    for start in range(0, exact_rows.size, group):
        out[exact_rows[start : start + group]] = _sample_exact(
            exact_rows[start : start + group], keys, excluded, num_items, k
        )
    return out


def _sample(
    num_items: int,
    seen: Sequence[np.ndarray],
    extra: np.ndarray | None,
    num_negatives: int,
    seed: int,
    user_ids: np.ndarray,
) -> np.ndarray:
    if num_items < 2:
        raise ValueError(f"num_items must be >= 2 (item 0 is padding), got {num_items}")
    if num_negatives < 1:
        raise ValueError(f"num_negatives must be >= 1, got {num_negatives}")
    if not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    out = np.empty((len(seen), num_negatives), dtype=np.int64)
    for start in range(0, len(seen), _SAMPLE_CHUNK_USERS):
        stop = start + _SAMPLE_CHUNK_USERS
        out[start:stop] = _sample_chunk(
            num_items,
            seen[start:stop],
            None if extra is None else extra[start:stop],
            num_negatives,
            int(seed),
            user_ids[start:stop],
        )
    return out


def sample_negatives(
    num_items: int,
    seen: list[np.ndarray],
    num_negatives: int,
    seed: int,
    *,
    user_ids: np.ndarray | None = None,
) -> np.ndarray:
    """Draw negatives per user, uniformly without replacement from the unseen items.

    Each user's draws come from its own counter-based SplitMix64 stream keyed by
    (seed, user id); the negatives are the first `num_negatives` draws that are
    neither seen nor repeats. A user's negatives therefore depend only on the seed,
    its id and its seen items, never on the other users or on the chunking. Users
    who have seen more than about 7/8 of the catalogue are sampled exactly instead
    (random keys on the unseen items), which has the same distribution.

    Args:
        num_items: Item vocabulary size; candidates are 1..num_items-1 (0 is padding/OOV).
        seen: U arrays of item indices per user (any order, duplicates and 0 allowed).
        num_negatives: Negatives per user.
        seed: Non-negative int; the same seed gives the same negatives.
        user_ids: (U,) ids keying each user's stream; default 0..U-1 (the position).
            Pass stable ids to get the same negatives for a user in any subset.

    Returns:
        (U, num_negatives) int64 negatives, unique within each row.

    Raises:
        TooFewNegativesError: (a ValueError) A user has fewer than num_negatives unseen
            items; the message names the first such user.
        ValueError: A seen item is outside [0, num_items), num_items < 2,
            num_negatives < 1, a negative seed, or user_ids of the wrong shape.
    """
    if user_ids is None:
        ids = np.arange(len(seen), dtype=np.int64)
    else:
        ids = _as_int_array("user_ids", user_ids, 1)
        if ids.shape != (len(seen),):
            raise ValueError(f"user_ids has shape {ids.shape} but seen has {len(seen)} users")
    return _sample(num_items, seen, None, num_negatives, seed, ids)


def rank_of_target(
    target_scores: np.ndarray, other_scores: np.ndarray, other_mask: np.ndarray | None = None
) -> np.ndarray:
    """0-based rank of each user's target among its candidates, ties pessimistic.

    rank = number of unmasked other candidates scoring >= the target, so the target
    loses every tie (a constant scorer ranks last, not first). Scores are cast to
    float32 before comparing: models score in fp32, and a target score computed in
    fp64 (or by another kernel) may differ from an fp32-equal competitor in bits
    below fp32 precision, which would turn a tie into a spurious win or loss.

    Args:
        target_scores: (U,) target scores.
        other_scores: (U, C) scores of the other candidates.
        other_mask: (U, C) bool, True where a candidate is excluded (e.g. a seen item
            in full ranking); None ranks against all C.

    Returns:
        (U,) int64 ranks in [0, C].

    Raises:
        ValueError: Shapes disagree, or a target or unmasked candidate score is NaN.
    """
    target = np.asarray(target_scores).astype(np.float32, copy=False)
    others = np.asarray(other_scores).astype(np.float32, copy=False)
    if target.ndim != 1 or others.ndim != 2 or others.shape[0] != target.shape[0]:
        raise ValueError(
            f"target_scores must be (U,) and other_scores (U, C), got {target.shape} "
            f"and {others.shape}"
        )
    beats = others >= target[:, None]  # (U, C)
    nan = np.isnan(others)
    if other_mask is not None:
        mask = np.asarray(other_mask, dtype=bool)
        if mask.shape != others.shape:
            raise ValueError(f"other_mask has shape {mask.shape}, expected {others.shape}")
        beats &= ~mask
        nan &= ~mask
    if np.isnan(target).any() or nan.any():
        raise ValueError(
            f"{int(np.isnan(target).sum())} target and {int(nan.sum())} candidate scores "
            "are NaN; NaN cannot be ranked, fix the model or score_fn"
        )
    return beats.sum(axis=1, dtype=np.int64)


def metrics_from_ranks(ranks: np.ndarray, ks: Sequence[int], suffix: str) -> dict[str, float]:
    """HR@K, NDCG@K (one relevant item) and MRR of 0-based target ranks.

    HR@K = mean(rank < K); NDCG@K = mean(1 / log2(rank + 2) if rank < K else 0);
    MRR = mean(1 / (rank + 1)). An `UNRANKED` user (an out-of-vocabulary target) counts
    in every mean with 0.

    Args:
        ranks: (U,) integer ranks, each >= 0 or `UNRANKED`.
        ks: Cutoffs, each >= 1.
        suffix: Key suffix, "sampled" or "full".

    Returns:
        {f"hr@{k}_{suffix}", f"ndcg@{k}_{suffix}" for k in ks, f"mrr_{suffix}"}.

    Raises:
        ValueError: ranks is empty, not 1-d integers, or negative other than
            `UNRANKED`; a k is < 1.
    """
    r = _as_int_array("ranks", ranks, 1)
    if r.size == 0:
        raise ValueError("ranking metrics of zero users are undefined")
    if ((r < 0) & (r != UNRANKED)).any():
        raise ValueError(f"ranks must be >= 0 or UNRANKED ({UNRANKED}), got min {int(r.min())}")
    if not ks or any(int(k) < 1 for k in ks):
        raise ValueError(f"ks must be non-empty cutoffs >= 1, got {list(ks)}")
    ranked = r != UNRANKED  # (U,)
    # An unranked user's gain and reciprocal rank are 0 (its rank stands in as 0 only
    # to keep the log and the division finite; np.where then discards it).
    safe = np.where(ranked, r, 0)
    gain = np.where(ranked, 1.0 / np.log2(safe + 2.0), 0.0)  # (U,)
    metrics: dict[str, float] = {}
    for k in ks:
        hit = ranked & (r < k)
        metrics[f"hr@{k}_{suffix}"] = float(hit.mean())
        metrics[f"ndcg@{k}_{suffix}"] = float(np.where(hit, gain, 0.0).mean())
    metrics[f"mrr_{suffix}"] = float(np.where(ranked, 1.0 / (safe + 1.0), 0.0).mean())
    return metrics


def _call_scores(score_fn: ScoreFn, users: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    scores = np.asarray(score_fn(users, candidates))
    if scores.shape != candidates.shape:
        raise ValueError(
            f"score_fn returned shape {scores.shape} for candidates {candidates.shape}; "
            "it must return one score per candidate"
        )
    return scores


@dataclass(frozen=True)
class TargetRanks:
    """Per-user 0-based ranks of the targets, in the order of the users given.

    Kept per user (not as metrics) so that parts of an evaluation ranked apart (in
    several processes) can be concatenated in user order and give, through
    metrics_from_ranks, exactly the metrics of one pass.

    Attributes:
        sampled: (U,) int64 ranks under the sampled protocol.
        full: (U,) int64 ranks under the full protocol, None when it did not run.
    """

    sampled: np.ndarray
    full: np.ndarray | None


def rank_targets(
    score_fn: ScoreFn,
    users: np.ndarray,
    targets: np.ndarray,
    seen: list[np.ndarray],
    num_items: int,
    num_negatives: int = 100,
    seed: int = 0,
    full: bool = True,
    block_users: int = 1024,
) -> TargetRanks:
    """Rank each user's target under the sampled and (optionally) the full protocol.

    Sampled: candidates = [target] + num_negatives items the user has not seen
    (neither in `seen` nor the target), from sample_negatives keyed by `users`.
    Full: candidates = items 1..num_items-1 (a read-only broadcast view, the same
    row for every user: score candidates[0] against all users at once, or copy with
    np.ascontiguousarray before torch.from_numpy), the user's seen items other than
    the target masked out.
    Users are scored in blocks of `block_users` from the first one, so score_fn sees
    the same blocks whenever the same users are passed from a block boundary. A user
    whose target is 0 (out of vocabulary) is ranked `UNRANKED` in both protocols and
    left out of its block's score_fn call and negatives (see the module docstring).
    Peak memory is about block_users * num_items * (score bytes + 6) in full mode.

    Args:
        score_fn: score_fn(users (b,), candidate_items (b, C)) -> (b, C) numpy scores,
            higher is better. It receives the `users` values of the block.
        users: (U,) user indices, passed to score_fn and keying the negatives, so a
            user gets the same negatives whatever else is evaluated.
        targets: (U,) held-out items, in [0, num_items); 0 is out of vocabulary.
        seen: U arrays: each user's seen items (its history; may include the target).
        num_items: Item vocabulary size, padding index 0 included.
        num_negatives: Sampled negatives per user (SASRec: 100).
        seed: Seed of the negatives.
        full: Also run the full-ranking protocol.
        block_users: Users scored per score_fn call.

    Returns:
        The ranks, one per user, in the order of `users`.

    Raises:
        TooFewNegativesError: (a ValueError) A user has fewer than num_negatives unseen items.
        ValueError: Inputs disagree in length, are empty, a target is negative or not
            below num_items, a seen item is out of range, or score_fn returns the wrong
            shape or NaN.
    """
    user_ids = _as_int_array("users", users, 1)
    target_items = _as_int_array("targets", targets, 1)
    if not (len(user_ids) == len(target_items) == len(seen)):
        raise ValueError(
            f"users ({len(user_ids)}), targets ({len(target_items)}) and seen ({len(seen)}) "
            "must have one entry per evaluated user"
        )
    if len(user_ids) == 0:
        raise ValueError("no users to evaluate")
    if block_users < 1:
        raise ValueError(f"block_users must be >= 1, got {block_users}")
    if num_items < 2:
        raise ValueError(f"num_items must be >= 2 (item 0 is padding), got {num_items}")
    bad = np.flatnonzero((target_items < 0) | (target_items >= num_items))
    if bad.size:
        u = int(bad[0])
        raise ValueError(
            f"target {int(target_items[u])} of user {int(user_ids[u])} is outside "
            f"[0, num_items={num_items}); pass num_items = the item vocabulary size"
        )
    all_items = np.arange(1, num_items, dtype=np.int64)
    sampled_ranks = np.full(len(user_ids), UNRANKED, dtype=np.int64)
    full_ranks = np.full(len(user_ids), UNRANKED, dtype=np.int64)
    for start in range(0, len(user_ids), block_users):
        # The block's in-vocabulary users; the others stay UNRANKED. Blocks are cut
        # before this, so which users share a score_fn call does not depend on where
        # the out-of-vocabulary targets are.
        block = start + np.flatnonzero(target_items[start : start + block_users] != 0)
        if block.size == 0:
            continue
        block_ids, block_targets = user_ids[block], target_items[block]
        block_seen = [seen[i] for i in block]
        b = len(block_ids)

        negatives = _sample(
            num_items, block_seen, block_targets, num_negatives, seed, block_ids
        )  # (b, N)
        candidates = np.concatenate([block_targets[:, None], negatives], axis=1)  # (b, 1 + N)
        scores = _call_scores(score_fn, block_ids, candidates)
        sampled_ranks[block] = rank_of_target(scores[:, 0], scores[:, 1:])

        if full:
            candidates = np.broadcast_to(all_items, (b, num_items - 1))  # (b, I - 1)
            scores = _call_scores(score_fn, block_ids, candidates)
            rows, items = _flatten_seen(block_seen, num_items, block_ids)
            mask = np.zeros(candidates.shape, dtype=bool)
            mask[rows, items - 1] = True
            # The target's own column is not an "other" candidate, seen or not.
            mask[np.arange(b), block_targets - 1] = True
            full_ranks[block] = rank_of_target(
                scores[np.arange(b), block_targets - 1], scores, mask
            )
    return TargetRanks(sampled=sampled_ranks, full=full_ranks if full else None)


def evaluate_ranking(
    score_fn: ScoreFn,
    users: np.ndarray,
    targets: np.ndarray,
    seen: list[np.ndarray],
    num_items: int,
    ks: Sequence[int] = (10,),
    num_negatives: int = 100,
    seed: int = 0,
    full: bool = True,
    block_users: int = 1024,
) -> RankingResult:
    """HR@K, NDCG@K and MRR of rank_targets: the sampled and (optionally) full protocol.

    Args:
        score_fn, users, targets, seen, num_items, num_negatives, seed, full,
            block_users: As for rank_targets.
        ks: Cutoffs of HR@K and NDCG@K.

    Returns:
        The metrics (sampled keys, then full keys when full) and the number of users.

    Raises:
        TooFewNegativesError: (a ValueError) A user has fewer than num_negatives unseen items.
        ValueError: As rank_targets, or a k is < 1.
    """
    ranks = rank_targets(
        score_fn, users, targets, seen, num_items, num_negatives, seed, full, block_users
    )
    metrics = metrics_from_ranks(ranks.sampled, ks, "sampled")
    if ranks.full is not None:
        metrics |= metrics_from_ranks(ranks.full, ks, "full")
    return RankingResult(metrics=metrics, num_users=len(ranks.sampled))


def popularity_scores(train_item_counts: np.ndarray) -> ScoreFn:
    """score_fn of the popularity baseline: an item's score is its training count.

    Args:
        train_item_counts: (num_items,) interactions per item in the training split
            (index 0, the padding, is never a candidate).

    Returns:
        score_fn(users (b,), candidate_items (b, C)) -> (b, C) float64 counts; the
        same for every user. Counts above 2**24 are not exact in fp32, so
        rank_of_target may treat near-equal huge counts as (pessimistic) ties.

    Raises:
        ValueError: The counts are not a 1-d array of finite non-negative numbers.
    """
    counts = np.asarray(train_item_counts, dtype=np.float64)
    if counts.ndim != 1 or not np.isfinite(counts).all() or (counts < 0).any():
        raise ValueError(
            "train_item_counts must be a 1-d array of finite non-negative counts, "
            f"got shape {counts.shape}"
        )

    def score_fn(users: np.ndarray, candidate_items: np.ndarray) -> np.ndarray:
        if candidate_items.size and int(candidate_items.max()) >= counts.size:
            raise ValueError(
                f"candidate item {int(candidate_items.max())} has no count: "
                f"train_item_counts has {counts.size} entries, it needs num_items"
            )
        return counts[candidate_items]

    return score_fn


# Histories encoded per forward pass when computing the users' states.
_ENCODE_BATCH = 256


def user_states(model: SASRec, histories: torch.Tensor, batch: int = _ENCODE_BATCH) -> np.ndarray:
    """The hidden state at the last position of each history, in fp32.

    Args:
        model: The trained model (eval mode).
        histories: (U, L) int64, left-padded with 0.
        batch: Histories per forward pass.

    Returns:
        (U, D) float32.
    """
    states = []
    with torch.no_grad():
        for start in range(0, len(histories), batch):
            states.append(model(histories[start : start + batch])[:, -1].float())  # (b, D)
    return torch.cat(states).numpy()


def model_scores(states: np.ndarray, table: np.ndarray, first_row: int = 0) -> ScoreFn:
    """score_fn of a user-state model: users are row numbers; row `first_row + i` is
    `states[i]`.

    Args:
        states: (U, D) float32 user states.
        table: (V, D) float32 item table.
        first_row: The row number of states[0] (a rank's first row).

    Returns:
        score_fn(rows (b,), candidates (b, C)) -> (b, C) float32 dot products.
    """

    def score_fn(rows: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        users = states[rows - first_row]  # (b, D)
        if candidates.strides[0] == 0:
            # Full ranking hands one row broadcast to every user: one matmul, no gather.
            return users @ table[candidates[0]].T  # (b, C)
        return np.einsum("bd,bcd->bc", users, table[candidates])  # (b, C)

    return score_fn


def state_score_fn(
    model: SASRec, histories: torch.Tensor, first_row: int, block_users: int
) -> ScoreFn:
    """score_fn of a SASRec over rows `first_row ...`: user states dotted with the items.

    Args:
        model: The trained model (eval mode).
        histories: (U, L) int64, left-padded with 0; row `first_row + i` is histories[i].
        first_row: The row number of histories[0], on a block boundary.
        block_users: Rows encoded together.

    Returns:
        score_fn(rows (b,), candidates (b, C)) -> (b, C) float32 dot products.
    """
    # Encoded block by block, so a row's state never depends on where a rank starts.
    states = np.concatenate(
        [
            user_states(model, histories[i : i + block_users])
            for i in range(0, len(histories), block_users)
        ]
    )  # (U, D)
    with torch.no_grad():
        table = model.item_table().float().numpy()  # (V, D), side features included
    return model_scores(states, table, first_row=first_row)


def candidate_score_fn(
    model: BST, histories: torch.Tensor, first_row: int, block_users: int
) -> ScoreFn:
    """score_fn of a BST: each candidate scored by its own pass after the history.

    Args:
        model: The trained BST (eval mode).
        histories: (U, L) int64, left-padded with 0; row `first_row + i` is histories[i].
        first_row: The row number of histories[0].
        block_users: Unused: a BST scores the candidates the protocol hands it, by block.

    Returns:
        score_fn(rows (b,), candidates (b, C)) -> (b, C) float32 logits.
    """

    def score_fn(rows: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            logits = score_candidates(
                model, histories[torch.from_numpy(rows - first_row)], torch.from_numpy(candidates)
            )  # (b, C)
        return logits.float().numpy()

    return score_fn
