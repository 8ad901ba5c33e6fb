import math

import numpy as np
import pytest

from artifacts.errors import DataError
from training.sequence import ranking
from training.sequence.ranking import (
    UNRANKED,
    RankingResult,
    evaluate_ranking,
    metrics_from_ranks,
    popularity_scores,
    rank_of_target,
    rank_targets,
    sample_negatives,
)


def random_histories(
    num_users: int, num_items: int, max_seen: int, seed: int
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Targets and seen lists (with repeats and the padding 0 mixed in)."""
    rng = np.random.default_rng(seed)
    targets = rng.integers(1, num_items, size=num_users)
    seen = [
        rng.integers(0, num_items, size=rng.integers(0, max_seen + 1)) for _ in range(num_users)
    ]
    return targets, seen


def unmasked_others(targets: np.ndarray, seen: list[np.ndarray], num_items: int) -> np.ndarray:
    """(U,) candidates a target competes with in full ranking: all items minus seen and itself."""
    masked = [np.setdiff1d(s[(s > 0)], [t]).size for s, t in zip(seen, targets, strict=True)]
    return (num_items - 2) - np.array(masked)


# --- metrics_from_ranks -------------------------------------------------------------


def test_metrics_from_hand_computed_ranks() -> None:
    metrics = metrics_from_ranks(np.array([0, 1, 3, 10]), ks=(1, 5, 10), suffix="full")
    assert set(metrics) == {
        "hr@1_full",
        "ndcg@1_full",
        "hr@5_full",
        "ndcg@5_full",
        "hr@10_full",
        "ndcg@10_full",
        "mrr_full",
    }
    assert metrics["hr@1_full"] == 0.25
    assert metrics["ndcg@1_full"] == 0.25
    assert metrics["hr@5_full"] == 0.75
    # rank 10 is the 11th place: outside the top 10.
    assert metrics["hr@10_full"] == 0.75
    expected_ndcg = (1 + 1 / math.log2(3) + 1 / math.log2(5)) / 4
    assert metrics["ndcg@5_full"] == pytest.approx(expected_ndcg, abs=1e-15)
    assert metrics["ndcg@10_full"] == pytest.approx(expected_ndcg, abs=1e-15)
    assert metrics["mrr_full"] == pytest.approx((1 + 1 / 2 + 1 / 4 + 1 / 11) / 4, abs=1e-15)


def test_an_unranked_user_is_a_miss_in_the_denominator() -> None:
    # Ranks 0 and 3, and one out-of-vocabulary target: every mean is over 3 users.
    metrics = metrics_from_ranks(np.array([0, UNRANKED, 3]), ks=(1, 5), suffix="sampled")
    assert metrics == {
        "hr@1_sampled": 1 / 3,
        "ndcg@1_sampled": 1 / 3,
        "hr@5_sampled": 2 / 3,
        "ndcg@5_sampled": (1 + 1 / math.log2(5)) / 3,
        "mrr_sampled": (1 + 1 / 4) / 3,
    }
    assert metrics_from_ranks(np.array([UNRANKED]), (1,), "full") == {
        "hr@1_full": 0.0,
        "ndcg@1_full": 0.0,
        "mrr_full": 0.0,
    }


def test_metrics_from_ranks_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="zero users"):
        metrics_from_ranks(np.array([], dtype=np.int64), (10,), "full")
    with pytest.raises(ValueError, match=">= 0 or UNRANKED"):
        metrics_from_ranks(np.array([0, -2]), (10,), "full")
    with pytest.raises(ValueError, match="ks"):
        metrics_from_ranks(np.array([0, 1]), (0,), "full")


# --- rank_of_target -----------------------------------------------------------------


def test_rank_counts_ties_against_the_target() -> None:
    ranks = rank_of_target(
        np.array([0.5, 0.5, 0.9]),
        np.array([[0.5, 0.4, 0.6], [0.1, 0.2, 0.3], [0.9, 0.9, 0.9]]),
    )
    assert ranks.tolist() == [2, 0, 3]
    assert ranks.dtype == np.int64


def test_rank_mask_excludes_candidates() -> None:
    others = np.array([[0.9, 0.8, 0.1], [0.9, 0.8, 0.1]])
    mask = np.array([[True, False, False], [True, True, True]])
    assert rank_of_target(np.array([0.5, 0.5]), others, mask).tolist() == [1, 0]


def test_rank_compares_in_fp32() -> None:
    # The same value scored once in fp64 and once in fp32 must tie, not win.
    target = np.array([0.1], dtype=np.float64)
    other = np.array([[0.1]], dtype=np.float32)
    assert float(other[0, 0]) != target[0]
    assert rank_of_target(target, other).tolist() == [1]


def test_rank_rejects_nan_unless_masked() -> None:
    others = np.array([[np.nan, 0.1]])
    with pytest.raises(ValueError, match="NaN"):
        rank_of_target(np.array([0.5]), others)
    with pytest.raises(ValueError, match="NaN"):
        rank_of_target(np.array([np.nan]), np.array([[0.1]]))
    assert rank_of_target(np.array([0.5]), others, np.array([[True, False]])).tolist() == [0]


# --- sample_negatives ---------------------------------------------------------------


def test_negatives_avoid_seen_items_and_padding_and_are_unique() -> None:
    num_items, k = 300, 100
    _, seen = random_histories(2000, num_items, max_seen=150, seed=0)
    negatives = sample_negatives(num_items, seen, k, seed=3)
    assert negatives.shape == (2000, k)
    assert negatives.dtype == np.int64
    assert negatives.min() >= 1 and negatives.max() < num_items
    for row, items in zip(negatives, seen, strict=True):
        assert np.unique(row).size == k
        assert not np.isin(row, items).any()


def test_negatives_are_reproducible_and_depend_on_the_seed() -> None:
    _, seen = random_histories(500, 1000, max_seen=50, seed=1)
    first = sample_negatives(1000, seen, 100, seed=7)
    np.testing.assert_array_equal(first, sample_negatives(1000, seen, 100, seed=7))
    other = sample_negatives(1000, seen, 100, seed=8)
    assert (first != other).mean() > 0.9


def test_negatives_of_a_user_do_not_depend_on_other_users(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, seen = random_histories(100, 500, max_seen=100, seed=2)
    ids = np.arange(100) * 3 + 11
    everyone = sample_negatives(500, seen, 50, seed=0, user_ids=ids)
    subset = sample_negatives(500, seen[40:60], 50, seed=0, user_ids=ids[40:60])
    np.testing.assert_array_equal(subset, everyone[40:60])
    monkeypatch.setattr(ranking, "_SAMPLE_CHUNK_USERS", 7)
    np.testing.assert_array_equal(sample_negatives(500, seen, 50, seed=0, user_ids=ids), everyone)


@pytest.mark.parametrize("path", ["rejection", "exact"])
@pytest.mark.parametrize(("seen_items", "k"), [(np.arange(1, 6), 3), (np.arange(1, 18), 2)])
def test_negatives_are_uniform_over_unseen_items(
    seen_items: np.ndarray, k: int, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # By default the first case (15 of 20 unseen) is sampled by rejection and the
    # second (2 of 3 unseen needed) exactly; force each case down both paths.
    monkeypatch.setattr(ranking, "_MIN_ACCEPTANCE", 0.0 if path == "rejection" else 2.0)
    num_items, num_users = 21, 20_000
    negatives = sample_negatives(num_items, [seen_items] * num_users, k, seed=0)
    counts = np.bincount(negatives.ravel(), minlength=num_items)
    assert counts[0] == 0 and counts[seen_items].sum() == 0
    assert all(np.unique(row).size == k for row in negatives[:100])
    unseen = np.setdiff1d(np.arange(1, num_items), seen_items)
    p = k / unseen.size  # chance a given unseen item is among a user's k
    std = math.sqrt(num_users * p * (1 - p))
    assert np.abs(counts[unseen] - num_users * p).max() < 5 * std
    # The first negative alone is uniform too (a uniform ordered subset, not just a set).
    first = np.bincount(negatives[:, 0], minlength=num_items)[unseen]
    q = 1 / unseen.size
    assert np.abs(first - num_users * q).max() < 5 * math.sqrt(num_users * q * (1 - q))


def test_exact_path_returns_every_unseen_item_when_k_equals_the_pool() -> None:
    negatives = sample_negatives(40, [np.arange(1, 31)], 9, seed=0)
    assert sorted(negatives[0].tolist()) == list(range(31, 40))


def test_too_few_unseen_items_names_the_user() -> None:
    seen = [np.arange(1, 5), np.arange(1, 48), np.array([], dtype=np.int64)]
    with pytest.raises(ValueError, match="user 11 has 2 unseen items but 5") as error:
        sample_negatives(50, seen, 5, seed=0, user_ids=np.array([10, 11, 12]))
    assert isinstance(error.value, DataError)


def test_seen_item_beyond_the_vocabulary_is_rejected() -> None:
    with pytest.raises(ValueError, match="seen item 50 of user 1 .*num_items"):
        sample_negatives(50, [np.array([1]), np.array([50])], 5, seed=0)


# --- evaluate_ranking ---------------------------------------------------------------


NUM_ITEMS = 500


@pytest.fixture(scope="module")
def histories() -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    targets, seen = random_histories(20_000, NUM_ITEMS, max_seen=60, seed=4)
    return np.arange(targets.size), targets, seen


def test_constant_scorer_never_hits(histories) -> None:
    users, targets, seen = histories
    users, targets, seen = users[:2000], targets[:2000], seen[:2000]

    def constant(u: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        return np.ones(candidates.shape, dtype=np.float32)

    result = evaluate_ranking(constant, users, targets, seen, NUM_ITEMS)
    assert isinstance(result, RankingResult)
    assert result.num_users == 2000
    for key in ("hr@10_sampled", "ndcg@10_sampled", "hr@10_full", "ndcg@10_full"):
        assert result.metrics[key] == 0.0
    # Pessimistic ties put the target last: rank 100 of 101, and behind every unmasked item.
    assert result.metrics["mrr_sampled"] == pytest.approx(1 / 101, abs=1e-15)
    others = unmasked_others(targets, seen, NUM_ITEMS)
    assert result.metrics["mrr_full"] == pytest.approx(np.mean(1 / (others + 1)), abs=1e-12)


def test_oracle_scorer_is_perfect(histories) -> None:
    users, targets, seen = histories

    def oracle(u: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        return (candidates == targets[u][:, None]).astype(np.float32)

    result = evaluate_ranking(oracle, users[:3000], targets[:3000], seen[:3000], NUM_ITEMS)
    assert result.metrics == {key: 1.0 for key in result.metrics}
    assert len(result.metrics) == 6


def test_random_scorer_matches_chance(histories) -> None:
    users, targets, seen = histories
    rng = np.random.default_rng(0)

    def random_scores(u: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        return rng.random(candidates.shape)

    result = evaluate_ranking(
        random_scores, users, targets, seen, NUM_ITEMS, ks=(10,), num_negatives=100
    )
    n = users.size
    # Sampled: the target's rank is uniform on 0..100, so HR@10 = 10/101 and
    # MRR = H_101 / 101. Tolerances are 3.5 binomial/sample standard deviations over
    # n = 20,000 users (about 1 in 2,000 for a correct sampler; the seed is fixed):
    # HR std = sqrt(p (1 - p) / n) = 0.0021, so an off-by-one rank (HR = 9/101, 4.7
    # std away) or a biased sampler fails.
    p = 10 / 101
    assert abs(result.metrics["hr@10_sampled"] - p) < 3.5 * math.sqrt(p * (1 - p) / n)
    reciprocal = 1 / np.arange(1, 102)
    mrr_std = reciprocal.std() / math.sqrt(n)
    assert abs(result.metrics["mrr_sampled"] - reciprocal.mean()) < 3.5 * mrr_std
    ndcg = np.where(np.arange(101) < 10, 1 / np.log2(np.arange(101) + 2), 0.0)
    assert abs(result.metrics["ndcg@10_sampled"] - ndcg.mean()) < 3.5 * ndcg.std() / math.sqrt(n)
    # Full: uniform on 0..others, where others excludes the masked seen items.
    others = unmasked_others(targets, seen, NUM_ITEMS)
    hit = np.minimum(10, others + 1) / (others + 1)  # per-user chance of a hit
    hr_std = math.sqrt((hit * (1 - hit)).sum()) / n
    assert abs(result.metrics["hr@10_full"] - hit.mean()) < 3.5 * hr_std


def test_candidates_exclude_seen_items_and_do_not_depend_on_the_block(histories) -> None:
    users, targets, seen = histories
    users, targets, seen = users[:300], targets[:300], seen[:300]

    def recorder(log: dict[int, np.ndarray]):
        def score_fn(u: np.ndarray, candidates: np.ndarray) -> np.ndarray:
            if candidates.shape[1] == 11:  # the sampled protocol's call
                for user, row in zip(u, candidates, strict=True):
                    log[int(user)] = row.copy()
            else:
                np.testing.assert_array_equal(candidates[0], np.arange(1, NUM_ITEMS))
            return np.zeros(candidates.shape)

        return score_fn

    small, large, reversed_ = {}, {}, {}
    evaluate_ranking(
        recorder(small), users, targets, seen, NUM_ITEMS, num_negatives=10, block_users=7
    )
    evaluate_ranking(recorder(large), users, targets, seen, NUM_ITEMS, num_negatives=10)
    evaluate_ranking(
        recorder(reversed_), users[::-1], targets[::-1], seen[::-1], NUM_ITEMS, num_negatives=10
    )
    for user, target, items in zip(users, targets, seen, strict=True):
        row = small[int(user)]
        assert row[0] == target
        negatives = row[1:]
        assert np.unique(negatives).size == 10
        assert negatives.min() >= 1
        assert not np.isin(negatives, items).any() and target not in negatives
        np.testing.assert_array_equal(row, large[int(user)])
        np.testing.assert_array_equal(row, reversed_[int(user)])


def test_metrics_do_not_depend_on_the_block_size(histories) -> None:
    users, targets, seen = histories
    users, targets, seen = users[:500], targets[:500], seen[:500]
    counts = np.bincount(np.concatenate(seen), minlength=NUM_ITEMS)
    scorer = popularity_scores(counts)
    one = evaluate_ranking(scorer, users, targets, seen, NUM_ITEMS, ks=(1, 10), block_users=33)
    two = evaluate_ranking(scorer, users, targets, seen, NUM_ITEMS, ks=(1, 10), block_users=500)
    assert one == two


def test_full_ranking_masks_seen_items() -> None:
    num_items = 10
    top = {3: 10.0, 5: 9.0, 7: 5.0, 2: 1.0}

    def seen_on_top(u: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        return np.vectorize(lambda item: top.get(int(item), 0.0))(candidates)

    users, targets = np.array([0, 1, 2]), np.array([7, 7, 7])
    seen = [np.array([3, 5]), np.array([3, 5, 7]), np.array([3])]
    result = evaluate_ranking(
        seen_on_top, users, targets, seen, num_items, ks=(1,), num_negatives=3
    )
    # User 0: 3 and 5 are masked; user 1 has also seen the target, which stays ranked;
    # user 2 has not seen item 5, which outranks the target.
    assert result.metrics["hr@1_full"] == pytest.approx(2 / 3)
    assert result.metrics["mrr_full"] == pytest.approx((1 + 1 + 1 / 2) / 3)


def test_popularity_baseline_on_a_toy_catalogue() -> None:
    # Items 1..5; items 4 and 5 tie.
    counts = np.array([0, 50, 40, 30, 20, 20])
    users, targets = np.array([0, 1, 2]), np.array([1, 3, 5])
    seen = [np.array([], dtype=np.int64), np.array([1]), np.array([], dtype=np.int64)]
    result = evaluate_ranking(
        popularity_scores(counts), users, targets, seen, 6, ks=(1, 2), num_negatives=3
    )
    # Sampled ranks: 0 (most popular); 1 (negatives are exactly {2, 4, 5}, only 2 beats
    # it); 3 (every other item, item 4 by the tie). Full ranks: 0; 1 (1 is masked); 4.
    assert result.metrics == pytest.approx(
        {
            "hr@1_sampled": 1 / 3,
            "ndcg@1_sampled": 1 / 3,
            "hr@2_sampled": 2 / 3,
            "ndcg@2_sampled": (1 + 1 / math.log2(3)) / 3,
            "mrr_sampled": (1 + 1 / 2 + 1 / 4) / 3,
            "hr@1_full": 1 / 3,
            "ndcg@1_full": 1 / 3,
            "hr@2_full": 2 / 3,
            "ndcg@2_full": (1 + 1 / math.log2(3)) / 3,
            "mrr_full": (1 + 1 / 2 + 1 / 5) / 3,
        },
        abs=1e-15,
    )


def test_an_oov_target_is_a_miss_for_the_model_and_the_baseline_alike() -> None:
    # The toy catalogue above plus a 4th user whose target is out of vocabulary (0).
    counts = np.array([0, 50, 40, 30, 20, 20])
    users, targets = np.array([0, 1, 2, 3]), np.array([1, 3, 5, 0])
    empty = np.array([], dtype=np.int64)
    seen = [empty, np.array([1]), empty, np.array([2])]
    scored_users: list[int] = []

    def model(block_users: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        scored_users.extend(block_users.tolist())
        return popularity_scores(counts)(block_users, candidates)

    expected_ranks = {"sampled": [0, 1, 3, UNRANKED], "full": [0, 1, 4, UNRANKED]}
    for score_fn in (model, popularity_scores(counts)):
        ranks = rank_targets(score_fn, users, targets, seen, 6, num_negatives=3, block_users=3)
        assert ranks.sampled.tolist() == expected_ranks["sampled"]
        assert ranks.full.tolist() == expected_ranks["full"]
    assert 3 not in scored_users  # the OOV user is never scored, never sampled for
    result = evaluate_ranking(
        popularity_scores(counts), users, targets, seen, 6, ks=(1, 2), num_negatives=3
    )
    # The test above's figures with 4 users in the denominator, the 4th a miss.
    assert result.num_users == 4
    assert result.metrics == pytest.approx(
        {
            "hr@1_sampled": 1 / 4,
            "ndcg@1_sampled": 1 / 4,
            "hr@2_sampled": 2 / 4,
            "ndcg@2_sampled": (1 + 1 / math.log2(3)) / 4,
            "mrr_sampled": (1 + 1 / 2 + 1 / 4) / 4,
            "hr@1_full": 1 / 4,
            "ndcg@1_full": 1 / 4,
            "hr@2_full": 2 / 4,
            "ndcg@2_full": (1 + 1 / math.log2(3)) / 4,
            "mrr_full": (1 + 1 / 2 + 1 / 5) / 4,
        },
        abs=1e-15,
    )


def test_sampled_only_when_full_is_off() -> None:
    result = evaluate_ranking(
        popularity_scores(np.arange(20)),
        np.array([0]),
        np.array([19]),
        [np.array([1])],
        20,
        full=False,
        num_negatives=5,
    )
    assert set(result.metrics) == {"hr@10_sampled", "ndcg@10_sampled", "mrr_sampled"}
    assert result.metrics["mrr_sampled"] == 1.0


def test_evaluate_rejects_bad_input() -> None:
    scorer = popularity_scores(np.arange(20))
    one_seen = [np.array([1])]
    with pytest.raises(ValueError, match="target -1 of user 5"):
        evaluate_ranking(scorer, np.array([5]), np.array([-1]), one_seen, 20, num_negatives=5)
    with pytest.raises(ValueError, match="target 20 of user 5"):
        evaluate_ranking(scorer, np.array([5]), np.array([20]), one_seen, 20, num_negatives=5)
    with pytest.raises(ValueError, match="one entry per evaluated user"):
        evaluate_ranking(scorer, np.array([5, 6]), np.array([3]), one_seen, 20)
    with pytest.raises(ValueError, match="user 5 has 17 unseen items but 100"):
        evaluate_ranking(scorer, np.array([5]), np.array([3]), one_seen, 20)

    def wrong_shape(u: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        return np.zeros(candidates.shape[0])

    with pytest.raises(ValueError, match="one score per candidate"):
        evaluate_ranking(wrong_shape, np.array([5]), np.array([3]), one_seen, 20, num_negatives=5)


def test_popularity_scores_rejects_short_counts() -> None:
    with pytest.raises(ValueError, match="needs num_items"):
        popularity_scores(np.arange(5))(np.array([0]), np.array([[1, 7]]))
    with pytest.raises(ValueError, match="non-negative"):
        popularity_scores(np.array([1.0, -2.0]))
